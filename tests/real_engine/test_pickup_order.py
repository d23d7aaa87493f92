"""Who takes which job, on real workers: priorities, fair share between tenants, and
prefix-aware pickup (docs/features/prefix-aware-pickup.md).

One module-scoped worker (``--max-num-seqs 2 --engine-queue 3``, the worker's default
priority scheduling, its metrics served: vLLM's count of the requests waiting in its
engine) serves a queue of its own; the tests after the priority tests add a second real worker on it
(``other_worker``, started once, SIGKILLed by the last test). Backlogs are queued with
the library's enqueue script in one pipeline, so they are in place before a slot frees;
what a user observes is read with the library: a request's state (``status``), its
events, its result and the worker its final event names.
"""

from __future__ import annotations

import asyncio
import os
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as aioredis

from devkit.redis_server import free_port
from devkit.worker_process import SIZED_LINE, WorkerProcess, tiny_engine_flags, worker_env
from producer.client import Completion, RequestHandle, _job_payload
from producer.internal_client import InternalClient
from streamq.protocol import JOB_EXPIRY_MS, JOB_KEY_PREFIX, WAKEUP_CHANNEL, events_channel, parse_request
from streamq.protocol.names import AFFINITY_FREE_TTL_MS, MAX_AFFINITY_WINDOW_MS, affinity_free_key, waiting_key
from streamq.protocol.script_calls import Enqueue
from streamq.protocol.scripts import Script
from tests.support.metrics import scrape
from tests.support.session import MAX_MODEL_LEN
from tests.support.worker_faults import paused, pid_of

LONG = {"max_tokens": MAX_MODEL_LEN - 16, "ignore_eos": True}
"""Holds a slot for the whole context: cancelled by the test, never left to finish."""
SHORT = {"max_tokens": 2, "ignore_eos": True}


@pytest.fixture(scope="module")
def queue() -> str:
    return f"streamq:queue:prio-{uuid.uuid4().hex[:8]}"


@pytest.fixture(scope="module")
def two_slot_worker(
    worker_url: str, tiny_model: Path, queue: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[WorkerProcess]:
    flags = tiny_engine_flags(tiny_model, max_model_len=MAX_MODEL_LEN)
    flags += ["--max-num-seqs", "2", "--engine-queue", "3"]
    log_path = tmp_path_factory.mktemp("prio-worker") / "worker.log"
    process = WorkerProcess(worker_url, flags, queue=queue, log_path=log_path, metrics_port=free_port())
    process.start().wait_ready()
    yield process
    process.kill()


@pytest.fixture(scope="module")
def other_worker(
    two_slot_worker: WorkerProcess, tiny_model: Path, queue: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[WorkerProcess]:
    """A second real worker on the queue (the engine's default slots), ready to take jobs. Its
    engine computes on the second CPU: vLLM binds every engine of a host to the first by
    default, where the two-slot worker's long requests would starve its prefills."""
    flags = tiny_engine_flags(tiny_model, max_model_len=MAX_MODEL_LEN)
    log_path = tmp_path_factory.mktemp("other-worker") / "worker.log"
    env = worker_env(VLLM_CPU_OMP_THREADS_BIND=str(min(1, (os.cpu_count() or 1) - 1)))
    process = WorkerProcess(two_slot_worker.redis_url, flags, queue=queue, log_path=log_path, env=env).start()
    deadline = time.monotonic() + 300
    while SIZED_LINE not in process.log_tail(200):  # its engine is up (the queue's health check is not its own)
        assert process.process is not None and process.process.poll() is None, process.log_tail()
        assert time.monotonic() < deadline, process.log_tail()
        time.sleep(0.2)
    yield process
    process.kill()


@pytest.fixture
async def prio_client(two_slot_worker: WorkerProcess, producer_url: str) -> AsyncIterator[InternalClient]:
    async with await InternalClient.connect(producer_url, queue=two_slot_worker.queue) as client:
        yield client


async def enqueue_many(redis: aioredis.Redis, queue: str, requests: list[dict[str, Any]]) -> list[str]:
    """Queue ``requests`` (GenerateRequest fields) in order, in one round trip, with the
    enqueue script the library runs; returns their ids."""
    calls = []
    for fields in requests:
        request = parse_request({"prompt": "Hello there", **fields})
        request_id = request.request_id
        calls.append(
            Enqueue.of_request(
                request_id,
                queue,
                _job_payload(request),
                priority=request.priority,
                tenant=request.tenant or "default",
            )
        )
    assert await Script(redis, Enqueue).pipelined(calls) == [1] * len(requests)
    return [fields["request_id"] for fields in requests]


async def until_state(client: InternalClient, request_id: str, state: str, timeout_s: float = 120) -> None:
    """Until the request is in ``state``; fails at once if it went past it (a ``finished`` one
    waited for as ``running`` ran while nobody looked)."""
    later = {"queued": ("running", "finished"), "running": ("finished",)}.get(state, ())
    async with asyncio.timeout(timeout_s):
        while (now := (await client.status(request_id)).state) != state:
            assert now not in later, f"{request_id} is {now}, waited for as {state}"
            await asyncio.sleep(0.02)


async def until_waiting_in_engine(worker: WorkerProcess, count: int, timeout_s: float = 120) -> None:
    """Until the worker's engine holds ``count`` requests waiting for a slot (vLLM's
    ``vllm:num_requests_waiting``, as its scheduler last counted them): a claimed job is on
    its way there, through a thread of vLLM's, for a while after the claim."""
    async with asyncio.timeout(timeout_s):
        while (waiting := await asyncio.to_thread(engine_waiting, worker)) != count:
            assert waiting < count, f"{waiting} requests wait in the engine, more than the {count} expected"
            await asyncio.sleep(0.02)


def engine_waiting(worker: WorkerProcess) -> float:
    return sum(value for (name, _), value in scrape(worker).items() if name == "vllm:num_requests_waiting")


async def states(client: InternalClient, request_ids: list[str]) -> list[str]:
    return [(await client.status(request_id)).state for request_id in request_ids]


async def first_event(handle: RequestHandle) -> None:
    async with asyncio.timeout(120):
        async for _ in handle:
            return


async def first_logged_ms(redis: aioredis.Redis, request_id: str) -> int:
    """When the request's first event was logged: its entry id's ms (Redis's clock)."""
    [(entry_id, _)] = await redis.xrange(events_channel(request_id), count=1)
    return int(entry_id.split(b"-")[0])


async def cancel_all(client: InternalClient, request_ids: list[str]) -> None:
    for request_id in request_ids:
        await client.cancel(request_id, queue=client.queue)


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:10]}"


async def test_an_urgent_request_starts_next_ahead_of_a_backlog(
    two_slot_worker: WorkerProcess, prio_client: InternalClient, raw_redis: aioredis.Redis, queue: str
) -> None:
    """Both slots busy, two priority-10 jobs waiting in the worker's engine (its queue of
    requests to start as slots free) and 198 more in the queue: a priority-0 request
    submitted last is the next to start, ahead of those waiting in the engine too (no job
    of the backlog has generated a token when it sends its first event), then the backlog
    in its order (FIFO); cancelled, the backlog leaves nothing in the claim's index."""
    holders = [await prio_client.submit("Hold on", priority=5, **LONG) for _ in range(2)]
    for holder in holders:  # generating: both slots held (a claimed job is not in the engine yet)
        await first_event(holder)
    low = await enqueue_many(
        raw_redis, queue, [{"request_id": new_id("low"), "priority": 10, "sampling": SHORT} for _ in range(2)]
    )
    for request_id in low:  # claimed into the engine's queue: two of its three places
        await until_state(prio_client, request_id, "running")
    await until_waiting_in_engine(two_slot_worker, 2)
    # The urgent request first, in the same round trip as the rest of the backlog: the
    # claim the first enqueue wakes takes the urgent one whenever it runs (its band first).
    urgent_id, *rest = await enqueue_many(
        raw_redis,
        queue,
        [
            {"request_id": new_id("urgent"), "priority": 0, "sampling": SHORT},
            *({"request_id": new_id("low"), "priority": 10, "sampling": SHORT} for _ in range(198)),
        ],
    )
    low += rest
    urgent = await prio_client.follow(urgent_id)
    await until_state(prio_client, urgent_id, "running")  # the engine's third place
    await until_waiting_in_engine(two_slot_worker, 3)
    assert await states(prio_client, [h.request_id for h in holders]) == ["running", "running"], (
        "the holders ended before the backlog was queued: the test proves nothing"
    )
    try:
        await holders[0].cancel()
        await first_event(urgent)
        assert [await raw_redis.xlen(events_channel(request_id)) for request_id in low] == [0] * len(low)
        await holders[1].cancel()
        assert (await urgent.result()).finish_reasons == ["length"]
        await until_state(prio_client, low[9], "finished")
        # Each job's first event is logged with Redis's time (its entry id, in ms) as its
        # first token comes. Two jobs that start in one engine step (both slots freed
        # together) log theirs in either order within a ms or so; a job two places later
        # started later.
        started = [await first_logged_ms(raw_redis, request_id) for request_id in [urgent_id, *low[:10]]]
        assert started[0] <= min(started[1:]), "the urgent request did not start first"
        assert all(a <= b for a, b in zip(started, started[2:], strict=False)), f"out of order: {started}"
    finally:
        await cancel_all(prio_client, low)
        for handle in [*holders, urgent]:
            await handle.close()
    assert await raw_redis.hlen(f"{queue}:indexed") == 0
    assert await raw_redis.zcard(waiting_key(queue, 10)) == 0
    assert await raw_redis.keys(f"{queue}:fifo:*") == []


async def test_a_few_jobs_of_one_tenant_do_not_wait_behind_another_tenants_batch(
    prio_client: InternalClient, raw_redis: aioredis.Redis, queue: str
) -> None:
    """Tenant A queues 300 jobs, tenant B 10 afterwards: B's all finish while most of
    A's are still waiting (with FIFO they would finish after all 300)."""
    bulk = await enqueue_many(
        raw_redis, queue, [{"request_id": new_id("a"), "tenant": "bulk", "sampling": SHORT} for _ in range(300)]
    )
    interactive = await enqueue_many(
        raw_redis, queue, [{"request_id": new_id("b"), "tenant": "chat", "sampling": SHORT} for _ in range(10)]
    )
    try:
        for request_id in interactive:
            handle = await prio_client.follow(request_id)
            assert (await handle.result()).finish_reasons == ["length"]
            await handle.close()
        finished = (await states(prio_client, bulk)).count("finished")
        assert finished <= 100, f"{finished} of tenant A's 300 jobs finished before tenant B's 10"
        assert finished >= 1
    finally:
        await cancel_all(prio_client, bulk)


async def test_a_job_queued_by_a_bare_zadd_still_runs(prio_client: InternalClient, raw_redis: aioredis.Redis) -> None:
    """PROTOCOL.md's raw enqueue without the index steps (as a raw producer or arq's
    own ``enqueue_job`` queues): found by the claim's scan of arq's queue."""
    request = parse_request({"request_id": new_id("raw"), "prompt": "Raw", "sampling": SHORT})
    handle = await prio_client.follow(request.request_id)
    await raw_redis.set(JOB_KEY_PREFIX + request.request_id, _job_payload(request), px=JOB_EXPIRY_MS)
    now_s, now_us = await raw_redis.time()
    await raw_redis.zadd(prio_client.queue, {request.request_id: now_s * 1000 + now_us // 1000})
    await raw_redis.publish(WAKEUP_CHANNEL, prio_client.queue)
    assert (await handle.result()).finish_reasons == ["length"]
    await handle.close()


@pytest.fixture
async def chat_client(other_worker: WorkerProcess, producer_url: str, queue: str) -> AsyncIterator[InternalClient]:
    """A client whose requests wait up to the longest window (10 s) for the worker that
    served their prefix: on this 2-core machine, running two engines beside other tests, a
    worker's loop can stall for seconds, past the default 200 ms, and these tests are about
    where requests go, not about the window (the test of a SIGKILLed worker is)."""
    window_s = MAX_AFFINITY_WINDOW_MS / 1000
    async with await InternalClient.connect(producer_url, queue=queue, affinity_window_s=window_s) as client:
        yield client


INSTRUCTIONS = "You answer questions about the tiny model in short plain sentences. " * 5
"""A system prompt long enough (over 256 characters) to route by."""


def pid_of_process(worker: WorkerProcess) -> int:
    assert worker.process is not None
    return worker.process.pid


def runs_on(completion: Completion, worker: WorkerProcess) -> bool:
    return pid_of(completion.worker_id) == pid_of_process(worker)


async def until_not_claiming(redis: aioredis.Redis, queue: str, worker: WorkerProcess) -> None:
    """Wait until a paused worker's free slots lapse: from then on nothing is held for it."""
    async with asyncio.timeout(30):
        while any(
            pid_of(key.decode().rsplit(":", 1)[1]) == pid_of_process(worker)
            for key in await redis.keys(affinity_free_key(queue, "*"))
        ):
            await asyncio.sleep(0.05)


CLAIMED_WITHIN_MS = 1000
"""How recent a worker's last claim must be for ``until_claiming``: its free slots then
outlive the enqueue that follows by two seconds at least (``AFFINITY_FREE_TTL_MS``)."""


async def free_slots(redis: aioredis.Redis, queue: str, worker_id: str) -> tuple[int, int]:
    """``worker_id``'s free slots as enqueue reads them (0: none, or lapsed) and the ms
    left before they lapse (negative: no key)."""
    key = affinity_free_key(queue, worker_id)
    async with redis.pipeline(transaction=True) as pipe:
        free, left_ms = await pipe.get(key).pttl(key).execute()
    return int(free or 0), int(left_ms)


async def until_claiming(redis: aioredis.Redis, queue: str, worker_id: str) -> None:
    """Wait until ``worker_id`` has just claimed with a free slot (it claims every 50 ms
    while it has one): until then enqueue holds nothing for it. A key that merely exists
    may be one the worker set before a stall of its loop, seconds ago, about to lapse
    before the enqueue that follows reads it."""
    async with asyncio.timeout(30):
        while True:
            free, left_ms = await free_slots(redis, queue, worker_id)
            if free > 0 and left_ms >= AFFINITY_FREE_TTL_MS - CLAIMED_WITHIN_MS:
                return
            await asyncio.sleep(0.01)


async def claiming_worker_id(redis: aioredis.Redis, queue: str, worker: WorkerProcess) -> str:
    """The id of ``worker`` (a process) as its claims write it, once it has claimed."""
    async with asyncio.timeout(30):
        while True:
            for key in await redis.keys(affinity_free_key(queue, "*")):
                worker_id = key.decode().rsplit(":", 1)[1]
                if pid_of(worker_id) == pid_of_process(worker):
                    return worker_id
            await asyncio.sleep(0.02)


class Conversation:
    """A chat whose every turn sends the earlier turns, replies included, as a chat
    client does."""

    def __init__(self, client: InternalClient) -> None:
        self.client = client
        self.topic = uuid.uuid4().hex[:8]
        self.messages: list[dict[str, str]] = [{"role": "system", "content": f"Topic {self.topic}. {INSTRUCTIONS}"}]
        self.turns: list[Completion] = []

    def question(self) -> dict[str, str]:
        return {"role": "user", "content": f"Question {len(self.turns) + 1} about {self.topic}?"}

    async def submit(self, **options: Any) -> RequestHandle:
        """The next turn, submitted."""
        return await self.client.submit(
            messages=[*self.messages, self.question()], max_tokens=6, ignore_eos=True, **options
        )

    async def took(self, handle: RequestHandle) -> Completion:
        """The turn's completion, kept (with its question and reply) for the next turn."""
        async with asyncio.timeout(120):
            completion = await handle.result()
        self.messages += [self.question(), {"role": "assistant", "content": completion.text}]
        self.turns.append(completion)
        await handle.close()
        return completion

    async def turn(self, **options: Any) -> Completion:
        return await self.took(await self.submit(**options))


async def held_for(redis: aioredis.Redis, queue: str, request_id: str) -> str | None:
    """The worker enqueue held the request for, while it is held."""
    held = await redis.hget(f"{queue}:held", request_id)
    return None if held is None else held.decode()


async def test_a_conversations_follow_ups_go_to_the_worker_of_its_first_turn(
    other_worker: WorkerProcess, chat_client: InternalClient, raw_redis: aioredis.Redis
) -> None:
    """Four conversations of three turns, one turn at a time, each follow-up sent while the
    worker of its first turn has a free slot (its claims go on): each follow-up is held for
    that worker and served by it. On this loaded 2-core host a worker's loop can miss its
    claims for over the free slot's 3 s; its follow-up then rightly goes to whoever claims,
    which is why the test waits for the slot rather than assume it."""
    conversations = [Conversation(chat_client) for _ in range(4)]
    for _ in range(3):
        for conversation in conversations:
            if not conversation.turns:
                await conversation.turn()
                continue
            first = conversation.turns[0].worker_id
            await until_claiming(raw_redis, chat_client.queue, first)
            follow_up = await conversation.submit()
            held = await held_for(raw_redis, chat_client.queue, follow_up.request_id)
            free, left_ms = await free_slots(raw_redis, chat_client.queue, first)
            completion = await conversation.took(follow_up)
            assert completion.worker_id == first, (
                f"a follow-up held for {held} ran on {completion.worker_id}, not {first} "
                f"(after its enqueue, {first} had {free} free slots for {left_ms} ms)"
            )


async def test_a_follow_up_goes_elsewhere_at_once_when_its_worker_is_full(
    two_slot_worker: WorkerProcess, other_worker: WorkerProcess, chat_client: InternalClient, raw_redis: aioredis.Redis
) -> None:
    """A conversation served by the two-slot worker, which then runs two long requests:
    its follow-up is not held for it (but queued for all, or held for the other worker as
    the least busy), the two-slot worker does not take it into its engine's queue while the
    other has room, and the other worker serves it."""
    conversation = Conversation(chat_client)
    with paused(other_worker):
        await until_not_claiming(raw_redis, chat_client.queue, other_worker)
        assert runs_on(await conversation.turn(), two_slot_worker)
        holders = [await chat_client.submit("Hold on", **LONG) for _ in range(2)]
        for holder in holders:
            await until_state(chat_client, holder.request_id, "running")
    other_id = await claiming_worker_id(raw_redis, chat_client.queue, other_worker)
    await until_claiming(raw_redis, chat_client.queue, other_id)  # back, with room: no engine's queue takes it
    try:
        follow_up = await conversation.submit()
        held = await held_for(raw_redis, chat_client.queue, follow_up.request_id)
        assert held is None or pid_of(held) != pid_of_process(two_slot_worker), "held for the full worker"
        await first_event(follow_up)  # started elsewhere: the long requests have done their part
    finally:
        for holder in holders:
            await holder.cancel()
            await holder.close()
    assert runs_on(await conversation.took(follow_up), other_worker)


async def test_an_explicit_key_routes_unrelated_prompts_together_and_an_opt_out_is_never_held(
    two_slot_worker: WorkerProcess, other_worker: WorkerProcess, chat_client: InternalClient, raw_redis: aioredis.Redis
) -> None:
    """Short prompts (no prefix of their own) with one ``affinity_key`` go to one worker.
    A follow-up that opts out, its worker stalled, is not held for it: the other worker
    serves it, without becoming the conversation's worker."""
    for _ in range(3):
        key = f"document-{uuid.uuid4().hex[:8]}"
        first = await chat_client.generate("Summarise it", affinity_key=key, max_tokens=2)
        assert first.worker_id is not None
        await until_claiming(raw_redis, chat_client.queue, first.worker_id)
        second = await chat_client.generate("Quote it", affinity_key=key, max_tokens=2)
        assert second.worker_id == first.worker_id

    conversation = Conversation(chat_client)
    first = await conversation.turn()
    affinity_worker, elsewhere = sorted([two_slot_worker, other_worker], key=lambda worker: not runs_on(first, worker))
    with paused(affinity_worker):
        opted_out = await conversation.submit(affinity=False)
        assert await held_for(raw_redis, chat_client.queue, opted_out.request_id) is None
        assert runs_on(await conversation.took(opted_out), elsewhere)
    assert first.worker_id is not None
    await until_claiming(raw_redis, chat_client.queue, first.worker_id)
    assert (await conversation.turn()).worker_id == first.worker_id


async def test_a_dead_workers_request_is_taken_over_ahead_of_the_backlog(
    two_slot_worker: WorkerProcess,
    other_worker: WorkerProcess,
    prio_client: InternalClient,
    raw_redis: aioredis.Redis,
    queue: str,
) -> None:
    """The other worker serves a conversation's first turn, streams a request and is
    SIGKILLed; the conversation's follow-up, submitted at once, is held for the dead
    worker (its free slots have not lapsed yet). With its lease lapsed and 20 more urgent
    jobs queued meanwhile, the two-slot worker takes the request over first (its
    subscriber waits mid-stream) and finishes it before the backlog, the jobs waiting in
    its engine too; the follow-up (more urgent still) is served by the two-slot worker once
    its window passed."""
    doomed = other_worker
    assert doomed.process is not None
    target = new_id("target")
    backlog: list[str] = []
    conversation = Conversation(prio_client)
    try:
        with paused(two_slot_worker):
            assert runs_on(await conversation.turn(), doomed)
            handle = await prio_client.submit(request_id=target, prompt="Keep going", max_tokens=120, ignore_eos=True)
            async with asyncio.timeout(120):
                while await raw_redis.xlen(events_channel(target)) < 3:
                    await asyncio.sleep(0.005)
            doomed.kill()
            follow_up = await conversation.submit(priority=-10)
            assert pid_of(await held_for(raw_redis, queue, follow_up.request_id)) == doomed.process.pid
            deadline = time.monotonic() + 30
            while (await prio_client.status(target)).state == "running":  # the lease lapses
                assert time.monotonic() < deadline
                await asyncio.sleep(0.05)
            backlog = await enqueue_many(
                raw_redis,
                queue,
                [{"request_id": new_id("urgent"), "priority": -5, "sampling": LONG} for _ in range(20)],
            )
        async with asyncio.timeout(120):
            completion = await handle.result()
        assert completion.finish_reasons == ["length"] and completion.completion_tokens == 120
        finished = (await states(prio_client, backlog)).count("finished")
        assert finished == 0, f"{finished} of 20 backlog jobs finished before the taken-over request"
        assert runs_on(await conversation.took(follow_up), two_slot_worker)
    finally:
        doomed.kill()
        await cancel_all(prio_client, backlog)
