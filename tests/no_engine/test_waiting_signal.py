"""The waiting signal on a real Redis, with the real scripts: ``<queue>:waiting`` holds the
requests due and not started, from the library's enqueue until a worker's claim takes
them, whatever happens between (a deferral coming due, a lease lapsing with no worker
alive, a hand-back, a cancel), and the gauges and KEDA's scaler read it as it is. A
randomized run holds it against the truth (arq's queue, less what runs and what is not
due) after every step."""

from __future__ import annotations

import asyncio
import random
import uuid
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis

from devkit.keda import LIST_LENGTH_SCRIPT
from producer.client import StreamqClient
from streamq.broker.waiting import WaitingRequests
from streamq.protocol import IN_PROGRESS_PREFIX
from streamq.protocol.names import WAKEUP_CHANNEL, queue_waiting_key, running_key
from streamq.protocol.script_calls import ClaimJobs, FinishJob
from streamq.protocol.scripts import Script


class Worker:
    """A worker's side of the queue, as the scripts see it: claims, finishes, hand-backs."""

    def __init__(self, redis: aioredis.Redis, queue: str, worker_id: str) -> None:
        self.queue, self.worker_id = queue, worker_id
        self._claim = Script(redis, ClaimJobs)
        self._finish = Script(redis, FinishJob)

    async def claim(self, wanted: int = 1, lease_ms: int = 3000) -> list[str]:
        call = ClaimJobs(
            queue=self.queue,
            wanted=wanted,
            lease_ms=lease_ms,
            page=100,
            in_progress_prefix=IN_PROGRESS_PREFIX,
            worker_id=self.worker_id,
            wakeup_channel=WAKEUP_CHANNEL,
        )
        return [job.job_id for job in ClaimJobs.reply(await self._claim(call)).jobs]

    async def finish(self, job_id: str, action: str = "finish") -> None:
        """arq's bookkeeping at the end of an attempt: ``finish``, or ``retry`` (handed back)."""
        call = FinishJob.of_job(
            job_id,
            self.queue,
            worker_id=self.worker_id,
            holder=f"{self.worker_id}:1",
            attempt=0,
            action=action,
            result_ttl_ms=0,
        )
        await self._finish(call)


@pytest.fixture
async def queue(raw_redis: aioredis.Redis) -> AsyncIterator[str]:
    name = f"streamq:queue:waiting-{uuid.uuid4().hex[:8]}"
    yield name
    keys = await raw_redis.keys(name + "*")
    if keys:
        await raw_redis.delete(*keys)


@pytest.fixture
async def client(producer_url: str, queue: str) -> AsyncIterator[StreamqClient]:
    async with await StreamqClient.connect(producer_url, queue=queue, affinity_window_s=0) as client:
        yield client


@pytest.fixture
def waiting(raw_redis: aioredis.Redis) -> WaitingRequests:
    return WaitingRequests(raw_redis)


async def submit(client: StreamqClient, **kwargs: object) -> str:
    handle = await client.submit("Hello", max_tokens=4, **kwargs)  # type: ignore[arg-type]
    await handle.close()
    return handle.request_id


async def waiting_now(waiting: WaitingRequests, queue: str) -> tuple[int, float]:
    (read,) = await waiting.read({queue: "m"})
    return read.waiting, read.oldest_wait_s


async def test_a_request_waits_from_its_enqueue_until_a_worker_takes_it(
    client: StreamqClient, waiting: WaitingRequests, raw_redis: aioredis.Redis, queue: str
) -> None:
    ids = [await submit(client, priority=priority) for priority in (5, 0, -3)]
    await asyncio.sleep(0.05)
    count, oldest_s = await waiting_now(waiting, queue)
    assert count == 3
    assert 0.04 <= oldest_s < 5
    assert await Worker(raw_redis, queue, "w1").claim(2) == [ids[2], ids[1]]  # the most urgent first
    assert await raw_redis.zrange(queue_waiting_key(queue), 0, -1) == [ids[0].encode()]
    assert await client.cancel(ids[0]) == "queued"
    assert await waiting_now(waiting, queue) == (0, 0.0)


async def test_a_deferred_request_waits_once_due_and_tending_counts_it_with_no_worker_alive(
    client: StreamqClient, waiting: WaitingRequests, queue: str
) -> None:
    await submit(client, defer_s=0.3)
    assert (await waiting_now(waiting, queue))[0] == 0
    await asyncio.sleep(0.4)
    assert (await waiting_now(waiting, queue))[0] == 0  # due, but nobody has looked yet
    await waiting.tend([queue])
    assert (await waiting_now(waiting, queue))[0] == 1


async def test_tending_loads_its_script_on_a_redis_that_forgot_it(
    client: StreamqClient, gateway_url: str, raw_redis: aioredis.Redis, queue: str
) -> None:
    await submit(client, defer_s=0.05)
    await asyncio.sleep(0.1)
    await raw_redis.script_flush()  # as after a restart
    gateway = aioredis.Redis.from_url(gateway_url)  # a Redis user that may not ask SCRIPT EXISTS
    try:
        await WaitingRequests(gateway).tend([queue])
    finally:
        await gateway.aclose()
    assert await raw_redis.zcard(queue_waiting_key(queue)) == 1


async def test_a_dead_workers_request_waits_again_until_another_takes_it_over(
    client: StreamqClient, waiting: WaitingRequests, raw_redis: aioredis.Redis, queue: str
) -> None:
    request_id = await submit(client)
    assert await Worker(raw_redis, queue, "w1").claim(lease_ms=100) == [request_id]
    assert (await waiting_now(waiting, queue))[0] == 0
    await asyncio.sleep(0.2)  # w1 died: its lease lapsed
    await waiting.tend([queue])
    count, oldest_s = await waiting_now(waiting, queue)
    assert count == 1
    assert oldest_s < 1  # waiting since its lease lapsed, not since its enqueue
    assert await Worker(raw_redis, queue, "w2").claim() == [request_id]
    assert (await waiting_now(waiting, queue))[0] == 0


async def test_a_request_handed_back_by_a_stopping_worker_waits_at_once(
    client: StreamqClient, waiting: WaitingRequests, raw_redis: aioredis.Redis, queue: str
) -> None:
    request_id = await submit(client)
    worker = Worker(raw_redis, queue, "w1")
    assert await worker.claim() == [request_id]
    await worker.finish(request_id, "retry")
    assert (await waiting_now(waiting, queue))[0] == 1
    assert await Worker(raw_redis, queue, "w2").claim() == [request_id]
    await Worker(raw_redis, queue, "w2").finish(request_id)
    assert (await waiting_now(waiting, queue))[0] == 0


async def test_kedas_redis_scaler_reads_the_waiting_count_from_the_key_as_it_is(
    client: StreamqClient, raw_redis: aioredis.Redis, queue: str
) -> None:
    keda = raw_redis.register_script(LIST_LENGTH_SCRIPT)
    assert await keda(keys=[queue_waiting_key(queue)]) == 0  # no key yet: LLEN of nothing
    for _ in range(4):
        await submit(client)
    assert await keda(keys=[queue_waiting_key(queue)]) == 4
    await Worker(raw_redis, queue, "w1").claim(3)
    assert await keda(keys=[queue_waiting_key(queue)]) == 1


async def redis_ms(raw_redis: aioredis.Redis) -> int:
    seconds, micros = await raw_redis.time()
    return int(seconds) * 1000 + int(micros) // 1000


async def truth(raw_redis: aioredis.Redis, queue: str, at_ms: int) -> set[str]:
    """What waits at ``at_ms``, by arq's own keys: due in arq's queue, and no lease held."""
    due = [job_id.decode() for job_id in await raw_redis.zrangebyscore(queue, "-inf", at_ms)]
    held = await raw_redis.mget([IN_PROGRESS_PREFIX + job_id for job_id in due]) if due else []
    return {job_id for job_id, lease in zip(due, held, strict=True) if lease is None}


async def test_the_waiting_set_equals_the_truth_after_every_step_of_a_random_run(
    client: StreamqClient, waiting: WaitingRequests, raw_redis: aioredis.Redis, queue: str
) -> None:
    seed = random.randrange(2**32)
    rng = random.Random(seed)
    workers = [Worker(raw_redis, queue, f"w{i}") for i in range(3)]
    running: dict[str, Worker] = {}
    queued: set[str] = set()
    for step in range(300):
        move = rng.choice(["enqueue", "enqueue", "defer", "claim", "claim", "finish", "hand back", "die", "cancel"])
        if move in ("enqueue", "defer"):
            queued.add(await submit(client, defer_s=rng.choice([0.01, 0.05]) if move == "defer" else 0))
        elif move == "claim":
            worker = rng.choice(workers)
            for job_id in await worker.claim(rng.randint(1, 3), lease_ms=60_000):
                running[job_id] = worker
        elif move in ("finish", "hand back") and running:
            job_id = rng.choice(sorted(running))
            await running.pop(job_id).finish(job_id, "finish" if move == "finish" else "retry")
        elif move == "die" and running:  # its worker died, and its lease lapsed (now, not in a minute)
            job_id = rng.choice(sorted(running))
            del running[job_id]
            await raw_redis.delete(IN_PROGRESS_PREFIX + job_id)
            await raw_redis.zadd(running_key(queue), {job_id: await redis_ms(raw_redis)})
        elif move == "cancel" and queued:
            await client.cancel(rng.choice(sorted(queued)))
        if rng.random() < 0.1:
            await asyncio.sleep(0.06)  # deferrals come due
        before_ms = await redis_ms(raw_redis)
        await waiting.tend([queue])
        members = {job_id.decode() for job_id in await raw_redis.zrange(queue_waiting_key(queue), 0, -1)}
        after_ms = await redis_ms(raw_redis)
        # A deferral may come due while the tending runs: it waits by then, or not yet.
        low, high = await truth(raw_redis, queue, before_ms), await truth(raw_redis, queue, after_ms)
        assert low <= members <= high, f"seed {seed}, step {step} ({move}): {members ^ low}"
