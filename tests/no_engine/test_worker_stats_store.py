"""Workers' reports and the recent ends in Redis, through ``report_worker_stats`` and
``WorkerStatsStore``: a report is stored and stamped with Redis's time, stale ones are
pruned, and a reader skips what it cannot parse instead of failing the dashboard."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from typing import Any

import pytest
import redis.asyncio as aioredis

from devkit.redis_server import RedisServer
from streamq.broker.worker_stats import WorkerStatsStore
from streamq.protocol import ErrorEvent, FinalEvent, encode_event
from streamq.protocol.names import RECENT_ENDS_KEY, WORKER_STATS_KEY, WORKER_STATS_SEEN_KEY
from streamq.protocol.roles import WORKER
from streamq.protocol.worker_stats import InFlightRequest, WorkerStats


@pytest.fixture
async def worker_redis(redis_server: RedisServer) -> AsyncIterator[aioredis.Redis]:
    client = aioredis.Redis.from_url(redis_server.url_for(WORKER))
    yield client
    await client.aclose()


def _stats(worker_id: str, **fields: Any) -> WorkerStats:
    return WorkerStats(
        worker_id=worker_id, model="tiny", queue="streamq:queue", host="h", pid=7, started_ms=1, **fields
    )


async def _redis_ms(redis: aioredis.Redis) -> int:
    seconds, micros = await redis.time()
    return int(seconds) * 1000 + int(micros) // 1000


async def test_a_report_is_stored_and_stamped_with_redis_time(
    worker_redis: aioredis.Redis, admin: aioredis.Redis
) -> None:
    worker_id = f"w-{uuid.uuid4().hex[:8]}"
    stats = _stats(
        worker_id,
        in_flight=[InFlightRequest(request_id="r1", started_ms=5, attempt=2, completion_tokens=3, tenant="t")],
        generated_tokens=40,
        requests_finished=2,
        errors={"invalid_request": 1},
        ttft_buckets=[(0.01, 1), (0.02, 2)],
        ttft_count=2,
    )
    before = await _redis_ms(admin)
    await WorkerStatsStore(worker_redis).report(stats)
    after = await _redis_ms(admin)
    read = {s.worker_id: s for s in await WorkerStatsStore(admin).read()}[worker_id]
    assert before <= read.reported_ms <= after
    read.reported_ms = 0
    assert read == stats
    stats.generated_tokens = 41
    await WorkerStatsStore(worker_redis).report(stats)  # a worker's report replaces its last
    reports = [s for s in await WorkerStatsStore(admin).read() if s.worker_id == worker_id]
    assert [r.generated_tokens for r in reports] == [41]


async def test_reports_older_than_keep_ms_are_pruned_by_the_next_report(
    worker_redis: aioredis.Redis, admin: aioredis.Redis
) -> None:
    gone, kept, reporter = (f"w-{uuid.uuid4().hex[:8]}" for _ in range(3))
    store = WorkerStatsStore(worker_redis)
    await store.report(_stats(gone))
    await store.report(_stats(kept))
    now = await _redis_ms(admin)
    await admin.zadd(WORKER_STATS_SEEN_KEY, {gone: now - 60_000, kept: now - 1_000})  # as if reported then
    await store.report(_stats(reporter), keep_ms=30_000)
    assert not await admin.hexists(WORKER_STATS_KEY, gone)
    assert await admin.zscore(WORKER_STATS_SEEN_KEY, gone) is None
    ids = [s.worker_id for s in await WorkerStatsStore(admin).read()]
    assert kept in ids and reporter in ids and gone not in ids
    assert ids.index(kept) < ids.index(reporter), "oldest report first"


async def test_a_malformed_report_is_skipped(worker_redis: aioredis.Redis, admin: aioredis.Redis) -> None:
    good, bad = f"w-{uuid.uuid4().hex[:8]}", f"w-{uuid.uuid4().hex[:8]}"
    await WorkerStatsStore(worker_redis).report(_stats(good))
    await admin.hset(WORKER_STATS_KEY, bad, b'{"worker_id": 3}')
    try:
        ids = [s.worker_id for s in await WorkerStatsStore(admin).read()]
        assert good in ids and bad not in ids
    finally:
        await admin.hdel(WORKER_STATS_KEY, bad)


async def test_recent_ends_round_trip_newest_first_skipping_malformed_entries(admin: aioredis.Redis) -> None:
    final = FinalEvent(request_id="a", seq=3, finish_reasons=["stop"], prompt_tokens=2, completion_tokens=5)
    error = ErrorEvent(request_id="b", seq=0, code="invalid_request", message="no")
    await admin.lpush(RECENT_ENDS_KEY, b"a 1000 " + encode_event(final))
    await admin.lpush(RECENT_ENDS_KEY, b"not an entry")
    await admin.lpush(RECENT_ENDS_KEY, b'c 1001 {"type":"chunk","request_id":"c","seq":0,"index":0,"text":"x"}')
    await admin.lpush(RECENT_ENDS_KEY, b"b 1002 " + encode_event(error))
    ends = await WorkerStatsStore(admin).recent_ends(limit=4)
    assert [(e.request_id, e.ended_ms) for e in ends] == [("b", 1002), ("a", 1000)]
    assert ends[0].event == error and ends[1].event == final
    assert [e.request_id for e in await WorkerStatsStore(admin).recent_ends(limit=1)] == ["b"]
