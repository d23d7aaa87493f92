"""The client's watchdog: a request that vanished from Redis fails its handle instead of hanging."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis

from producer.client import RequestLost, StreamqClient
from streamq.protocol import JOB_KEY_PREFIX


@pytest.fixture
async def redis(redis_url: str) -> AsyncIterator[aioredis.Redis]:
    client = aioredis.Redis.from_url(redis_url)
    yield client
    await client.aclose()


async def test_a_handle_whose_request_vanished_fails_instead_of_waiting_forever(
    redis_url: str, redis: aioredis.Redis
) -> None:
    """The client's watchdog: a silent stream is fine while its request is queued; once
    the request is neither queued nor running and never ended, the handle says so."""
    queue = f"streamq:queue:nobody-{uuid.uuid4().hex[:8]}"
    async with await StreamqClient.connect(redis_url, queue=queue, silence_check_s=0.3) as client:
        handle = await client.submit("Hello")
        waiting = asyncio.ensure_future(handle.result())
        await asyncio.sleep(1.0)  # three silent periods, all while queued
        assert not waiting.done()
        await redis.delete(JOB_KEY_PREFIX + handle.request_id)  # lost, as with a Redis that lost its data
        await redis.zrem(queue, handle.request_id)
        with pytest.raises(RequestLost, match="no longer queued or running"):
            await asyncio.wait_for(waiting, timeout=5)
