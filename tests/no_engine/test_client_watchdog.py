"""The client's watchdog: a request that vanished from Redis fails its handle instead of hanging."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis

from producer.client import StreamqClient
from producer.errors import MissingEvents, RequestLost
from streamq.broker.replay_log import LogEvent, ReplayLog
from streamq.protocol import JOB_KEY_PREFIX, ChunkEvent, encode_event, events_channel
from tests.support.events import lose_writes


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


def chunk(request_id: str, seq: int, attempt: int, text: str) -> LogEvent:
    event = ChunkEvent(request_id=request_id, seq=seq, attempt=attempt, text=text, token_ids=[seq])
    return LogEvent(request_id, seq, attempt, encode_event(event))


@pytest.mark.parametrize("heard", [True, False], ids=["published", "read from the log"])
async def test_a_handle_fails_rather_than_mix_two_versions_of_its_stream(
    redis_url: str, redis: aioredis.Redis, heard: bool
) -> None:
    """A Redis that lost acknowledged writes no longer holds events a handle delivered; the
    request goes on from what it kept (a new attempt, numbering its events as the lost
    ones were). Whether the handle hears those events live or reads them from the log
    after a silence, it fails with ``MissingEvents`` instead of delivering a mix."""
    queue = f"streamq:queue:rewritten-{uuid.uuid4().hex[:8]}"
    async with await StreamqClient.connect(redis_url, queue=queue, silence_check_s=0.3) as client:
        handle = await client.submit("Hello")  # nobody runs it: the test writes its events
        request_id = handle.request_id
        log = ReplayLog(redis)
        await log.append([chunk(request_id, seq, 1, f"a{seq}") for seq in range(4)])
        events = handle.__aiter__()
        assert [(await anext(events)).seq for _ in range(4)] == [0, 1, 2, 3]
        await lose_writes(redis, request_id, keep=2)
        assert (await log.take_over(request_id, 2)).owns
        again = [chunk(request_id, seq, 2, f"b{seq}") for seq in (2, 3, 4)]
        if heard:
            await log.append(again)
        else:  # logged while the handle heard nothing: it finds them when it checks the log
            for event in again:
                await redis.xadd(events_channel(request_id), {"event": event.payload}, id=f"0-{event.seq + 1}")
        with pytest.raises(MissingEvents, match=r"event [23] is no longer the one delivered"):
            await asyncio.wait_for(anext(events), timeout=5)
