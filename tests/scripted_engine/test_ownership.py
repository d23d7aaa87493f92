"""Who owns a running request when two attempts disagree: the request's owner key decides,
read in the same script as every write (events, the lease, arq's bookkeeping), so the
request ends exactly once however its attempts interleave.

Two ``StreamqWorker``s run in this process, each with its own connections to a Redis of
the test's own (persistent, restarted as an operator would), on a scripted engine whose
tokens the test releases: each step of an interleaving happens when the test says so.
Worker A reaches Redis through a proxy the test can cut, so A can be away for longer than
B. Everything else is the product: arq's worker, the claim, the job function, the
publisher, the leases and the Lua scripts.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
import warnings
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError

from devkit.redis_server import FreezingProxy, RedisServer
from producer.client import RequestHandle, StreamqClient
from producer.errors import MissingEvents
from streamq.broker.replay_log import ReplayLog
from streamq.protocol import (
    IN_PROGRESS_PREFIX,
    JOB_KEY_PREFIX,
    LEASE_TTL_MS,
    RESULT_KEY_PREFIX,
    ChunkEvent,
    Event,
    FinalEvent,
    decode_event,
    owner_key,
)
from streamq.protocol.roles import PRODUCER, WORKER
from tests.support.events import job_result, lose_writes

with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)  # torch's own, raised while vLLM imports
    from devkit.scripted_engine import TokenScriptEngine
    from worker.arq_worker import StreamqWorker
    from worker.config import WorkerConfig
    from worker.lease import lease_holder
    from worker.state import WorkerState, state_of

PROMPT = "Tell me about the stars"
ANSWER = " The stars are far away, and they burn for a very long time before they fade."


class InProcessWorker:
    """A ``StreamqWorker`` on ``engine``, started up but not looping: each claim is the
    test's call (``claim``), while its background parts (publisher, leases, cancel
    listener, ...) run as in a worker process."""

    def __init__(self, url: str, engine: TokenScriptEngine, queue: str) -> None:
        self.engine = engine
        config = WorkerConfig(
            redis_url=url,
            queue=queue,
            max_jobs=4,
            engine_factory="devkit.scripted_engine:given",
            engine_args=engine,  # type: ignore[arg-type]
            metrics_port=0,
            cpu_nice=0,
        )
        self.arq = StreamqWorker(config, handle_signals=False)

    @property
    def state(self) -> WorkerState:
        return state_of(self.arq.ctx)

    async def claim(self, job_id: str, timeout_s: float = 20.0) -> asyncio.Task[Any]:
        """Poll until this worker has claimed ``job_id`` (Redis may still be starting);
        returns the task that runs it."""
        deadline = time.monotonic() + timeout_s
        while job_id not in self.arq.tasks:
            assert time.monotonic() < deadline, f"{job_id} was not claimed"
            try:
                await self.arq.poll()
            except (RedisConnectionError, OSError):
                await asyncio.sleep(0.1)
        return self.arq.tasks[job_id]


@pytest.fixture
async def redis_and_proxy() -> AsyncIterator[tuple[RedisServer, FreezingProxy]]:
    """A Redis of the test's own, with each component logging in as its role's user."""
    server = RedisServer(persistent=True, user="streamq", password=uuid.uuid4().hex)
    with server, FreezingProxy(server.port) as proxy:
        yield server, proxy


async def logged(raw: aioredis.Redis, request_id: str) -> list[Event]:
    return [decode_event(event) for event in await ReplayLog(raw).read(request_id)]


async def until(check: Callable[[], Awaitable[bool]], what: str, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not await check():
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        await asyncio.sleep(0.05)


def tokens_of(events: list[Event], attempt: int | None = None) -> int:
    return sum(
        len(e.token_ids) for e in events if isinstance(e, ChunkEvent) and (attempt is None or e.attempt == attempt)
    )


@dataclass
class Scene:
    """Two workers on one queue (A behind the proxy), a request submitted as the
    producer's user, and the undisturbed answer its engines script."""

    a: InProcessWorker
    b: InProcessWorker
    raw: aioredis.Redis
    """The harness's own connection, for inspecting what Redis holds."""
    client: StreamqClient
    handle: RequestHandle
    request_id: str
    queue: str
    script: list[int]
    tokenizer: Any

    async def has_tokens(self, count: int) -> bool:
        return tokens_of(await logged(self.raw, self.request_id)) >= count

    async def assert_ended_once_by_attempt_2(self, events: list[Event]) -> None:
        """``events`` are the log's: contiguous, one final, from attempt 2, with the
        script's tokens and the undisturbed text; the job finished once, by attempt 2."""
        assert events == await logged(self.raw, self.request_id)
        assert [event.seq for event in events] == list(range(len(events)))
        assert isinstance(events[-1], FinalEvent) and events[-1].attempt == 2
        assert [e for e in events if isinstance(e, FinalEvent)] == [events[-1]]
        assert [t for e in events if isinstance(e, ChunkEvent) for t in e.token_ids] == self.script
        assert "".join(e.text for e in events if isinstance(e, ChunkEvent)) == await self.undisturbed_text()
        assert events[-1].completion_tokens == len(self.script)
        result = await job_result(self.raw, self.request_id)
        assert result["t"] == 2 and result["r"]["completion_tokens"] == len(self.script)
        assert await self.raw.zcard(self.queue) == 0
        assert not await self.raw.exists(IN_PROGRESS_PREFIX + self.request_id)

    async def undisturbed_text(self) -> str:
        """The text a single attempt sends for the script."""
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        engine = TokenScriptEngine(self.tokenizer, list(self.tokenizer.encode(PROMPT)), self.script)
        params = SamplingParams(max_tokens=len(self.script), output_kind=RequestOutputKind.DELTA)
        return "".join([output.outputs[0].text async for output in engine.generate("calm", PROMPT, params)])


@contextlib.asynccontextmanager
async def scene(tiny_model: Path, server: RedisServer, proxy: FreezingProxy) -> AsyncIterator[Scene]:
    """Start both workers (their engines gated) and submit a request of 30 tokens that
    nobody has claimed yet."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    prompt_ids = list(tokenizer.encode(PROMPT))
    script = list(tokenizer.encode(ANSWER, add_special_tokens=False))[:30]
    assert len(script) == 30
    queue = f"streamq:queue:ownership-{uuid.uuid4().hex[:8]}"
    request_id = f"owned-{uuid.uuid4().hex}"
    worker_url = server.url_for(WORKER)
    a_url = worker_url.replace(f":{server.port}", f":{proxy.port}")
    a = InProcessWorker(a_url, TokenScriptEngine(tokenizer, prompt_ids, script, gated=True), queue)
    b = InProcessWorker(worker_url, TokenScriptEngine(tokenizer, prompt_ids, script, gated=True), queue)
    raw = aioredis.Redis.from_url(server.url)
    await a.arq.start_up()
    await b.arq.start_up()
    try:
        async with await StreamqClient.connect(server.url_for(PRODUCER), queue=queue) as client:
            handle = await client.submit(
                PROMPT, request_id=request_id, max_tokens=len(script), ignore_eos=True, temperature=0
            )
            yield Scene(a, b, raw, client, handle, request_id, queue, script, tokenizer)
    finally:
        await a.arq.close()
        await b.arq.close()
        await raw.aclose()


async def test_an_attempt_that_ends_after_its_request_was_taken_over_leaves_the_end_to_the_owner(
    tiny_model: Path, redis_and_proxy: tuple[RedisServer, FreezingProxy]
) -> None:
    """Attempt 1 streams, Redis restarts, and attempt 1 stays cut off longer than its
    lease; attempt 2 takes the request over from the log and streams on. Then attempt 1
    reaches Redis again and its generation ends, the rest of its answer and its final
    event in one flush, numbered as events attempt 2 has already written. Attempt 1 must
    learn that it no longer owns the request: it leaves the job queued, writes no result,
    and attempt 2 keeps its lease (renewed after attempt 1 is done) and ends the request,
    once, with the text of an undisturbed run."""
    server, proxy = redis_and_proxy
    async with scene(tiny_model, server, proxy) as s:
        # 1. Attempt 1 (worker A) streams 10 tokens.
        s.a.engine.release(10)
        a_job = await s.a.claim(s.request_id)
        await until(lambda: s.has_tokens(10), "attempt 1 logged 10 tokens")

        # 2. Redis restarts; A stays cut off past its lease. Its next renewal has not come
        # round when its generation ends (in the incident, 0.4 s after the take-over):
        # stopping its renewals makes that timing certain.
        await s.a.state.leases.close()
        proxy.cut()
        await asyncio.to_thread(server.stop)
        await asyncio.sleep(LEASE_TTL_MS / 1000 + 0.5)
        await asyncio.to_thread(server.start)

        # 3. Attempt 2 (worker B) claims the lapsed job, takes the request over from the
        # 10 tokens logged, and streams 5 more.
        b_job = await s.b.claim(s.request_id)
        await asyncio.wait_for(s.b.engine.started.wait(), 20)
        s.b.engine.release(5)
        await until(lambda: s.has_tokens(15), "attempt 2 logged 5 tokens")

        # 4. A is back, and the rest of its answer comes out in one output, with its end.
        proxy.heal()
        s.a.engine.release(20, together=True)
        assert await asyncio.wait_for(a_job, 30) is None  # arq's run_job, with its bookkeeping

        # A left the request to B: the job is queued, no result, B owns it and its lease.
        assert await s.raw.zscore(s.queue, s.request_id) is not None
        assert await s.raw.exists(JOB_KEY_PREFIX + s.request_id, RESULT_KEY_PREFIX + s.request_id) == 1
        assert await s.raw.get(owner_key(s.request_id)) == b"2"
        await s.b.state.leases.renew()
        holder = lease_holder(s.b.state.worker_id, 2).encode()
        assert await s.raw.get(IN_PROGRESS_PREFIX + s.request_id) == holder
        assert not b_job.done()

        # 5. B streams the rest and ends the request.
        s.b.engine.release(len(s.script) - 15)
        events = [event async for event in s.handle]
        await asyncio.wait_for(b_job, 30)
        await s.assert_ended_once_by_attempt_2(events)
        assert tokens_of(events, attempt=1) == 10


async def test_an_attempt_whose_events_redis_lost_hands_its_job_back_to_go_on_from_the_log(
    tiny_model: Path, redis_and_proxy: tuple[RedisServer, FreezingProxy]
) -> None:
    """Redis loses the latest writes it acknowledged (as a crash without fsync, or a
    failover to a replica that lagged, would) while attempt 1 streams: its next events would
    leave a gap, so the log refuses them and attempt 1 hands its job back. Attempt 2 goes on
    from what the log kept and ends the request once; a follower from the start gets the
    whole answer, and the handle that had delivered the lost events says it cannot go on
    rather than mix the two versions."""
    server, proxy = redis_and_proxy
    async with scene(tiny_model, server, proxy) as s:
        followed = asyncio.ensure_future(_events_of(s.handle))
        s.a.engine.release(10)
        a_job = await s.a.claim(s.request_id)
        await until(lambda: s.has_tokens(10), "attempt 1 logged 10 tokens")
        kept = (await logged(s.raw, s.request_id))[:4]
        await lose_writes(s.raw, s.request_id, keep=len(kept))

        s.a.engine.release(1)  # its next event would follow one the log no longer holds
        assert await asyncio.wait_for(a_job, 30) is None
        assert await s.raw.zscore(s.queue, s.request_id) is not None  # handed back, not finished
        assert not await s.raw.exists(IN_PROGRESS_PREFIX + s.request_id, RESULT_KEY_PREFIX + s.request_id)

        b_job = await s.b.claim(s.request_id)
        s.b.engine.release(len(s.script))
        await asyncio.wait_for(b_job, 30)
        with pytest.raises(MissingEvents, match="is no longer the one delivered"):
            await asyncio.wait_for(followed, 30)
        events = await _events_of(await s.client.follow(s.request_id))
        assert events[: len(kept)] == kept
        await s.assert_ended_once_by_attempt_2(events)


async def _events_of(handle: RequestHandle) -> list[Event]:
    return [event async for event in handle]
