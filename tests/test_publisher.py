"""The coalescing publisher against a real Redis (no engine needed)."""

from __future__ import annotations

import asyncio
import json

import redis.asyncio as aioredis

from worker.publisher import EventPublisher


async def test_concurrent_publishers_keep_each_channel_complete_and_in_order(redis_url: str) -> None:
    redis = aioredis.Redis.from_url(redis_url)
    listener = aioredis.Redis.from_url(redis_url)
    pubsub = listener.pubsub()
    channels = [f"test-publisher:{i}" for i in range(8)]
    await pubsub.subscribe(*channels)
    for _ in channels:
        await pubsub.get_message(timeout=5)
    publisher = EventPublisher(redis)
    publisher.start()

    async def one_request(channel: str) -> None:
        for seq in range(200):
            publisher.publish(channel, json.dumps({"seq": seq}).encode())
            if seq % 7 == 0:
                await asyncio.sleep(0)  # let other "requests" interleave, as jobs do

    await asyncio.gather(*(one_request(c) for c in channels))
    await publisher.flushed()
    received: dict[str, list[int]] = {c: [] for c in channels}
    while sum(map(len, received.values())) < 8 * 200:
        message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=5)
        assert message is not None, "events went missing"
        received[message["channel"].decode()].append(json.loads(message["data"])["seq"])
    assert all(seqs == list(range(200)) for seqs in received.values())

    await publisher.close()
    await pubsub.aclose()
    await listener.aclose()
    await redis.aclose()


async def test_flushed_resolves_only_after_events_reached_redis(redis_url: str) -> None:
    redis = aioredis.Redis.from_url(redis_url)
    listener = aioredis.Redis.from_url(redis_url)
    pubsub = listener.pubsub()
    await pubsub.subscribe("test-publisher:flushed")
    await pubsub.get_message(timeout=5)
    publisher = EventPublisher(redis)
    publisher.start()

    publisher.publish("test-publisher:flushed", b"last words")
    await publisher.close()  # flushes what is buffered before stopping
    message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=5)
    assert message is not None and message["data"] == b"last words"

    await pubsub.aclose()
    await listener.aclose()
    await redis.aclose()
