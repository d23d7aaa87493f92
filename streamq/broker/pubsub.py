"""Reading a Redis pub/sub connection that notices when Redis stops answering."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from redis.asyncio.client import PubSub
from redis.exceptions import ConnectionError as RedisConnectionError

DEFAULT_PING_AFTER_S = 5.0
DEFAULT_REPLY_WITHIN_S = 10.0


def liveness_bounds(pubsub: PubSub) -> tuple[float, float]:
    """(ping after this much silence, declare the connection dead when the ping has no
    reply within this), from the connection's ``health_check_interval`` and
    ``socket_timeout`` (``streamq.broker.connection``): one configuration for both."""
    options = pubsub.connection_pool.connection_kwargs
    ping_after = options.get("health_check_interval") or DEFAULT_PING_AFTER_S
    reply_within = options.get("socket_timeout") or DEFAULT_REPLY_WITHIN_S
    return float(ping_after), float(reply_within)


async def live_messages(pubsub: PubSub) -> AsyncIterator[dict[str, Any]]:
    """``pubsub.listen()``, except that a connection that stops answering raises
    ``ConnectionError`` (the connection dropped: the next read reconnects and
    resubscribes) within ``ping_after + reply_within`` seconds instead of waiting forever.

    Waiting on the socket for the next message cannot tell an idle channel from a dead
    connection (redis-py's own health check sends its PING only between reads and hides
    the reply), so this waits in steps and, after ``ping_after`` of silence, sends a
    PING whose reply it expects."""
    ping_after, reply_within = liveness_bounds(pubsub)
    loop = asyncio.get_running_loop()
    heard = loop.time()
    pinged = False
    while pubsub.subscribed:
        message = await pubsub.get_message(timeout=min(ping_after, reply_within) / 2)
        now = loop.time()
        if message is not None:
            heard, pinged = now, False
            if message["type"] != "pong":
                yield message
            continue
        silent = now - heard
        if silent >= ping_after + reply_within:
            if pubsub.connection is not None:
                await pubsub.connection.disconnect()
            raise RedisConnectionError(f"no reply from Redis for {silent:.1f}s: the connection is dead")
        if silent >= ping_after and not pinged:
            await pubsub.ping()
            pinged = True
