"""The scripts that move a batch on, as the gateway's Redis role runs them: a call retried
after a reply lost to a Redis restart or failover (redis-py sends it again) changes nothing
the first call did not, and a gateway without the batch's lease changes nothing."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis

from devkit.redis_server import RedisServer
from gateway.batch_api import names
from gateway.batch_api.scripts import BatchScripts, LeaseLost

TOKEN = "owner-token"


@pytest.fixture
async def gateway_redis(redis_server: RedisServer) -> AsyncIterator[aioredis.Redis]:
    """Redis as the gateway's role: the scripts must run within its rights."""
    from streamq.protocol.roles import GATEWAY

    client = aioredis.Redis.from_url(redis_server.url_for(GATEWAY))
    yield client
    await client.aclose()


@pytest.fixture
async def batch(admin: aioredis.Redis) -> AsyncIterator[str]:
    """A batch whose lease this test holds."""
    batch_id = f"batch_{uuid.uuid4().hex}"
    await admin.hset(names.batch_key(batch_id), mapping={"status": "in_progress", "completed": 0, "failed": 0})
    await admin.set(names.batch_lease_key(batch_id), TOKEN, px=60_000)
    yield batch_id
    keys = [names.batch_key(batch_id), names.batch_lease_key(batch_id), names.batch_inflight_key(batch_id)]
    keys += [names.batch_results_key(batch_id, kind) for kind in ("out", "err")]
    await admin.delete(*keys, names.batch_parts_key(batch_id), names.batch_answered_key(batch_id))


async def test_a_line_s_result_is_recorded_once_however_often_it_is_sent(
    gateway_redis: aioredis.Redis, admin: aioredis.Redis, batch: str
) -> None:
    scripts = BatchScripts(gateway_redis)
    await scripts.start_line(batch, TOKEN, f"{batch}-3", b'{"line": 3}', 100, 4)
    first = await scripts.record_result(batch, f"{batch}-3", 3, b"out-3", ok=True, input_tokens=5, output_tokens=7)
    again = await scripts.record_result(batch, f"{batch}-3", 3, b"out-3", ok=True, input_tokens=5, output_tokens=7)
    assert (first, again) == (True, False)
    assert await admin.lrange(names.batch_results_key(batch, "out"), 0, -1) == [b"out-3"]
    assert await admin.hmget(names.batch_key(batch), ["completed", "input_tokens", "output_tokens"]) == [
        b"1",
        b"5",
        b"7",
    ]
    assert await admin.hlen(names.batch_inflight_key(batch)) == 0


async def test_a_result_whose_note_redis_lost_is_still_recorded(
    gateway_redis: aioredis.Redis, admin: aioredis.Redis, batch: str
) -> None:
    """A failover that lost the line's note (``start_line``) must not lose its result."""
    scripts = BatchScripts(gateway_redis)
    assert await scripts.record_result(batch, f"{batch}-8", 8, b"err-8", ok=False, input_tokens=0, output_tokens=0)
    assert await admin.lrange(names.batch_results_key(batch, "err"), 0, -1) == [b"err-8"]
    assert await admin.getbit(names.batch_answered_key(batch), 8) == 1


async def test_a_retried_part_commit_trims_and_lists_once(
    gateway_redis: aioredis.Redis, admin: aioredis.Redis, batch: str
) -> None:
    scripts = BatchScripts(gateway_redis)
    results = names.batch_results_key(batch, "out")
    await admin.rpush(results, b"a", b"b", b"c", b"d", b"e")
    part = f"batches/{batch}/out/000000-{TOKEN}.jsonl"
    await scripts.commit_part(batch, TOKEN, "out", 3, part)
    await scripts.commit_part(batch, TOKEN, "out", 3, part)  # its reply lost: sent again
    assert await admin.lrange(results, 0, -1) == [b"d", b"e"]
    assert await admin.lrange(names.batch_parts_key(batch), 0, -1) == [part.encode()]


async def test_a_retried_line_failure_is_written_and_counted_once(
    gateway_redis: aioredis.Redis, admin: aioredis.Redis, batch: str
) -> None:
    scripts = BatchScripts(gateway_redis)
    await scripts.line_failed(batch, TOKEN, b"expired-5", 500, 6, 5)
    await scripts.line_failed(batch, TOKEN, b"expired-5", 500, 6, 5)
    assert await admin.lrange(names.batch_results_key(batch, "err"), 0, -1) == [b"expired-5"]
    assert await admin.hget(names.batch_key(batch), "failed") == b"1"


async def test_a_gateway_without_the_lease_moves_nothing(
    gateway_redis: aioredis.Redis, admin: aioredis.Redis, batch: str
) -> None:
    scripts = BatchScripts(gateway_redis)
    with pytest.raises(LeaseLost):
        await scripts.start_line(batch, "another-token", f"{batch}-1", b"{}", 10, 2)
    assert not await scripts.transition(batch, TOKEN, "validating", {"status": "failed"})  # not from that state
    with pytest.raises(LeaseLost):
        await scripts.transition(batch, "another-token", "in_progress", {"status": "finalizing"})
    assert await admin.hget(names.batch_key(batch), "status") == b"in_progress"
    assert await admin.hlen(names.batch_inflight_key(batch)) == 0
