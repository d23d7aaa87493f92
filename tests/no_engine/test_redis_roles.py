"""The Redis roles of docs/internals.md on a real Redis, with the real scripts: each role does
its own work, and a producer (or gateway) cannot claim jobs, renew leases, register
workers or store results. Direct commands are refused with ``NOPERM``; a script's call
with ``ACL failure in script`` (Redis checks every call of a script against its caller)."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

import msgspec
import pytest
import redis.asyncio as aioredis
from redis.exceptions import NoPermissionError, ResponseError

from devkit.redis_server import RedisServer
from gateway.auth import Tenant
from gateway.key_limits import KeyLimiter
from producer.client import StreamqClient
from producer.openai_api.errors import ApiError
from streamq.broker.api_keys import ApiKeyStore, KeyRecord, secret_hash, usage_key
from streamq.broker.registry import WorkerRegistry
from streamq.broker.replay_log import LogEvent, ReplayLog, TakeOver
from streamq.broker.worker_stats import WorkerStatsStore
from streamq.protocol import (
    HEALTH_CHECK_SUFFIX,
    IN_PROGRESS_PREFIX,
    JOB_KEY_PREFIX,
    LEASE_TTL_MS,
    MODELS_KEY,
    RESULT_KEY_PREFIX,
    WORKERS_KEY,
    ChunkEvent,
    FinalEvent,
    WorkerRegistration,
    encode_event,
    encode_registration,
    events_channel,
    owner_key,
)
from streamq.protocol.affinity import prompt_keys
from streamq.protocol.names import (
    AFFINITY_FREE_TTL_MS,
    AFFINITY_WORKER_TTL_MS,
    API_KEY_NAMES_KEY,
    API_KEYS_KEY,
    RECENT_ENDS_KEY,
    WAKEUP_CHANNEL,
    WORKER_STATS_KEY,
    WORKER_STATS_SEEN_KEY,
    affinity_free_key,
    affinity_worker_key,
    cancelled_key,
)
from streamq.protocol.roles import GATEWAY, PRODUCER, WORKER, Role
from streamq.protocol.script_calls import Cancel, ClaimJobs, FinishJob, LeaseRenewal, ReleaseAffinity, RenewLeases
from streamq.protocol.scripts import Script
from streamq.protocol.worker_stats import WorkerStats
from worker.lease import Leases

SCRIPT_DENIED = "ACL failure in script: No permissions to access a key"


async def connect(server: RedisServer, role: Role) -> aioredis.Redis:
    return aioredis.Redis.from_url(server.url_for(role))


@pytest.fixture(params=[PRODUCER, GATEWAY], ids=lambda role: role.name)
async def producer(request: pytest.FixtureRequest, redis_server: RedisServer) -> AsyncIterator[aioredis.Redis]:
    """A connection as the producer's user, and as the gateway's (the same rules)."""
    client = await connect(redis_server, request.param)
    yield client
    await client.aclose()


@pytest.fixture
async def worker(redis_server: RedisServer) -> AsyncIterator[aioredis.Redis]:
    client = await connect(redis_server, WORKER)
    yield client
    await client.aclose()


@pytest.fixture
def queue() -> str:
    return f"streamq:queue:roles-{uuid.uuid4().hex[:8]}"


@pytest.fixture
async def queued_id(redis_server: RedisServer, queue: str) -> str:
    """A request queued by the producer's user on a queue nobody serves."""
    async with await StreamqClient.connect(redis_server.url_for(PRODUCER), queue=queue) as client:
        handle = await client.submit("Hello")
        await handle.close()
        return handle.request_id


async def test_a_producer_cannot_claim_a_job(
    producer: aioredis.Redis, admin: aioredis.Redis, queue: str, queued_id: str
) -> None:
    claim = ClaimJobs(
        queue=queue,
        wanted=1,
        lease_ms=LEASE_TTL_MS,
        page=100,
        in_progress_prefix=IN_PROGRESS_PREFIX,
        worker_id="intruder",
    )
    with pytest.raises(ResponseError, match="ACL failure in script"):
        await Script(producer, ClaimJobs)(claim)
    with pytest.raises(NoPermissionError):
        await producer.set(IN_PROGRESS_PREFIX + queued_id, "intruder", nx=True, px=LEASE_TTL_MS)
    assert not await admin.exists(IN_PROGRESS_PREFIX + queued_id)
    assert await admin.zscore(queue, queued_id) is not None  # still queued for a worker


async def test_a_producer_cannot_renew_or_take_a_lease(producer: aioredis.Redis, admin: aioredis.Redis) -> None:
    job_id = f"test-{uuid.uuid4().hex}"
    lease = IN_PROGRESS_PREFIX + job_id
    await admin.set(lease, "worker-1:1", px=60_000)
    renewal = LeaseRenewal(lease, JOB_KEY_PREFIX + job_id, "intruder:1", 1, cancelled_key(job_id), owner="")
    renew = RenewLeases(ttl_ms=LEASE_TTL_MS, jobs=[renewal])
    with pytest.raises(NoPermissionError):  # its KEYS must be writable
        await Script(producer, RenewLeases)(renew)
    with pytest.raises(NoPermissionError):
        await producer.set(lease, "intruder:1", px=LEASE_TTL_MS)
    with pytest.raises(NoPermissionError):
        await producer.pexpire(lease, 60_000)
    assert await admin.get(lease) == b"worker-1:1"


async def test_a_producer_cannot_register_a_worker_or_a_model(producer: aioredis.Redis, admin: aioredis.Redis) -> None:
    name = f"intruder-{uuid.uuid4().hex[:8]}"
    registration = WorkerRegistration(worker_id=name, model=name, queue=f"streamq:queue:{name}")
    with pytest.raises(NoPermissionError):
        await WorkerRegistry(producer).register(registration)
    with pytest.raises(NoPermissionError):
        await producer.zadd(WORKERS_KEY, {encode_registration(registration): 2**50})
    with pytest.raises(NoPermissionError):
        await producer.hset(MODELS_KEY, name, registration.queue)
    assert await admin.hget(MODELS_KEY, name) is None
    assert await admin.zscore(WORKERS_KEY, encode_registration(registration)) is None


async def test_a_producer_cannot_store_a_result_drop_a_queue_or_a_log_or_run_admin_commands(
    producer: aioredis.Redis, queue: str, queued_id: str
) -> None:
    request_id = f"test-{uuid.uuid4().hex}"
    denied = [
        lambda: producer.delete(queue),
        lambda: producer.set(queue + HEALTH_CHECK_SUFFIX, "fake"),
        lambda: producer.delete(events_channel(queued_id)),
        lambda: producer.set(events_channel(queued_id), "x"),
        lambda: producer.set(RESULT_KEY_PREFIX + request_id, "{}"),
        lambda: producer.delete(RESULT_KEY_PREFIX + request_id),
        lambda: producer.set("not-streamq", "x"),
        lambda: producer.xtrim(events_channel(request_id), maxlen=0),
        lambda: producer.xdel(events_channel(request_id), "0-1"),
        lambda: producer.flushall(),
        lambda: producer.config_get("*"),
        lambda: producer.keys("*"),
    ]
    for command in denied:
        with pytest.raises(NoPermissionError):
            await command()


async def test_a_producer_does_its_own_work(redis_server: RedisServer, admin: aioredis.Redis, queue: str) -> None:
    """Submit, follow, read the registry and cancel a queued request (whose stream it
    ends itself), all as the producer's user."""
    prompt = "A prompt long enough to be routed by its prefix. " * 8
    await admin.set(affinity_worker_key(queue, prompt_keys(prompt)[0]), "w1")  # w1 served it
    await admin.set(affinity_free_key(queue, "w1"), 4)
    async with await StreamqClient.connect(redis_server.url_for(PRODUCER), queue=queue) as client:
        handle = await client.submit(prompt)
        assert await client._job_state(handle.request_id) == "queued"  # the handle watchdog's read
        assert (await client.status(handle.request_id)).state == "queued"
        assert await admin.hget(f"{queue}:held", handle.request_id) == b"w1"
        assert isinstance(await client.live_models(), dict)
        assert await client.cancel(handle.request_id) == "queued"
        completion = await handle.result()
        assert completion.finish_reasons == ["cancelled"]
        follower = await client.follow(handle.request_id)
        assert (await follower.result()).finish_reasons == ["cancelled"]
    assert await admin.zcard(queue) == 0
    assert await admin.hlen(f"{queue}:held") == 0


async def test_a_worker_does_its_own_work(worker: aioredis.Redis, admin: aioredis.Redis, queue: str) -> None:
    """Register, claim, renew, take over, publish and finish the job, as the worker's user."""
    name = f"roles-{uuid.uuid4().hex[:8]}"
    registration = WorkerRegistration(worker_id=name, model=name, queue=queue)
    registry = WorkerRegistry(worker)
    await registry.register(registration)
    await registry.unregister(registration)
    request_id = f"test-{uuid.uuid4().hex}"
    await admin.zadd(queue, {request_id: 0})
    claim = ClaimJobs(
        queue=queue,
        wanted=1,
        lease_ms=LEASE_TTL_MS,
        page=100,
        in_progress_prefix=IN_PROGRESS_PREFIX,
        worker_id=name,
        affinity_worker_ttl_ms=AFFINITY_WORKER_TTL_MS,
        free_ttl_ms=AFFINITY_FREE_TTL_MS,
    )
    (claimed,) = ClaimJobs.reply(await Script(worker, ClaimJobs)(claim)).jobs
    assert claimed.job_id == request_id and not claimed.cancelled
    assert await admin.get(affinity_free_key(queue, name)) == b"0"  # what enqueue reads to route here
    release = ReleaseAffinity(queue=queue, worker_id=name, wakeup_channel=WAKEUP_CHANNEL)
    assert await Script(worker, ReleaseAffinity)(release) == 0
    assert await admin.exists(affinity_free_key(queue, name)) == 0
    lost: list[tuple[str, int]] = []
    leases = Leases(worker, worker_id=name, on_lost=lambda *job: lost.append(job))
    await admin.set(JOB_KEY_PREFIX + request_id, b"{}")  # a lease is renewed while its job is stored
    with leases.held(request_id, 1):
        await leases.renew()
    assert not lost and await admin.get(IN_PROGRESS_PREFIX + request_id) == f"{name}:1".encode()
    log = ReplayLog(worker)
    assert await log.take_over(request_id, 1) == TakeOver(True, [])
    chunk = ChunkEvent(request_id=request_id, seq=0, index=0, text="a", token_ids=[1], attempt=1)
    await log.append([LogEvent(request_id, 0, 1, encode_event(chunk))])
    assert await log.read(request_id) == [encode_event(chunk)]
    finish = FinishJob.of_job(
        request_id,
        queue,
        owner_key=owner_key(request_id),
        worker_id=name,
        holder=f"{name}:1",
        attempt=1,
        action="finish",
        result=b"{}",
        result_ttl_ms=60_000,
    )
    assert await Script(worker, FinishJob)(finish) == 1
    assert await admin.zcard(queue) == 0 and not await admin.exists(IN_PROGRESS_PREFIX + request_id)
    await admin.hdel(MODELS_KEY, name)


async def test_only_a_canceller_records_a_cancel_and_a_worker_reads_and_deletes_it(
    producer: aioredis.Redis, worker: aioredis.Redis, admin: aioredis.Redis
) -> None:
    """The producer and the gateway record a running request's cancel (``cancel``) and clear a
    stale record (``enqueue``) but do not read it; a worker reads it (the claim, the lease
    renewal, its cancel listener) and deletes it with its job, but cannot record one."""
    request_id = f"test-{uuid.uuid4().hex}"
    record = cancelled_key(request_id)
    await admin.set(IN_PROGRESS_PREFIX + request_id, "worker-1:1", px=60_000)  # running
    cancel = Cancel.of_request(request_id)
    try:
        with pytest.raises(NoPermissionError):  # its KEYS must be writable
            await Script(worker, Cancel)(cancel)
        with pytest.raises(NoPermissionError):
            await worker.set(record, 1)
        assert not await admin.exists(record)
        assert await Script(producer, Cancel)(cancel) == b"running"
        with pytest.raises(NoPermissionError):
            await producer.get(record)
        assert await worker.get(record) == await admin.get(record) is not None
        assert await worker.mget([record]) == [await admin.get(record)]
        assert await worker.delete(record) == 1
    finally:
        await admin.delete(IN_PROGRESS_PREFIX + request_id, record)


async def test_a_worker_reaches_nothing_outside_its_keys(worker: aioredis.Redis) -> None:
    denied = [
        lambda: worker.set("not-streamq", "x"),
        lambda: worker.flushall(),
        lambda: worker.config_get("*"),
        lambda: worker.keys("*"),
    ]
    for command in denied:
        with pytest.raises(NoPermissionError):
            await command()


async def test_a_gateway_applies_stored_keys_but_cannot_create_them(
    redis_server: RedisServer, admin: aioredis.Redis
) -> None:
    """Its admission and usage scripts run under its own user; writing a key does not."""
    name = f"team-{uuid.uuid4().hex[:8]}"
    record = KeyRecord(name=name, rpm=1)
    secret = await ApiKeyStore(admin).create(record)
    gateway = await connect(redis_server, GATEWAY)
    try:
        limiter = KeyLimiter(gateway)
        admission = await limiter.admit(Tenant(name, secret_hash(secret), record), "tiny")
        admission.prompt_tokens, admission.completion_tokens = 3, 4
        await limiter.finish(admission)
        usage = await admin.hgetall(usage_key(name))
        assert usage == {b"requests:tiny": b"1", b"prompt_tokens:tiny": b"3", b"completion_tokens:tiny": b"4"}
        with pytest.raises(ApiError) as over:
            await limiter.admit(Tenant(name, secret_hash(secret), record), "tiny")
        assert over.value.status == 429 and over.value.param == "rpm"
        with pytest.raises(NoPermissionError, match="No permissions to access a key"):
            await ApiKeyStore(gateway).create(KeyRecord(name=f"{name}-forged"))
    finally:
        await gateway.aclose()
        await admin.delete(API_KEYS_KEY, API_KEY_NAMES_KEY)  # later gateways on this Redis start open


async def test_a_producer_s_end_of_a_queued_request_reaches_the_recent_ends(
    producer: aioredis.Redis, admin: aioredis.Redis, queue: str, queued_id: str
) -> None:
    """Cancelling a queued request ends it from outside any worker (``end_request``), which
    pushes the end to the dashboard's list: allowed to the producer and the gateway."""
    final = FinalEvent(request_id=queued_id, seq=0, finish_reasons=["cancelled"], prompt_tokens=0, completion_tokens=0)
    assert await ReplayLog(producer).end(queued_id, final) is not None
    [end] = [e for e in await WorkerStatsStore(admin).recent_ends() if e.request_id == queued_id]
    assert isinstance(end.event, FinalEvent) and end.event.finish_reasons == ["cancelled"]
    await admin.delete(queue, JOB_KEY_PREFIX + queued_id)


async def test_only_workers_write_stats_reports_and_only_the_gateway_reads_them(
    redis_server: RedisServer, producer: aioredis.Redis, worker: aioredis.Redis, admin: aioredis.Redis
) -> None:
    name = f"roles-{uuid.uuid4().hex[:8]}"
    stats = WorkerStats(worker_id=name, model=name, queue="streamq:queue", host="h", pid=1, started_ms=1)
    await WorkerStatsStore(worker).report(stats)
    with pytest.raises(NoPermissionError):  # its KEYS must be writable
        await WorkerStatsStore(producer).report(msgspec.structs.replace(stats, worker_id=f"{name}-forged"))
    denied = [
        lambda: producer.hset(WORKER_STATS_KEY, name, "{}"),
        lambda: producer.hdel(WORKER_STATS_KEY, name),
        lambda: producer.zadd(WORKER_STATS_SEEN_KEY, {name: 0}),
        lambda: producer.delete(RECENT_ENDS_KEY),
    ]
    for command in denied:
        with pytest.raises(NoPermissionError):
            await command()
    gateway = await connect(redis_server, GATEWAY)
    plain_producer = await connect(redis_server, PRODUCER)
    try:
        assert name in [s.worker_id for s in await WorkerStatsStore(gateway).read()]
        assert isinstance(await WorkerStatsStore(gateway).recent_ends(), list)
        for command in (
            lambda: WorkerStatsStore(plain_producer).read(),
            lambda: WorkerStatsStore(plain_producer).recent_ends(),
        ):
            with pytest.raises(NoPermissionError):
                await command()
    finally:
        await gateway.aclose()
        await plain_producer.aclose()
        await admin.hdel(WORKER_STATS_KEY, name)
        await admin.zrem(WORKER_STATS_SEEN_KEY, name)
