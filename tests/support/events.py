"""Reading a request's channel the way any Redis client would: raw pub/sub JSON.

The producer library drops duplicates and checks order; tests that check those
properties must look at what actually crossed the wire, so they read it here.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any

import redis.asyncio as aioredis

from streamq.protocol import RESULT_KEY_PREFIX, events_channel


async def capture_events(
    redis_url: str, request_id: str, action: Callable[[], Awaitable[Any]], *, timeout_s: float = 120.0
) -> list[dict[str, Any]]:
    """Subscribe to ``request_id``'s channel, run ``action``, and return every event
    received until (and including) the first final or error event."""
    client = aioredis.Redis.from_url(redis_url)
    pubsub = client.pubsub()
    events: list[dict[str, Any]] = []
    try:
        await pubsub.subscribe(events_channel(request_id))
        await pubsub.get_message(timeout=5)  # the subscribe confirmation
        await action()
        async with asyncio.timeout(timeout_s):
            while True:
                message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=1)
                if message is None:
                    continue
                event = json.loads(message["data"])
                events.append(event)
                if event["type"] in ("final", "error"):
                    return events
    finally:
        await pubsub.aclose()
        await client.aclose()


def assert_well_formed(events: list[dict[str, Any]], request_id: str) -> None:
    """Sequence numbers contiguous from 0, exactly one terminal event, at the end."""
    assert [e["seq"] for e in events] == list(range(len(events)))
    assert all(e["request_id"] == request_id and e["v"] == 1 for e in events)
    terminal = [e for e in events if e["type"] in ("final", "error")]
    assert terminal == [events[-1]]


async def job_result(redis: aioredis.Redis, job_id: str, timeout_s: float = 30.0) -> dict[str, Any]:
    """arq's stored result of a job, once the worker has written it."""
    async with asyncio.timeout(timeout_s):
        while (result := await redis.get(RESULT_KEY_PREFIX + job_id)) is None:
            await asyncio.sleep(0.05)
    decoded: dict[str, Any] = json.loads(result)
    return decoded


async def lose_writes(redis: aioredis.Redis, request_id: str, *, keep: int) -> None:
    """Make ``request_id``'s log what a Redis that lost its latest writes (a crash without
    fsync, a failover to a replica that lagged) holds: its first ``keep`` entries."""
    key = events_channel(request_id)
    kept = (await redis.xrange(key))[:keep]
    await redis.delete(key)
    for entry_id, fields in kept:
        await redis.xadd(key, fields, id=entry_id)
