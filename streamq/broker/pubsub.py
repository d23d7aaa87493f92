"""Reading a Redis pub/sub connection that notices when Redis stops answering."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from redis.asyncio.client import PubSub
from redis.exceptions import ConnectionError as RedisConnectionError

try:
    from redis._parsers.hiredis import NOT_ENOUGH_DATA
except ImportError:  # a redis-py without hiredis support: every reply is read through redis-py
    NOT_ENOUGH_DATA = object()

DEFAULT_PING_AFTER_S = 5.0
DEFAULT_REPLY_WITHIN_S = 10.0
PUBLISHED = (b"message", "message")
"""The kind (first element) of a reply that carries a published message, in bytes, or
in text when the connection decodes responses."""


def liveness_bounds(pubsub: PubSub) -> tuple[float, float]:
    """(ping after this much silence, declare the connection dead when the ping has no
    reply within this), from the connection's ``health_check_interval`` and
    ``socket_timeout`` (``streamq.broker.connection``): one configuration for both."""
    options = pubsub.connection_pool.connection_kwargs
    ping_after = options.get("health_check_interval") or DEFAULT_PING_AFTER_S
    reply_within = options.get("socket_timeout") or DEFAULT_REPLY_WITHIN_S
    return float(ping_after), float(reply_within)


async def live_replies(pubsub: PubSub) -> AsyncIterator[list[Any]]:
    """The raw replies of a subscribed connection, in batches: each batch is what one
    read from the socket brought (one reply when traffic is light, hundreds under load).

    A published message is ``[b"message", channel, data]`` (``PUBLISHED`` holds both
    spellings of its kind), a subscription's confirmation ``[b"subscribe", channel,
    count]``. Control replies have already been through ``pubsub.handle_message``, so
    redis-py's own bookkeeping (pending unsubscriptions) holds; pongs are left out.

    The first reply of each batch is read through redis-py (its health check,
    reconnection and resubscription, retries); the rest, already parsed in the
    connection's buffer, are taken without another read: one wait per socket read
    instead of one per message, and no dict built per message.

    A connection that stops answering raises ``ConnectionError`` (the connection dropped:
    the next read reconnects and resubscribes) within ``ping_after + reply_within``
    seconds instead of waiting forever. Waiting on the socket for the next message cannot
    tell an idle channel from a dead connection (redis-py's own health check sends its
    PING only between reads and hides the reply), so this waits in steps and, after
    ``ping_after`` of silence, sends a PING whose reply it expects."""
    ping_after, reply_within = liveness_bounds(pubsub)
    step = min(ping_after, reply_within) / 2
    loop = asyncio.get_running_loop()
    heard = loop.time()
    pinged = False
    while pubsub.subscribed:
        reply = await pubsub.parse_response(block=False, timeout=step)
        now = loop.time()
        if reply is not None:
            heard, pinged = now, False
            batch = await _keep_published_and_control([reply, *_buffered_replies(pubsub)], pubsub)
            if batch:
                yield batch
            continue
        silent = now - heard
        if silent >= ping_after + reply_within:
            if pubsub.connection is not None:
                await pubsub.connection.disconnect()
            raise RedisConnectionError(f"no reply from Redis for {silent:.1f}s: the connection is dead")
        if silent >= ping_after and not pinged:
            await pubsub.ping()
            pinged = True


async def live_messages(pubsub: PubSub) -> AsyncIterator[dict[str, Any]]:
    """``pubsub.listen()``'s messages (dicts with ``type``, ``channel``, ``data``), with
    ``live_replies``' bound on a connection that stops answering. For readers of a few
    messages; ``live_replies`` is the per-message-cheap form."""
    async for batch in live_replies(pubsub):
        for reply in batch:
            kind, *rest = reply
            pattern = rest.pop(0) if len(rest) == 3 else None  # pmessage: pattern, channel, data
            yield {
                "type": kind.decode() if isinstance(kind, bytes) else kind,
                "pattern": pattern,
                "channel": rest[0],
                "data": rest[1],
            }


def _buffered_replies(pubsub: PubSub) -> list[Any]:
    """The replies already parsed in the connection's buffer, without reading the socket
    (empty unless redis-py parses with hiredis, whose reader hands them out one by one)."""
    connection = pubsub.connection
    reader = getattr(getattr(connection, "_parser", None), "_reader", None)
    if reader is None or not hasattr(reader, "gets"):
        return []
    replies: list[Any] = []
    while (reply := reader.gets()) is not NOT_ENOUGH_DATA:
        if isinstance(reply, Exception):  # an error reply, as redis-py's own read raises it
            raise reply
        replies.append(reply)
    return replies


async def _keep_published_and_control(replies: list[Any], pubsub: PubSub) -> list[Any]:
    """``replies`` without pongs (liveness only) and without redis-py's health-check
    replies, control replies passed through ``pubsub.handle_message`` for its
    bookkeeping; published messages untouched and in order."""
    if all(type(reply) is list and reply[0] in PUBLISHED for reply in replies):
        return replies
    connection = pubsub.connection
    kept: list[Any] = []
    for reply in replies:
        if type(reply) is list and reply[0] in PUBLISHED:
            kept.append(reply)
            continue
        if connection is not None and connection.health_check_interval and reply in pubsub.health_check_response:
            continue
        message = await pubsub.handle_message(reply)
        if message is not None and message["type"] != "pong":
            kept.append(reply)
    return kept
