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
    else holding it: taken back. Held by another worker: reported lost, not renewed."""
    ours, lapsed, stolen = (f"lease-{uuid.uuid4().hex}" for _ in range(3))
    lost: list[tuple[str, int]] = []
    leases = Leases(redis, worker_id="worker-a", on_lost=lambda job, attempt: lost.append((job, attempt)))
    await redis.set(IN_PROGRESS_PREFIX + ours, "worker-a", px=60_000)
    await redis.set(IN_PROGRESS_PREFIX + stolen, lease_holder("worker-b", 2), px=60_000)
    with leases.held(ours, 1), leases.held(lapsed, 1), leases.held(stolen, 1):
        await leases.renew()
        assert await redis.get(IN_PROGRESS_PREFIX + ours) == b"worker-a:1"
        assert 0 < await redis.pttl(IN_PROGRESS_PREFIX + ours) <= leases.ttl_ms
        assert await redis.get(IN_PROGRESS_PREFIX + lapsed) == b"worker-a:1"
        assert await redis.get(IN_PROGRESS_PREFIX + stolen) == b"worker-b:2"
        assert lost == [(stolen, 1)]
        await leases.renew()  # a lost lease is not reported (or renewed) again
        assert lost == [(stolen, 1)]
