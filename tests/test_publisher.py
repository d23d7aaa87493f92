"""The coalescing publisher and the replay log against a real Redis (no engine)."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis

from producer.protocol import events_channel
from producer.replay import Appended, ReplayLog
from worker.publisher import EventPublisher


@pytest.fixture
async def redis(redis_url: str) -> AsyncIterator[aioredis.Redis]:
    client = aioredis.Redis.from_url(redis_url)
    yield client
    await client.aclose()


async def test_concurrent_requests_arrive_complete_and_in_order(redis: aioredis.Redis, redis_url: str) -> None:
    listener = aioredis.Redis.from_url(redis_url)
    pubsub = listener.pubsub()
    request_ids = [f"pub-{uuid.uuid4().hex}" for _ in range(8)]
    await pubsub.subscribe(*map(events_channel, request_ids))
    for _ in request_ids:
        await pubsub.get_message(timeout=5)
    publisher = EventPublisher(ReplayLog(redis))
    publisher.start()

    async def one_request(request_id: str) -> None:
        for seq in range(200):
            publisher.publish(request_id, seq, 1, json.dumps({"seq": seq}).encode())
            if seq % 7 == 0:
                await asyncio.sleep(0)  # let other "requests" interleave, as jobs do

    await asyncio.gather(*(one_request(r) for r in request_ids))
    await publisher.flushed()
    received: dict[str, list[int]] = {events_channel(r): [] for r in request_ids}
    while sum(map(len, received.values())) < 8 * 200:
        message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=5)
        assert message is not None, "events went missing"
        received[message["channel"].decode()].append(json.loads(message["data"])["seq"])
    assert all(seqs == list(range(200)) for seqs in received.values())
    # ...and the replay log holds the same, readable from any sequence number.
    log = ReplayLog(redis)
    assert [json.loads(e)["seq"] for e in await log.read(request_ids[0], from_seq=150)] == list(range(150, 200))

    await publisher.close()
    await pubsub.aclose()
    await listener.aclose()


async def test_close_flushes_what_is_buffered(redis: aioredis.Redis) -> None:
    request_id = f"pub-{uuid.uuid4().hex}"
    publisher = EventPublisher(ReplayLog(redis))
    publisher.start()
    publisher.publish(request_id, 0, 1, b"last words")
    await publisher.close()
    assert await ReplayLog(redis).read(request_id) == [b"last words"]


async def test_an_event_already_logged_is_not_published_again(redis: aioredis.Redis, redis_url: str) -> None:
    """A retried batch, or a second worker on the same request, cannot duplicate events."""
    request_id = f"pub-{uuid.uuid4().hex}"
    log = ReplayLog(redis)
    listener = aioredis.Redis.from_url(redis_url)
    pubsub = listener.pubsub()
    await pubsub.subscribe(events_channel(request_id))
    await pubsub.get_message(timeout=5)

    assert await log.append([(request_id, 0, 1, b"first"), (request_id, 1, 1, b"second")]) == Appended(0, frozenset())
    again = await log.append([(request_id, 1, 1, b"second again"), (request_id, 2, 1, b"third")])
    assert again == Appended(1, frozenset())  # a duplicate, not a superseded attempt

    published = []
    while (message := await pubsub.get_message(ignore_subscribe_messages=True, timeout=1)) is not None:
        published.append(message["data"])
    assert published == [b"first", b"second", b"third"]
    assert await log.read(request_id) == [b"first", b"second", b"third"]
    assert 0 < await redis.pttl(events_channel(request_id)) <= 3_600_000  # the log expires
    await pubsub.aclose()
    await listener.aclose()


async def test_a_superseded_attempt_can_no_longer_write(redis: aioredis.Redis) -> None:
    """A worker that lost its lease but still runs must not write over the one that
    took the request over."""
    request_id = f"pub-{uuid.uuid4().hex}"
    log = ReplayLog(redis)
    await log.append([(request_id, 0, 1, b"a1-0"), (request_id, 1, 1, b"a1-1")])

    assert await log.take_over(request_id, 2) == [b"a1-0", b"a1-1"]
    assert await log.append([(request_id, 2, 1, b"a1-2 (stale)")]) == Appended(1, frozenset({request_id}))
    mixed = await log.append([(request_id, 2, 2, b"a2-2"), (request_id, 3, 1, b"a1-3 (stale)")])
    assert mixed == Appended(1, frozenset({request_id}))
    assert await log.append([(request_id, 3, 0, b"producer's own event")]) == Appended(0, frozenset())
    assert await log.read(request_id) == [b"a1-0", b"a1-1", b"a2-2", b"producer's own event"]
