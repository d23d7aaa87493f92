"""Many request channels over one Redis pub/sub connection.

A connection per request would exhaust Redis's client slots, so one ``EventSubscriber``
subscribes channels as requests start and routes each message to its channel's queue.
A connection that stops answering (``streamq.broker.pubsub``) is reconnected like a closed one.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections import defaultdict
from typing import Any

from redis.asyncio import Redis
from redis.asyncio.client import PubSub
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from streamq.broker.pubsub import live_messages
from streamq.broker.replies import as_text
from streamq.protocol import SUBSCRIBER_CHANNEL_PREFIX
from streamq.tasks import stop_task

RECONNECT_FOR_S = 30.0
"""How long a lost connection is retried before the followers are told it is gone."""
RECONNECT_DELAY_S = 0.5
CONFIRM_WITHIN_S = 2.0
"""A subscription not confirmed this soon (its connection was lost meanwhile) is asked again."""


class Resync:
    """Queued for each channel after the connection was re-established: events
    published meanwhile were missed, so the follower re-reads the replay log."""


RESYNC = Resync()

Delivery = bytes | BaseException | Resync
"""What a channel's queue carries: a raw event, ``RESYNC``, or the error that ended
the connection."""


class EventSubscriber:
    """Routes pub/sub messages of many channels to per-channel queues."""

    def __init__(self, redis: Redis, *, reconnect_for_s: float = RECONNECT_FOR_S) -> None:
        self._redis = redis
        self._reconnect_for_s = reconnect_for_s
        self._pubsub: PubSub | None = None
        self._reader: asyncio.Task[None] | None = None
        self._queues: dict[str, list[asyncio.Queue[Delivery]]] = defaultdict(list)
        self._confirmations: dict[str, asyncio.Future[None]] = {}
        self._start_lock = asyncio.Lock()

    async def _ensure_started(self) -> PubSub:
        async with self._start_lock:
            if self._pubsub is None:
                pubsub = self._redis.pubsub()
                # A channel of our own keeps the connection subscribed (and the reader
                # alive) while no request is being followed.
                await pubsub.subscribe(SUBSCRIBER_CHANNEL_PREFIX + uuid.uuid4().hex)
                self._pubsub = pubsub
                self._reader = asyncio.create_task(self._read(pubsub), name="event-subscriber")
            return self._pubsub

    async def subscribe(self, channel: str) -> asyncio.Queue[Delivery]:
        """Subscribe to ``channel`` and return its queue once Redis confirmed it.

        Waiting for the confirmation is what makes "subscribe, then enqueue" safe:
        after it, no event published on the channel can be missed.
        """
        pubsub = await self._ensure_started()
        queue: asyncio.Queue[Delivery] = asyncio.Queue()
        self._queues[channel].append(queue)
        if len(self._queues[channel]) == 1:
            confirmed = asyncio.get_running_loop().create_future()
            self._confirmations[channel] = confirmed
            await self._subscribe_until_confirmed(pubsub, channel, confirmed)
        else:
            await self._confirmations[channel]
        return queue

    async def _subscribe_until_confirmed(self, pubsub: PubSub, channel: str, confirmed: asyncio.Future[None]) -> None:
        """Send SUBSCRIBE only on a live connection. While the reader reconnects (Redis
        restarting), a second coroutine connecting the same socket would race it (two
        readers of one stream); instead the channel joins the pub/sub object's set, which
        the reconnect resubscribes, and that confirms it. Asked again until confirmed."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._reconnect_for_s
        while True:
            connection = pubsub.connection
            if connection is not None and connection.is_connected:
                try:
                    await pubsub.subscribe(channel)
                except (RuntimeError, RedisConnectionError, RedisTimeoutError, OSError):
                    pubsub.channels[pubsub.encoder.decode(pubsub.encoder.encode(channel))] = None
            else:
                pubsub.channels[pubsub.encoder.decode(pubsub.encoder.encode(channel))] = None
            try:
                await asyncio.wait_for(asyncio.shield(confirmed), timeout=CONFIRM_WITHIN_S)
                return
            except TimeoutError:
                if loop.time() >= deadline:
                    raise RedisConnectionError(
                        f"no subscription to {channel} for {self._reconnect_for_s:.0f}s"
                    ) from None

    async def unsubscribe(self, channel: str, queue: asyncio.Queue[Delivery]) -> None:
        """Stop routing ``channel`` to ``queue``; unsubscribe when nobody follows it."""
        queues = self._queues.get(channel)
        if not queues or queue not in queues:
            return
        queues.remove(queue)
        if not queues:
            del self._queues[channel]
            self._confirmations.pop(channel, None)
            if self._pubsub is not None and self._reader is not None and not self._reader.done():
                await self._pubsub.unsubscribe(channel)

    async def close(self) -> None:
        """Stop reading and close the connection."""
        await stop_task(self._reader)
        if self._pubsub is not None:
            await self._pubsub.aclose()
        self._pubsub = self._reader = None

    async def _read(self, pubsub: PubSub) -> None:
        lost_since: float | None = None
        while True:
            try:
                async for message in live_messages(pubsub):
                    lost_since = None
                    self._dispatch(message)
            except asyncio.CancelledError:
                raise
            except (RedisConnectionError, RedisTimeoutError, OSError) as exc:
                # The next listen() reconnects and redis-py resubscribes every channel;
                # the confirmations make the followers re-read the replay log.
                now = time.monotonic()
                lost_since = lost_since or now
                if now - lost_since < self._reconnect_for_s:
                    await asyncio.sleep(RECONNECT_DELAY_S)
                    continue
                self._fail_everyone(exc)
            except Exception as exc:
                self._fail_everyone(exc)
            self._pubsub = None  # start afresh on the next subscribe
            await pubsub.aclose()
            return

    def _dispatch(self, message: dict[str, Any]) -> None:
        kind, channel = message["type"], as_text(message["channel"])
        if kind == "message":
            for queue in self._queues.get(channel, ()):
                queue.put_nowait(message["data"])
        elif kind == "subscribe":
            confirmed = self._confirmations.get(channel)
            if confirmed is not None and not confirmed.done():
                confirmed.set_result(None)
            else:  # resubscribed after a reconnect: events may have been missed meanwhile
                for queue in self._queues.get(channel, ()):
                    queue.put_nowait(RESYNC)

    def _fail_everyone(self, exc: BaseException) -> None:
        """The connection is gone for good: every follower must hear it."""
        for future in self._confirmations.values():
            if not future.done():
                future.set_exception(exc)
        for queues in self._queues.values():
            for queue in queues:
                queue.put_nowait(exc)
        self._queues.clear()
        self._confirmations.clear()
