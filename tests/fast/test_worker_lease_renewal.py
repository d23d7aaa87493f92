"""A worker's lease on a job is renewed only by its holder."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis

from streamq.protocol import IN_PROGRESS_PREFIX
from worker.lease import Leases, lease_holder


@pytest.fixture
async def redis(redis_url: str) -> AsyncIterator[aioredis.Redis]:
    client = aioredis.Redis.from_url(redis_url)
    yield client
    await client.aclose()


async def test_a_lease_is_renewed_only_by_its_holder(redis: aioredis.Redis) -> None:
    """Claimed by this worker: renewed and named after the attempt. Lapsed with nobody
    else holding it and the job still queued: taken back. Lapsed after the job left its
    queue (another attempt took it over and ended it): lost, and not recreated. Held by
    another worker: reported lost, not renewed."""
    queue = f"streamq:queue:lease-{uuid.uuid4().hex}"
    ours, lapsed, ended, stolen = (f"lease-{uuid.uuid4().hex}" for _ in range(4))
    await redis.zadd(queue, {ours: 1, lapsed: 1, stolen: 1})  # `ended` has left the queue
    lost: list[tuple[str, int]] = []
    leases = Leases(redis, worker_id="worker-a", queue=queue, on_lost=lambda job, attempt: lost.append((job, attempt)))
    await redis.set(IN_PROGRESS_PREFIX + ours, "worker-a", px=60_000)
    await redis.set(IN_PROGRESS_PREFIX + stolen, lease_holder("worker-b", 2), px=60_000)
    with leases.held(ours, 1), leases.held(lapsed, 1), leases.held(ended, 1), leases.held(stolen, 1):
        await leases.renew()
        assert await redis.get(IN_PROGRESS_PREFIX + ours) == b"worker-a:1"
        assert 0 < await redis.pttl(IN_PROGRESS_PREFIX + ours) <= leases.ttl_ms
        assert await redis.get(IN_PROGRESS_PREFIX + lapsed) == b"worker-a:1"
        assert not await redis.exists(IN_PROGRESS_PREFIX + ended)
        assert await redis.get(IN_PROGRESS_PREFIX + stolen) == b"worker-b:2"
        assert sorted(lost) == sorted([(ended, 1), (stolen, 1)])
        await leases.renew()  # a lost lease is not reported (or renewed) again
        assert sorted(lost) == sorted([(ended, 1), (stolen, 1)])
    await redis.delete(queue, *(IN_PROGRESS_PREFIX + job for job in (ours, lapsed, stolen)))
