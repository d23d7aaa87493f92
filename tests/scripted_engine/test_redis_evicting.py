"""A Redis that evicts (the deployment kept an evicting ``maxmemory-policy``, the worker
started with ``--allow-evicting-redis``): nothing hangs, every request ends once, and what
eviction cost names it.

Redis deletes keys of its choosing when full; the targeted tests delete one key each, as an
eviction would, on a Redis that has evicted keys before (so that streamq can tell that it
evicts): a queued job's payload, its place in the claim's index, a running request's lease,
its replay log, the workers' registrations. The soak lets a full ``allkeys-random`` Redis choose. A real worker on the
scripted engine; the library's client as a user runs it.
"""

from __future__ import annotations

import asyncio
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import redis.asyncio as aioredis

from devkit.redis_server import RedisServer
from devkit.worker_process import SCRIPTED_MODEL, WorkerProcess, scripted_worker
from producer.client import StreamqClient
from producer.errors import MissingEvents, RedisFull, RequestError, RequestLost, StreamqError, UnknownModel
from streamq.protocol import ChunkEvent, FinalEvent
from streamq.protocol.names import MODELS_KEY, WORKERS_KEY
from tests.support.worker_faults import paused

EVICTION_WORDS = "a full Redis evicts keys"
"""What every error that eviction caused says (``streamq.broker.memory_policy.eviction_cause``)."""


@pytest.fixture
def redis_server() -> Iterator[RedisServer]:
    with RedisServer() as server:
        yield server


@pytest.fixture
async def admin(redis_server: RedisServer) -> AsyncIterator[aioredis.Redis]:
    client = aioredis.Redis.from_url(redis_server.url)
    yield client
    await client.aclose()


@pytest.fixture
def worker(redis_server: RedisServer, tmp_path: Path) -> Iterator[WorkerProcess]:
    process = scripted_worker(redis_server.url, tmp_path / "worker.log", "--allow-evicting-redis", tokens_per_s=200)
    with_policy = asyncio.run(evict_some(redis_server.url))
    assert with_policy > 0
    process.start().wait_ready(timeout_s=120)
    yield process
    assert process.stop() == 0, process.log_tail()


async def evict_some(url: str) -> int:
    """``allkeys-lru``, under which Redis evicted ballast once it was full, then room again
    (no limit): keys go only where a test deletes them. Returns the keys evicted."""
    admin = aioredis.Redis.from_url(url)
    try:
        await admin.config_set("maxmemory-policy", "allkeys-lru")
        used = int((await admin.info("memory"))["used_memory"])
        await admin.config_set("maxmemory", used + 200_000)
        for i in range(400):
            await admin.set(f"ballast:{i}", b"x" * 1000)
        await admin.config_set("maxmemory", 0)
        return int((await admin.info("stats"))["evicted_keys"])
    finally:
        await admin.aclose()


async def first_tokens(handle: object, count: int) -> list[ChunkEvent]:
    events: list[ChunkEvent] = []
    async with asyncio.timeout(60):
        async for event in handle:  # type: ignore[attr-defined]
            assert isinstance(event, ChunkEvent)
            events.append(event)
            if len(events) == count:
                return events
    raise AssertionError("the stream ended early")


async def test_a_queued_job_whose_payload_was_evicted_fails_naming_eviction(
    worker: WorkerProcess, admin: aioredis.Redis, redis_server: RedisServer
) -> None:
    async with await StreamqClient.connect(redis_server.url) as client:
        with paused(worker):
            handle = await client.submit("evicted while queued", max_tokens=8)
            await admin.delete(f"arq:job:{handle.request_id}")
        with pytest.raises(RequestError) as failed:
            await asyncio.wait_for(handle.result(), 60)
    assert failed.value.code == "expired"
    assert "payload was gone" in failed.value.message and EVICTION_WORDS in failed.value.message
    assert "maxmemory-policy allkeys-lru" in failed.value.message
    assert worker.process is not None and worker.process.poll() is None, worker.log_tail()


async def test_a_request_whose_queue_was_evicted_is_lost_naming_eviction_not_waited_for(
    worker: WorkerProcess, admin: aioredis.Redis, redis_server: RedisServer
) -> None:
    """Its job is still stored, but no queue lists it: nobody will ever claim it, and the
    handle's watchdog says so (``RequestLost``) instead of waiting for it forever."""
    async with await StreamqClient.connect(redis_server.url, silence_check_s=1) as client:
        with paused(worker):
            handle = await client.submit("queue evicted", max_tokens=8)
            queue_keys = [key async for key in admin.scan_iter(match=f"{client.queue}*")]
            await admin.delete(*queue_keys)
            assert await admin.exists(f"arq:job:{handle.request_id}")
        with pytest.raises(RequestLost) as lost:
            await asyncio.wait_for(handle.result(), 30)
    assert EVICTION_WORDS in str(lost.value), lost.value


@pytest.mark.parametrize("evicted", ["its tenant's queue", "the bands"])
async def test_a_queued_job_whose_place_in_the_index_was_evicted_is_still_run(
    worker: WorkerProcess, admin: aioredis.Redis, redis_server: RedisServer, evicted: str
) -> None:
    """The claim's index (the priority bands, each band's tenants, each tenant's queue of
    jobs) lost the job's place, its entry still there: the claim's scan of arq's queue finds
    the job no claim reaches any more, and it runs, instead of waiting queued forever."""
    async with await StreamqClient.connect(redis_server.url) as client:
        with paused(worker):
            handle = await client.submit("index evicted", max_tokens=8, ignore_eos=True)
            pattern = f"{client.queue}:fifo:*" if evicted == "its tenant's queue" else f"{client.queue}:bands"
            keys = [key async for key in admin.scan_iter(match=pattern)]
            assert keys and await admin.delete(*keys) == len(keys)
            assert await admin.hexists(f"{client.queue}:indexed", handle.request_id)
        completion = await asyncio.wait_for(handle.result(), 30)
    assert completion.completion_tokens == 8 and completion.finish_reasons == ["length"]


async def test_a_running_request_whose_lease_was_evicted_ends_once_with_every_token(
    worker: WorkerProcess, admin: aioredis.Redis, redis_server: RedisServer
) -> None:
    """The worker's next lease renewal sets it again (the request's owner key says the
    attempt still owns it), before the lease's time would have let anyone take the job: the
    stream ends once, each token once, from the one attempt."""
    async with await StreamqClient.connect(redis_server.url) as client:
        handle = await client.submit("lease evicted", max_tokens=1000, ignore_eos=True)  # 5 s
        events: list[ChunkEvent | FinalEvent] = list(await first_tokens(handle, 5))
        lease = f"arq:in-progress:{handle.request_id}"
        assert await admin.delete(lease) == 1
        async with asyncio.timeout(10):
            while not await admin.exists(lease):
                await asyncio.sleep(0.05)
        async with asyncio.timeout(90):
            events += [event async for event in handle]  # type: ignore[misc]
    assert [event.seq for event in events] == list(range(len(events))), "a gap or a repeat"
    assert sum(len(e.token_ids) for e in events if isinstance(e, ChunkEvent)) == 1000
    assert {e.attempt for e in events} == {1}
    assert [type(e) for e in events].count(FinalEvent) == 1 and isinstance(events[-1], FinalEvent)


async def test_a_running_request_whose_replay_log_was_evicted_ends_once_or_fails_naming_eviction(
    worker: WorkerProcess, admin: aioredis.Redis, redis_server: RedisServer
) -> None:
    """The worker finds its log cut short and hands the job back; the next attempt starts
    over from the empty log. A reader that had the first tokens gets the rest where the new
    attempt's events are the ones it had (the scripted engine repeats itself), else
    ``MissingEvents`` naming eviction: never a spliced stream, never a wait without end."""
    async with await StreamqClient.connect(redis_server.url) as client:
        handle = await client.submit("log evicted", max_tokens=200, ignore_eos=True)
        events: list[ChunkEvent | FinalEvent] = list(await first_tokens(handle, 5))
        assert await admin.delete(f"streamq:events:{handle.request_id}") == 1
        try:
            async with asyncio.timeout(90):
                events += [event async for event in handle]  # type: ignore[misc]
        except MissingEvents as lost:
            assert EVICTION_WORDS in str(lost), lost
        else:
            assert [event.seq for event in events] == list(range(len(events))), "a gap or a repeat"
            assert sum(len(e.token_ids) for e in events if isinstance(e, ChunkEvent)) == 200
            assert [type(e) for e in events].count(FinalEvent) == 1
    assert worker.process is not None and worker.process.poll() is None, worker.log_tail()


async def test_evicted_registrations_are_restored_and_a_refusal_meanwhile_names_eviction(
    worker: WorkerProcess, admin: aioredis.Redis, redis_server: RedisServer
) -> None:
    async with await StreamqClient.connect(redis_server.url) as client:
        assert (await client.generate("before", model=SCRIPTED_MODEL, max_tokens=4, ignore_eos=True)).text
        with paused(worker):  # it renews its registration every 3 s: not before the refusal
            await admin.delete(WORKERS_KEY, MODELS_KEY)
            async with await StreamqClient.connect(redis_server.url) as newcomer:  # no routes read before
                with pytest.raises(UnknownModel) as refused:
                    await newcomer.submit("meanwhile", model=SCRIPTED_MODEL, max_tokens=4)
        assert "registrations" in str(refused.value) and EVICTION_WORDS in str(refused.value)
        async with asyncio.timeout(30):  # renewed every 3 s: registered again at the next
            while "registration was gone from Redis" not in worker.log_path.read_text():
                await asyncio.sleep(0.1)
        after = await client.generate("after", model=SCRIPTED_MODEL, max_tokens=4, ignore_eos=True)
        assert after.completion_tokens == 4


async def test_under_a_full_evicting_redis_every_request_ends_once_and_none_hangs(
    redis_server: RedisServer, admin: aioredis.Redis, tmp_path: Path
) -> None:
    """``allkeys-random`` on a Redis kept full by ballast: Redis evicts whatever it picks,
    streamq's keys among them, while 1,000 requests run 16 at a time. Each ends once, with
    its completion or an error; every error names eviction (or Redis full, where it found
    nothing to evict in time); none waits past its bound; the worker serves throughout."""
    await admin.config_set("maxmemory-policy", "allkeys-random")
    worker = scripted_worker(redis_server.url, tmp_path / "worker.log", "--allow-evicting-redis", tokens_per_s=2000)
    worker.start().wait_ready(timeout_s=120)
    used = int((await admin.info("memory"))["used_memory"])
    await admin.config_set("maxmemory", used + 4_000_000)
    for i in range(3500):
        await admin.set(f"ballast:{i}", b"x" * 1000)
    outcomes: Counter[str] = Counter()
    unexplained: list[str] = []
    waited: list[str] = []  # the requests that waited past their bound, with what Redis says of them
    try:
        async with await StreamqClient.connect(redis_server.url) as client:
            slots = asyncio.Semaphore(16)

            async def one(i: int) -> None:
                async with slots:
                    request_id = f"evict-{i}-{uuid.uuid4().hex[:6]}"
                    try:
                        handle = await client.submit(f"p{i}", request_id=request_id, max_tokens=16, ignore_eos=True)
                        completion = await asyncio.wait_for(handle.result(), 60)
                    except StreamqError as exc:
                        outcomes[type(exc).__name__] += 1
                        if EVICTION_WORDS not in str(exc) and not isinstance(exc, RedisFull):
                            unexplained.append(str(exc))
                    except TimeoutError:
                        outcomes["waited past 60 s"] += 1
                        waited.append(f"{request_id}: {await client.status(request_id)}")
                    else:
                        assert completion.completion_tokens == 16
                        outcomes["completed"] += 1

            await asyncio.gather(*(one(i) for i in range(1000)))
        evicted = int((await admin.info("stats"))["evicted_keys"])
    finally:
        await admin.config_set("maxmemory", 0)
        assert worker.stop() == 0, worker.log_tail()
    assert evicted > 0, "Redis evicted nothing: the test did not test"
    assert sum(outcomes.values()) == 1000 and "waited past 60 s" not in outcomes, f"{outcomes}: {'; '.join(waited)}"
    assert not unexplained, unexplained[:3]
