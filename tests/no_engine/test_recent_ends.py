"""The scripts that write a request's terminal event push it to ``streamq:recent-ends``
in the same call: exactly one entry per ended request (a duplicate, a fenced-off attempt
or a second end adds none), none for chunks, newest first, capped."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis

from devkit.redis_server import RedisServer
from streamq.broker.replay_log import LogEvent, ReplayLog
from streamq.broker.worker_stats import WorkerStatsStore
from streamq.protocol import ChunkEvent, ErrorEvent, FinalEvent, decode_event, encode_event
from streamq.protocol.names import RECENT_ENDS_KEY
from streamq.protocol.roles import PRODUCER, WORKER


@pytest.fixture
async def worker_redis(redis_server: RedisServer) -> AsyncIterator[aioredis.Redis]:
    client = aioredis.Redis.from_url(redis_server.url_for(WORKER))
    yield client
    await client.aclose()


def _id() -> str:
    return f"test-{uuid.uuid4().hex}"


def _chunk(request_id: str, seq: int, attempt: int = 1) -> LogEvent:
    event = ChunkEvent(request_id=request_id, seq=seq, attempt=attempt, index=0, text="a", token_ids=[1])
    return LogEvent(request_id, seq, attempt, encode_event(event))


def _final(request_id: str, seq: int, attempt: int = 1) -> LogEvent:
    event = FinalEvent(
        request_id=request_id, seq=seq, attempt=attempt, finish_reasons=["stop"], prompt_tokens=1, completion_tokens=1
    )
    return LogEvent(request_id, seq, attempt, encode_event(event), terminal=True)


async def _entries(admin: aioredis.Redis, request_ids: set[str]) -> list[bytes]:
    """The list's entries of ``request_ids``, newest first."""
    return [e for e in await admin.lrange(RECENT_ENDS_KEY, 0, -1) if e.split(b" ", 1)[0].decode() in request_ids]


async def _redis_ms(redis: aioredis.Redis) -> int:
    seconds, micros = await redis.time()
    return int(seconds) * 1000 + int(micros) // 1000


async def test_a_worker_s_terminal_event_is_pushed_once(worker_redis: aioredis.Redis, admin: aioredis.Redis) -> None:
    log = ReplayLog(worker_redis, maxlen=100, ttl_ms=60_000)
    first, second = _id(), _id()
    await log.append([_chunk(first, 0), _chunk(second, 0)])
    assert await _entries(admin, {first, second}) == [], "chunks end nothing"
    before = await _redis_ms(admin)
    # Both end in one batch; then a retried batch (duplicates) and a late event add nothing.
    await log.append([_chunk(first, 1), _final(first, 2), _final(second, 1)])
    after = await _redis_ms(admin)
    await log.append([_final(first, 2), _final(second, 1)])
    await log.append([_chunk(first, 3)])
    await log.append([_final(first, 3, attempt=2)])
    ends = [e for e in await WorkerStatsStore(admin).recent_ends() if e.request_id in {first, second}]
    assert [e.request_id for e in ends] == [second, first], "newest first"
    assert all(before <= e.ended_ms <= after for e in ends)
    assert ends[1].event == decode_event(_final(first, 2).payload)
    assert ends[0].event == decode_event(_final(second, 1).payload)


async def test_a_fenced_off_attempt_s_end_is_not_pushed(worker_redis: aioredis.Redis, admin: aioredis.Redis) -> None:
    log = ReplayLog(worker_redis, maxlen=100, ttl_ms=60_000)
    request_id = _id()
    await log.append([_chunk(request_id, 0)])
    await log.take_over(request_id, 2)
    await log.append([_final(request_id, 1, attempt=1)])  # the old attempt: refused
    assert await _entries(admin, {request_id}) == []
    await log.append([_final(request_id, 1, attempt=2)])
    assert len(await _entries(admin, {request_id})) == 1


async def test_the_list_is_capped(worker_redis: aioredis.Redis, admin: aioredis.Redis) -> None:
    log = ReplayLog(worker_redis, maxlen=100, ttl_ms=60_000, recent_ends_max=3)
    ids = [_id() for _ in range(5)]
    await log.append([_final(request_id, 0) for request_id in ids[:4]])
    assert await admin.llen(RECENT_ENDS_KEY) == 3
    await log.end(ids[4], ErrorEvent(request_id=ids[4], seq=0, code="internal", message="x"))
    assert [e.request_id for e in await WorkerStatsStore(admin).recent_ends()] == [ids[4], ids[3], ids[2]]


async def test_an_end_from_outside_is_pushed_once(redis_server: RedisServer, admin: aioredis.Redis) -> None:
    """``end_request`` as the producer (a cancel while queued) and as a worker (a job arq
    gave up on): one entry each, and none when the request had ended already."""
    producer = aioredis.Redis.from_url(redis_server.url_for(PRODUCER))
    worker = aioredis.Redis.from_url(redis_server.url_for(WORKER))
    try:
        cancelled, failed, finished = _id(), _id(), _id()
        await ReplayLog(worker, maxlen=100, ttl_ms=60_000).append([_chunk(cancelled, 0), _final(finished, 0)])
        final = FinalEvent(
            request_id=cancelled, seq=0, finish_reasons=["cancelled"], prompt_tokens=0, completion_tokens=0
        )
        before = await _redis_ms(admin)
        assert await ReplayLog(producer, maxlen=100, ttl_ms=60_000).end(cancelled, final) == 1
        error = ErrorEvent(request_id=failed, seq=0, code="internal", message="arq gave up")
        assert await ReplayLog(worker, maxlen=100, ttl_ms=60_000).end(failed, error) == 0
        after = await _redis_ms(admin)
        for request_id in (cancelled, failed, finished):  # ended already: nothing more
            late = ErrorEvent(request_id=request_id, seq=0, code="internal", message="late")
            assert await ReplayLog(producer, maxlen=100, ttl_ms=60_000).end(request_id, late) is None
        ends = {e.request_id: e for e in await WorkerStatsStore(admin).recent_ends()}
        assert len(await _entries(admin, {cancelled, failed, finished})) == 3
        assert isinstance(ends[cancelled].event, FinalEvent)
        assert ends[cancelled].event.finish_reasons == ["cancelled"]
        assert ends[cancelled].event.completion_tokens == 1 and ends[cancelled].event.seq == 1
        assert ends[failed].event == ErrorEvent(request_id=failed, seq=0, code="internal", message="arq gave up")
        assert before <= ends[cancelled].ended_ms <= ends[failed].ended_ms <= after
    finally:
        await producer.aclose()
        await worker.aclose()
