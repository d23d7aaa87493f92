"""Durable cancels on a real Redis, with the real scripts, each run as its role's user: a
cancel of a running request is recorded (``streamq:cancelled:<id>``) beside its message,
and a queued one's is not; the lease renewal and the claim report the record, so a worker
that missed the message or takes the request over acts on it; the job's end deletes it, and
an enqueue clears one an earlier job of the id left. The cancel listener acts once on a
cancel it both hears and finds, and finds a missed one as it resubscribes."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis

from devkit.redis_server import RedisServer
from streamq.protocol import (
    CANCEL_CHANNEL,
    IN_PROGRESS_PREFIX,
    JOB_EXPIRY_MS,
    JOB_KEY_PREFIX,
    RESULT_KEY_PREFIX,
    RETRY_KEY_PREFIX,
    owner_key,
)
from streamq.protocol.names import cancelled_key
from streamq.protocol.roles import PRODUCER
from streamq.protocol.script_calls import Cancel, ClaimJobs, Enqueue, FinishJob, LeaseRenewal, RenewLeases
from streamq.protocol.scripts import Script
from worker.cancel import CancelListener
from worker.lease import HELD, HELD_CANCELLED, Leases, lease_holder


class Roles:
    """The producer's scripts (enqueue, cancel) and the worker's (claim, renew, finish) on one
    throw-away queue, each as its role's user."""

    def __init__(self, producer: aioredis.Redis, worker: aioredis.Redis) -> None:
        self.queue = f"streamq:queue:cancel-records-{uuid.uuid4().hex[:8]}"
        self.ids: set[str] = set()
        self._enqueue = Script(producer, Enqueue)
        self._cancel = Script(producer, Cancel)
        self._claim = Script(worker, ClaimJobs)
        self._renew = Script(worker, RenewLeases)
        self._finish = Script(worker, FinishJob)

    def new_id(self) -> str:
        request_id = f"cancel-record-{uuid.uuid4().hex}"
        self.ids.add(request_id)
        return request_id

    async def enqueue(self, request_id: str, *, clear_record: bool = True) -> int:
        """The library's enqueue (which names the id's cancel record), or, without
        ``clear_record``, an enqueue as another implementation may send it (three keys)."""
        call = Enqueue.of_request(
            request_id,
            self.queue,
            b"{}",
            cancelled_key=cancelled_key(request_id) if clear_record else None,
            expiry_ms=60_000,
        )
        return int(await self._enqueue(call))

    async def cancel(self, request_id: str, *, queued_only: bool = False) -> str:
        call = Cancel.of_request(request_id, [self.queue], queued_only=queued_only)
        return str((await self._cancel(call)).decode())

    async def claim(self, worker_id: str, wanted: int = 1, lease_ms: int = 3000) -> list[tuple[str, int]]:
        """Each claimed id, with whether the claim reported its request cancelled."""
        call = ClaimJobs(
            queue=self.queue,
            wanted=wanted,
            lease_ms=lease_ms,
            page=100,
            in_progress_prefix=IN_PROGRESS_PREFIX,
            worker_id=worker_id,
        )
        claimed = ClaimJobs.reply(await self._claim(call))
        return [(job.job_id, int(job.cancelled)) for job in claimed.jobs]

    async def renew(self, worker_id: str, jobs: list[str], *, owners_ahead: bool = False) -> list[int]:
        """``renew_leases`` for attempt 1 of each job, the owner keys in KEYS (one Redis) or
        read ahead (as on a Redis Cluster's data plane: here, none written yet)."""
        renewals = [
            LeaseRenewal(
                IN_PROGRESS_PREFIX + job_id,
                JOB_KEY_PREFIX + job_id,
                lease_holder(worker_id, 1),
                1,
                cancelled_key(job_id),
                owner_key=None if owners_ahead else owner_key(job_id),
                owner="" if owners_ahead else None,
            )
            for job_id in jobs
        ]
        return [int(held) for held in await self._renew(RenewLeases(ttl_ms=3000, jobs=renewals))]

    async def finish(self, request_id: str, worker_id: str, action: str) -> int:
        call = FinishJob.of_job(
            request_id,
            self.queue,
            owner_key=owner_key(request_id),
            worker_id=worker_id,
            holder=lease_holder(worker_id, 1),
            attempt=1,
            action=action,
            result=b"{}" if action != "retry" else b"",
            result_ttl_ms=60_000,
        )
        return int(await self._finish(call))


@pytest.fixture
async def producer(redis_server: RedisServer) -> AsyncIterator[aioredis.Redis]:
    client = aioredis.Redis.from_url(redis_server.url_for(PRODUCER))
    yield client
    await client.aclose()


@pytest.fixture
async def worker(worker_url: str) -> AsyncIterator[aioredis.Redis]:
    client = aioredis.Redis.from_url(worker_url)
    yield client
    await client.aclose()


@pytest.fixture
async def roles(producer: aioredis.Redis, worker: aioredis.Redis, admin: aioredis.Redis) -> AsyncIterator[Roles]:
    roles = Roles(producer, worker)
    yield roles
    keys = await admin.keys(roles.queue + "*")
    per_id = (JOB_KEY_PREFIX, IN_PROGRESS_PREFIX, RESULT_KEY_PREFIX, RETRY_KEY_PREFIX, "streamq:cancelled:")
    await admin.delete(roles.queue, *keys, *(prefix + i for i in roles.ids for prefix in per_id))


async def redis_ms(admin: aioredis.Redis) -> int:
    seconds, micros = await admin.time()
    return int(seconds) * 1000 + int(micros) // 1000


async def test_a_running_requests_cancel_is_recorded_and_published_a_queued_ones_is_not(
    roles: Roles, admin: aioredis.Redis
) -> None:
    running, queued, timed_out = roles.new_id(), roles.new_id(), roles.new_id()
    for request_id in (running, timed_out, queued):
        assert await roles.enqueue(request_id) == 1
    assert [job for job, _ in await roles.claim("w1", wanted=2)] == [running, timed_out]
    pubsub = admin.pubsub()
    await pubsub.subscribe(CANCEL_CHANNEL)
    try:
        before = await redis_ms(admin)
        assert await roles.cancel(running) == "running"
        recorded_at = int(await admin.get(cancelled_key(running)))  # Redis's ms, an integer
        assert before <= recorded_at <= await redis_ms(admin)
        assert JOB_EXPIRY_MS - 60_000 < await admin.pttl(cancelled_key(running)) <= JOB_EXPIRY_MS
        # A running request that must only go if queued (its wait passed its bound): neither.
        assert await roles.cancel(timed_out, queued_only=True) == "running"
        assert not await admin.exists(cancelled_key(timed_out))
        assert await roles.cancel(queued) == "queued"  # taken off its queue: nothing will run it
        assert not await admin.exists(cancelled_key(queued))
        heard: list[str] = []
        async with asyncio.timeout(5):
            while len(heard) < 2:
                message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=1)
                if message is not None:
                    heard.append(message["data"].decode())
        assert heard == [running, queued]  # the message still goes out, after the record
    finally:
        await pubsub.aclose()


async def test_the_lease_renewal_reports_each_held_job_whose_request_was_cancelled(
    roles: Roles, admin: aioredis.Redis
) -> None:
    cancelled, going_on, ended = roles.new_id(), roles.new_id(), roles.new_id()
    for request_id in (cancelled, going_on, ended):
        assert await roles.enqueue(request_id) == 1
    assert len(await roles.claim("w1", wanted=3)) == 3
    assert await roles.cancel(cancelled) == "running"
    await admin.set(cancelled_key(ended), 1)
    await admin.set(owner_key(ended), "ended")  # a lost lease is reported lost, cancelled or not
    assert await roles.renew("w1", [going_on, cancelled, ended]) == [HELD, HELD_CANCELLED, 0]
    assert await roles.renew("w1", [going_on, cancelled], owners_ahead=True) == [HELD, HELD_CANCELLED]
    assert await admin.get(IN_PROGRESS_PREFIX + cancelled) == lease_holder("w1", 1).encode()  # renewed all the same
    await admin.delete(owner_key(ended))


async def test_leases_hand_a_recorded_cancel_to_the_listener_at_each_renewal(
    worker: aioredis.Redis, admin: aioredis.Redis
) -> None:
    cancelled, going_on = (f"cancel-record-{uuid.uuid4().hex}" for _ in range(2))
    found: list[str] = []
    leases = Leases(worker, worker_id="w1", on_lost=lambda *_: None, on_cancelled=found.append)
    await admin.set(cancelled_key(cancelled), 1, px=60_000)
    try:
        with leases.held(cancelled, 1), leases.held(going_on, 1):
            await leases.renew()
            assert found == [cancelled]
            await leases.renew()  # reported at each renewal: the listener acts once
            assert found == [cancelled, cancelled]
        await leases.renew()  # no longer held: no longer reported
        assert found == [cancelled, cancelled]
    finally:
        await admin.delete(cancelled_key(cancelled), *(IN_PROGRESS_PREFIX + i for i in (cancelled, going_on)))


async def test_the_claim_reports_a_cancel_recorded_while_an_earlier_attempt_ran_the_job(
    roles: Roles, admin: aioredis.Redis
) -> None:
    taken_over, fresh = roles.new_id(), roles.new_id()
    assert await roles.enqueue(taken_over) == 1
    assert await roles.claim("w1", lease_ms=300) == [(taken_over, 0)]
    assert await roles.cancel(taken_over) == "running"  # recorded, and heard by nobody: w1 is gone
    assert await roles.enqueue(fresh) == 1
    await asyncio.sleep(0.4)  # w1's lease lapses
    assert await roles.claim("w2", wanted=2) == [(taken_over, 1), (fresh, 0)]  # the take-over first


async def test_the_jobs_end_deletes_its_record_and_a_hand_back_keeps_it(roles: Roles, admin: aioredis.Redis) -> None:
    finished, failed = roles.new_id(), roles.new_id()
    for request_id in (finished, failed):
        assert await roles.enqueue(request_id) == 1
    assert len(await roles.claim("w1", wanted=2)) == 2
    for request_id in (finished, failed):
        assert await roles.cancel(request_id) == "running"
    assert await roles.finish(finished, "w1", "retry") == 1  # handed back: its next attempt must find it
    assert await admin.exists(cancelled_key(finished))
    assert await roles.claim("w1") == [(finished, 1)]
    assert await roles.finish(finished, "w1", "finish") == 1
    assert not await admin.exists(cancelled_key(finished))
    assert await roles.finish(failed, "w1", "failed") == 1
    assert not await admin.exists(cancelled_key(failed))


async def test_a_superseded_attempt_leaves_the_record_to_the_owner(roles: Roles, admin: aioredis.Redis) -> None:
    request_id = roles.new_id()
    assert await roles.enqueue(request_id) == 1
    assert len(await roles.claim("w1")) == 1
    assert await roles.cancel(request_id) == "running"
    await admin.set(owner_key(request_id), 2)  # attempt 2 took it over elsewhere
    try:
        assert await roles.finish(request_id, "w1", "finish") == 0
        assert await admin.exists(cancelled_key(request_id))
    finally:
        await admin.delete(owner_key(request_id))


async def test_an_enqueue_clears_a_stale_record_and_a_refused_one_leaves_the_live_jobs(
    roles: Roles, admin: aioredis.Redis
) -> None:
    request_id, other_implementation = roles.new_id(), roles.new_id()
    for stale in (request_id, other_implementation):
        await admin.set(cancelled_key(stale), 1, px=60_000)  # left by an earlier job of the id
    assert await roles.enqueue(request_id) == 1
    assert not await admin.exists(cancelled_key(request_id))
    assert await roles.claim("w1") == [(request_id, 0)]
    assert await roles.cancel(request_id) == "running"
    assert await roles.enqueue(request_id) == 0  # in use: the record is the running job's
    assert await admin.exists(cancelled_key(request_id))
    assert await roles.enqueue(other_implementation, clear_record=False) == 1  # three keys: left alone
    assert await admin.exists(cancelled_key(other_implementation))


@contextlib.asynccontextmanager
async def listening(redis: aioredis.Redis) -> AsyncIterator[CancelListener]:
    listener = CancelListener(redis)
    await listener.start()
    try:
        yield listener
    finally:
        await listener.close()


async def running_job(listener: CancelListener, request_id: str, cancels: list[float]) -> None:
    """A job registered with the listener until cancelled; each cancel it gets is counted."""
    with listener.registered(request_id, 1):
        while True:
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                cancels.append(time.monotonic())
                await asyncio.sleep(0.3)  # a second cancel would land here (the task's cancelling() counts it)
                raise


async def test_the_listener_acts_once_on_a_cancel_it_both_hears_and_finds(
    worker: aioredis.Redis, admin: aioredis.Redis
) -> None:
    request_id = f"cancel-record-{uuid.uuid4().hex}"
    cancels: list[float] = []
    async with listening(worker) as listener:
        job = asyncio.create_task(running_job(listener, request_id, cancels))
        await asyncio.sleep(0.05)
        await admin.publish(CANCEL_CHANNEL, request_id)
        await asyncio.sleep(0.1)
        listener.recorded(request_id)  # the renewal found the record too
        listener.recorded(request_id)
        with pytest.raises(asyncio.CancelledError):
            await job
        assert len(cancels) == 1 and job.cancelling() <= 1
        assert listener.was_cancelled(request_id)


async def test_a_recorded_cancel_found_before_the_job_starts_stops_it_as_it_registers(worker: aioredis.Redis) -> None:
    """The claim found the record of a request it takes over: the job is cancelled at once."""
    request_id = f"cancel-record-{uuid.uuid4().hex}"
    cancels: list[float] = []
    async with listening(worker) as listener:
        listener.recorded(request_id)
        assert listener.was_cancelled(request_id)
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(running_job(listener, request_id, cancels), timeout=5)
        assert len(cancels) == 1


async def test_the_listener_finds_a_cancel_it_missed_as_it_resubscribes(
    worker: aioredis.Redis, admin: aioredis.Redis
) -> None:
    """A cancel published while the listener's connection was down is lost; its record is
    read (``MGET``) as the listener subscribes again, before any renewal."""
    request_id = f"cancel-record-{uuid.uuid4().hex}"
    cancels: list[float] = []
    async with listening(worker) as listener:
        job = asyncio.create_task(running_job(listener, request_id, cancels))
        await asyncio.sleep(0.05)
        await admin.set(cancelled_key(request_id), 1, px=60_000)  # recorded; its message went nowhere
        try:
            await admin.client_kill_filter(_type="pubsub")  # the listener's connection drops
            dropped = time.monotonic()
            with pytest.raises(asyncio.CancelledError):
                await asyncio.wait_for(job, timeout=10)
            assert len(cancels) == 1 and cancels[0] - dropped < 5  # resubscribed after a 1 s pause
        finally:
            await admin.delete(cancelled_key(request_id))
