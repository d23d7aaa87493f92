"""A lease is renewed while its attempt owns the request: the owner key decides, not the
lease; and only while its job is stored, so that a renewal can never outlive the job's end."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import AsyncIterator, Sequence

import pytest
import redis.asyncio as aioredis

from streamq.broker.data_plane import OwnerRead
from streamq.protocol import ENDED, IN_PROGRESS_PREFIX, JOB_KEY_PREFIX, owner_key
from worker.lease import Leases, lease_holder


@pytest.fixture
async def redis(redis_url: str) -> AsyncIterator[aioredis.Redis]:
    client = aioredis.Redis.from_url(redis_url)
    yield client
    await client.aclose()


async def test_a_lease_is_kept_by_the_attempt_that_owns_the_request(redis: aioredis.Redis) -> None:
    """Claimed and owned by this attempt: renewed and named after it. Lapsed (Redis was
    away), or claimed by another worker whose attempt has not taken the request over yet:
    taken back, since this attempt still owns the request; whether its job is still in a
    queue does not matter. Owned by a newer attempt, or ended: lost, and left alone."""
    ours, lapsed, claimed, newer, ended = (f"lease-{uuid.uuid4().hex}" for _ in range(5))
    lost: list[tuple[str, int]] = []
    leases = Leases(redis, worker_id="worker-a", on_lost=lambda job, attempt: lost.append((job, attempt)))
    await redis.set(IN_PROGRESS_PREFIX + ours, "worker-a", px=60_000)
    await redis.set(owner_key(ours), 2)
    await redis.set(IN_PROGRESS_PREFIX + claimed, "worker-b", px=60_000)
    await redis.set(owner_key(claimed), 2)
    await redis.set(IN_PROGRESS_PREFIX + newer, lease_holder("worker-b", 3), px=60_000)
    await redis.set(owner_key(newer), 3)
    await redis.set(owner_key(ended), ENDED)
    for job in (ours, lapsed, claimed, newer):
        await redis.set(JOB_KEY_PREFIX + job, b"{}", px=60_000)
    with contextlib.ExitStack() as held:
        for job in (ours, lapsed, claimed, newer, ended):
            held.enter_context(leases.held(job, 2))
        await leases.renew()
        for job in (ours, lapsed, claimed):
            assert await redis.get(IN_PROGRESS_PREFIX + job) == b"worker-a:2", job
            assert 0 < await redis.pttl(IN_PROGRESS_PREFIX + job) <= leases.ttl_ms
        assert await redis.get(IN_PROGRESS_PREFIX + newer) == lease_holder("worker-b", 3).encode()
        assert not await redis.exists(IN_PROGRESS_PREFIX + ended)
        assert sorted(lost) == sorted([(newer, 2), (ended, 2)])
        await leases.renew()  # a lost lease is not reported (or renewed) again
        assert sorted(lost) == sorted([(newer, 2), (ended, 2)])
    await redis.delete(*(IN_PROGRESS_PREFIX + job for job in (ours, lapsed, claimed, newer)))
    await redis.delete(*(JOB_KEY_PREFIX + job for job in (ours, lapsed, claimed, newer)))
    await redis.delete(*(owner_key(job) for job in (ours, claimed, newer, ended)))


class OwnersReadBefore(OwnerRead):
    """Owner keys read ahead, as on a Redis Cluster's data plane, and read before the request
    ended: each still names attempt ``attempt``."""

    def __init__(self, redis: aioredis.Redis, attempt: int) -> None:
        super().__init__(redis)
        self._attempt = attempt

    @property
    def ahead(self) -> bool:
        return True

    async def values(self, request_ids: Sequence[str]) -> list[str]:
        return [str(self._attempt)] * len(request_ids)


@pytest.mark.parametrize("owners", ["in the script", "read ahead"])
async def test_a_renewal_that_runs_after_its_job_ended_sets_no_lease(redis: aioredis.Redis, owners: str) -> None:
    """The job's end deleted its key and its lease (``finish_job``) after the renewal had
    read its owner (on a cluster, owners are read first) or where an evicting Redis deleted
    the job: no lease is set again, which would otherwise stay behind, naming a running job
    nobody runs, until it expired; and the attempt is not told it lost the request."""
    job = f"lease-{uuid.uuid4().hex}"
    lost: list[tuple[str, int]] = []
    read = OwnersReadBefore(redis, 1) if owners == "read ahead" else None
    leases = Leases(redis, worker_id="worker-a", on_lost=lambda job, attempt: lost.append((job, attempt)), owners=read)
    await redis.set(owner_key(job), 1)  # the end's ENDED lands on the data plane after the read
    with leases.held(job, 1):
        await leases.renew()
    assert not await redis.exists(IN_PROGRESS_PREFIX + job)
    assert not lost
    await redis.delete(owner_key(job))
