"""Request status on a real Redis with the real script, as the producer's and the
gateway's users, with requests no worker serves (their running and ended states set up
as a worker and arq would leave them); the callback signature; the state decoding."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Iterator

import msgspec
import pytest
import redis.asyncio as aioredis

from devkit.redis_server import RedisServer
from producer.client import StreamqClient
from producer.status import _Found, status_from
from streamq.broker.replay_log import ReplayLog
from streamq.protocol import (
    CALLBACK_KEY_PREFIX,
    CALLBACKS_KEY,
    ENDED,
    IN_PROGRESS_PREFIX,
    JOB_KEY_PREFIX,
    RESULT_KEY_PREFIX,
    ChunkEvent,
    ErrorEvent,
    FinalEvent,
    callback_key,
    encode_event,
    events_channel,
    owner_key,
    serialize_job,
)
from streamq.protocol.callbacks import CallbackBody, signature, verify
from streamq.protocol.names import waiting_key
from streamq.protocol.roles import GATEWAY, PRODUCER, WORKER, Role
from streamq.protocol.script_calls import ClaimCallbacks, RecordCallback, ScheduleCallback
from streamq.protocol.scripts import Script


@pytest.fixture
def queue() -> str:
    return f"streamq:queue:status-{uuid.uuid4().hex[:8]}"


@pytest.fixture(params=[PRODUCER, GATEWAY], ids=lambda role: role.name)
async def client(request: pytest.FixtureRequest, redis_server: RedisServer, queue: str) -> AsyncIterator[StreamqClient]:
    role: Role = request.param
    async with await StreamqClient.connect(redis_server.url_for(role), queue=queue) as client:
        yield client


async def submit(client: StreamqClient, **kwargs: object) -> str:
    handle = await client.submit("Hello", **kwargs)  # type: ignore[arg-type]
    await handle.close()
    return handle.request_id


async def test_queued_requests_have_their_position_and_wait(client: StreamqClient, admin: aioredis.Redis) -> None:
    first, second, third = [await submit(client) for _ in range(3)]
    now_ms = int(time.time() * 1000)
    await admin.zadd(client.queue, {first: now_ms - 3000, second: now_ms - 2000, third: now_ms - 1000})  # one per ms
    # Claimed as the claim script does: out of the waiting set, leased, still in arq's queue.
    await admin.zrem(waiting_key(client.queue, 0), first)
    await admin.set(IN_PROGRESS_PREFIX + first, "some-worker:1")
    status = await client.status(third)
    assert (status.state, status.position, status.queue, status.priority) == ("queued", 2, client.queue, 0)
    assert status.waited_s is not None and status.waited_s >= 0.9
    assert (await client.status(second)).position == 1


async def test_the_waiting_set_of_its_priority_gives_the_position_once_it_exists(
    client: StreamqClient, admin: aioredis.Redis
) -> None:
    request_id = await submit(client)
    job = msgspec.json.decode(await admin.get(JOB_KEY_PREFIX + request_id))
    job["a"][0]["priority"] = 5  # as a producer that sets priorities writes it
    await admin.set(JOB_KEY_PREFIX + request_id, serialize_job(job))
    await admin.zadd(waiting_key(client.queue, 5), {"a": 1, "b": 2, request_id: 3})
    status = await client.status(request_id)
    assert (status.state, status.position, status.priority) == ("queued", 3, 5)


async def test_a_deferred_request_is_queued_with_its_run_at_time(client: StreamqClient, admin: aioredis.Redis) -> None:
    request_id = await submit(client)
    run_at = int(time.time() * 1000) + 3_600_000
    await admin.zadd(client.queue, {request_id: run_at})
    status = await client.status(request_id)
    assert (status.state, status.run_at_ms, status.position) == ("queued", run_at, None)


async def test_a_running_request_names_its_worker_attempt_and_tokens_so_far(
    client: StreamqClient, admin: aioredis.Redis
) -> None:
    request_id = await submit(client)
    await admin.set(IN_PROGRESS_PREFIX + request_id, "host-1-abc:2")
    for seq, ids in enumerate([[1, 2, 3], [4], [5, 6]]):
        chunk = ChunkEvent(request_id=request_id, seq=seq, index=0, text='"token_ids":[9,9]', token_ids=ids)
        await admin.xadd(events_channel(request_id), {"event": encode_event(chunk)}, id=f"0-{seq + 1}")
    status = await client.status(request_id)
    assert (status.state, status.worker_id, status.attempt, status.completion_tokens) == ("running", "host-1-abc", 2, 6)


async def test_a_cancelled_queued_request_is_finished_and_its_callback_due(
    client: StreamqClient, admin: aioredis.Redis
) -> None:
    request_id = await submit(client, callback={"url": "http://127.0.0.1:9/done"})
    assert (await client.status(request_id)).callback.state == "pending"  # type: ignore[union-attr]
    assert await client.cancel(request_id) == "queued"
    status = await client.status(request_id)
    assert (status.state, status.finish_reasons) == ("finished", ["cancelled"])
    assert status.ended_ms is not None
    assert status.callback is not None and status.callback.url == "http://127.0.0.1:9/done"
    assert await admin.zscore(CALLBACKS_KEY, request_id) is not None
    assert await admin.hget(callback_key(request_id), "state") == b"pending"
    await admin.zrem(CALLBACKS_KEY, request_id)  # no worker here to send it


async def test_a_failed_request_has_its_code_and_message(client: StreamqClient, admin: aioredis.Redis) -> None:
    request_id = await submit(client)
    await client.cancel(request_id)
    await admin.delete(events_channel(request_id))  # only arq's result is left
    result = {"s": False, "r": {"error": "JobExecutionFailed", "message": "job expired"}, "st": 1, "ft": 2, "q": "x"}
    await admin.set(RESULT_KEY_PREFIX + request_id, serialize_job(result))
    status = await client.status(request_id)
    assert (status.state, status.error_code, status.ended_ms) == ("failed", "expired", 2)


async def test_an_error_event_in_the_log_makes_it_failed(client: StreamqClient, admin: aioredis.Redis) -> None:
    request_id = await submit(client)
    await ReplayLog(admin).end(request_id, ErrorEvent(request_id=request_id, seq=0, code="internal", message="boom"))
    status = await client.status(request_id)
    assert (status.state, status.error_code, status.error_message) == ("failed", "internal", "boom")


async def test_a_request_nobody_made_is_unknown(client: StreamqClient) -> None:
    status = await client.status(f"never-{uuid.uuid4().hex}")
    assert status.state == "unknown"
    assert msgspec.json.decode(msgspec.json.encode(status)) == {"request_id": status.request_id, "state": "unknown"}


def test_a_finished_result_without_its_log_is_finished() -> None:
    found = _Found(
        now=10,
        result={"s": True, "r": {"finish_reasons": ["stop"], "prompt_tokens": 3, "completion_tokens": 4}, "ft": 9},
    )
    status = status_from("r", found)
    assert (status.state, status.finish_reasons, status.prompt_tokens, status.completion_tokens, status.ended_ms) == (
        "finished",
        ["stop"],
        3,
        4,
        9,
    )


def test_a_finished_request_names_the_worker_its_final_event_names() -> None:
    final = FinalEvent(
        request_id="r", seq=3, finish_reasons=["length"], prompt_tokens=2, completion_tokens=3, worker="host-9-xyz"
    )
    status = status_from("r", _Found(now=10, last=encode_event(final).decode()))
    assert (status.state, status.worker_id) == ("finished", "host-9-xyz")


def test_a_lease_as_claimed_takes_the_attempt_from_the_try_count() -> None:
    status = status_from("r", _Found(now=10, lease="host-9-xyz", tries=3, queue="q", score=4))
    assert (status.state, status.worker_id, status.attempt, status.waited_s) == ("running", "host-9-xyz", 3, 0.006)


def test_a_signature_verifies_only_for_its_body_secret_and_recent_time() -> None:
    body = msgspec.json.encode(CallbackBody(request_id="r", state="finished", ended_ms=1, texts=["hi"]))
    now = int(time.time())
    signed = signature("s3cret", str(now), body)
    assert signed.startswith("sha256=") and len(signed) == 7 + 64
    assert verify("s3cret", str(now), signed, body)
    assert not verify("s3cret", str(now), signed, body + b" ")
    assert not verify("other", str(now), signed, body)
    assert not verify("s3cret", str(now - 3600), signature("s3cret", str(now - 3600), body), body)
    assert not verify("s3cret", "not-a-time", signed, body)


@pytest.fixture(scope="module")
def own_redis() -> Iterator[RedisServer]:
    """A Redis of this module's own: no worker of the session claims its deliveries."""
    with RedisServer(user="streamq", password=uuid.uuid4().hex) as server:
        yield server


async def test_a_claimed_delivery_is_due_again_when_its_lease_passes(own_redis: RedisServer) -> None:
    """A worker that dies mid-delivery leaves it to the next claim once the lease passes;
    a retry is due after its backoff; a delivered one is done (as the worker's user)."""
    worker = aioredis.Redis.from_url(own_redis.url_for(WORKER))
    try:
        request_id = f"cb-{uuid.uuid4().hex}"
        schedule, claim = Script(worker, ScheduleCallback), Script(worker, ClaimCallbacks)
        record = Script(worker, RecordCallback)
        spec = b'{"url":"http://127.0.0.1:9/x"}'
        scheduling = ScheduleCallback(
            callbacks_key=CALLBACKS_KEY,
            callback_key=callback_key(request_id),
            owner_key=owner_key(request_id),
            request_id=request_id,
            callback=spec,
            ttl_ms=60_000,
        )
        assert await schedule(scheduling) == 0  # not ended yet
        await worker.set(owner_key(request_id), ENDED)
        assert await schedule(scheduling) == 1
        assert await schedule(scheduling) == 0  # once per request

        async def claimed() -> list[bytes]:
            _, *reply = await claim(
                ClaimCallbacks(
                    callbacks_key=CALLBACKS_KEY, count=1000, lease_ms=300, callback_prefix=CALLBACK_KEY_PREFIX
                )
            )
            return [reply[i] for i in range(0, len(reply), 4)]

        def recorded(outcome: str, attempts: int, status: int, error: str, retry_in_ms: int) -> RecordCallback:
            return RecordCallback(
                callbacks_key=CALLBACKS_KEY,
                callback_key=callback_key(request_id),
                request_id=request_id,
                outcome=outcome,
                attempts=attempts,
                http_status=status,
                error=error,
                retry_in_ms=retry_in_ms,
                ttl_ms=60_000,
            )

        assert request_id.encode() in await claimed()
        assert request_id.encode() not in await claimed()  # held by the first claim
        await asyncio.sleep(0.4)
        assert request_id.encode() in await claimed()  # its claimer never answered
        await record(recorded("retry", 1, 500, "HTTP 500", 300))
        assert request_id.encode() not in await claimed()
        await asyncio.sleep(0.4)
        assert request_id.encode() in await claimed()
        await record(recorded("delivered", 2, 200, "", 0))
        assert await worker.zscore(CALLBACKS_KEY, request_id) is None
        stored = await worker.hmget(callback_key(request_id), "state", "attempts", "http_status")
        assert stored == [b"delivered", b"2", b"200"]
    finally:
        await worker.aclose()
