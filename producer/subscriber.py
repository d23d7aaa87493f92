"""Many request channels over one Redis pub/sub connection.

A connection per request would exhaust Redis's client slots, so one ``EventSubscriber``
subscribes channels as requests start and routes each message to its channel's queue.
A connection that stops answering (``streamq.broker.pubsub``) is reconnected like a closed one.
"""

from __future__ import annotations

import asyncio
import math
import time
import uuid
from collections import defaultdict, deque
from typing import Any

from redis.asyncio import Redis
from redis.asyncio.client import PubSub
from redis.asyncio.connection import Connection
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from streamq.broker.pubsub import PUBLISHED, live_replies
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
"""What a channel's inbox carries: a raw event, ``RESYNC``, or the error that ended
the connection."""


class Inbox:
    """One follower's deliveries, in order: what ``asyncio.Queue`` would do for a single
    reader, at a fraction of its cost per item (a deque and at most one waiting future),
    since the reader of every pub/sub message puts into one.

    ``get`` with a ``silence_s`` returns ``None`` when nothing arrived for that long, for
    a watchdog; that costs one timer per silence period, not one per item."""

    __slots__ = ("_items", "_waiter", "_timer", "_deadline")

    def __init__(self) -> None:
        self._items: deque[Delivery] = deque()
        self._waiter: asyncio.Future[None] | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._deadline = math.inf
        """When the current wait ends with ``None``."""

    def put_nowait(self, item: Delivery) -> None:
        self._items.append(item)
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            if not waiter.done():
                waiter.set_result(None)

    def empty(self) -> bool:
        return not self._items

    def get_nowait(self) -> Delivery:
        """The next delivery; ``IndexError`` if there is none."""
        return self._items.popleft()

    async def get(self, silence_s: float | None = None) -> Delivery | None:
        """The next delivery, waiting for it; ``None`` once ``silence_s`` passed with
        nothing delivered (never, without ``silence_s``)."""
        if self._items:
            return self._items.popleft()
        loop = asyncio.get_running_loop()
        waiter = self._waiter = loop.create_future()
        self._deadline = math.inf if silence_s is None else loop.time() + silence_s
        if self._timer is None and silence_s is not None:
            self._timer = loop.call_at(self._deadline, self._check_silence)
        try:
            await waiter
        finally:
            if self._waiter is waiter:
                self._waiter = None
        if self._items:
            return self._items.popleft()
        return None  # woken by the silence check

    def _check_silence(self) -> None:
        """The timer of ``get``: wake a reader that has waited ``silence_s`` with nothing
        delivered; a reader that started waiting later is looked at again when its own
        time is up, and a reader that is not waiting needs no timer."""
        self._timer = None
        waiter = self._waiter
        if waiter is None or waiter.done():
            return
        loop = asyncio.get_running_loop()
        if loop.time() >= self._deadline:
            self._waiter = None
            waiter.set_result(None)
        elif self._deadline < math.inf:
            self._timer = loop.call_at(self._deadline, self._check_silence)

    def close(self) -> None:
        """Stop the silence timer: nobody reads this inbox any more."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None


class ChannelFollowers:
    """Which inboxes follow which channel, and the subscription confirmation the first
    follower of a channel waits for: what ``EventSubscriber`` (one connection) and
    ``ShardedEventSubscriber`` (one per shard) share. A subclass asks Redis in
    ``_subscribe_until_confirmed`` and lets go in ``_nobody_follows``; its reader calls
    ``_subscription_confirmed`` and ``_deliver``, and ``_fail`` when followers must hear
    that their connection is gone for good."""

    def __init__(self) -> None:
        self._queues: dict[str, list[Inbox]] = defaultdict(list)
        self._confirmations: dict[str, asyncio.Future[None]] = {}

    async def subscribe(self, channel: str) -> Inbox:
        """Subscribe to ``channel`` and return its inbox once Redis confirmed it.

        Waiting for the confirmation is what makes "subscribe, then enqueue" safe:
        after it, no event published on the channel can be missed.
        """
        await self._prepare()
        queue = Inbox()
        self._queues[channel].append(queue)
        try:
            if len(self._queues[channel]) == 1:
                confirmed = asyncio.get_running_loop().create_future()
                self._confirmations[channel] = confirmed
                await self._subscribe_until_confirmed(channel, confirmed)
            else:
                # Shielded: a follower cancelled here must not cancel the others' confirmation.
                await asyncio.shield(self._confirmations[channel])
        except BaseException:  # cancelled, or no subscription: nobody will read the inbox
            await self.unsubscribe(channel, queue)
            raise
        return queue

    async def unsubscribe(self, channel: str, queue: Inbox) -> None:
        """Stop routing ``channel`` to ``queue``; unsubscribe when nobody follows it."""
        queues = self._queues.get(channel)
        if not queues or queue not in queues:
            return
        queues.remove(queue)
        queue.close()
        if not queues:
            del self._queues[channel]
            self._confirmations.pop(channel, None)
            self._nobody_follows(channel)

    async def _prepare(self) -> None:
        """Before a subscription: start what reads the connection, if it is not running."""

    async def _subscribe_until_confirmed(self, channel: str, confirmed: asyncio.Future[None]) -> None:
        raise NotImplementedError

    def _nobody_follows(self, channel: str) -> None:
        """The last follower of ``channel`` left: unsubscribe it."""
        raise NotImplementedError

    def _deliver(self, channel: str, data: bytes) -> None:
        for queue in self._queues.get(channel, ()):
            queue.put_nowait(data)

    def _subscription_confirmed(self, channel: str) -> None:
        """Redis confirmed ``channel``: its first follower may go on; a confirmation of a
        channel already followed is a resubscription (a reconnect, a moved slot), after
        which its followers re-read the log for what they missed meanwhile."""
        confirmed = self._confirmations.get(channel)
        if confirmed is not None and not confirmed.done():
            confirmed.set_result(None)
        else:
            for queue in self._queues.get(channel, ()):
                queue.put_nowait(RESYNC)

    def _fail(self, channels: list[str], error: BaseException) -> None:
        """``channels``' connection is gone for good: each of their followers hears it."""
        for channel in channels:
            confirmed = self._confirmations.pop(channel, None)
            if confirmed is not None and not confirmed.done():
                confirmed.set_exception(error)
            for queue in self._queues.pop(channel, []):
                queue.put_nowait(error)


class EventSubscriber(ChannelFollowers):
    """Routes pub/sub messages of many channels to per-channel inboxes."""

    def __init__(self, redis: Redis, *, reconnect_for_s: float = RECONNECT_FOR_S) -> None:
        super().__init__()
        self._redis = redis
        self._reconnect_for_s = reconnect_for_s
        self._pubsub: PubSub | None = None
        self._reader: asyncio.Task[None] | None = None
        self._start_lock = asyncio.Lock()
        self._ready_writer: object | None = None
        """The socket (its stream writer) on which the pub/sub connection last finished its
        handshake and resubscribed: the only one other coroutines write to."""

    async def _prepare(self) -> None:
        async with self._start_lock:
            if self._pubsub is None:
                pubsub = self._redis.pubsub()
                # A channel of our own keeps the connection subscribed (and the reader
                # alive) while no request is being followed.
                await pubsub.subscribe(SUBSCRIBER_CHANNEL_PREFIX + uuid.uuid4().hex)
                assert pubsub.connection is not None, "subscribing connected it"
                pubsub.connection.register_connect_callback(self._on_connect)
                self._on_connect(pubsub.connection)
                self._pubsub = pubsub
                self._reader = asyncio.create_task(self._read(pubsub), name="event-subscriber")

    async def _subscribe_until_confirmed(self, channel: str, confirmed: asyncio.Future[None]) -> None:
        """Ask for the subscription until Redis confirms it (the reader routes the
        confirmation). The channel joins the pub/sub object's set, which every reconnect
        resubscribes; SUBSCRIBE is written only while the connection is ready."""
        pubsub = self._pubsub
        if pubsub is None:  # its reader gave up on the connection: so do its followers
            raise RedisConnectionError(f"no connection to subscribe {channel} on")
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._reconnect_for_s
        key = _channel_key(pubsub, channel)
        while True:
            pubsub.channels[key] = None
            pubsub.pending_unsubscribe_channels.discard(key)
            self._send(pubsub, "SUBSCRIBE", channel)
            # asyncio.wait, not wait_for: on Python 3.11 wait_for drops a cancellation that
            # arrives as the confirmation does, and the cancelled follower would go on.
            await asyncio.wait((confirmed,), timeout=CONFIRM_WITHIN_S)
            if confirmed.done():
                return confirmed.result()
            if loop.time() >= deadline:
                raise RedisConnectionError(f"no subscription to {channel} for {self._reconnect_for_s:.0f}s")

    def _on_connect(self, connection: Connection) -> None:
        """redis-py's callback once a (re)connection finished its handshake (after the pub/sub
        object's own, which resubscribed every channel)."""
        self._ready_writer = connection._writer

    def _send(self, pubsub: PubSub, *command: str) -> bool:
        """Write ``command`` on the pub/sub connection if it is ready; False if not.

        Only the reader task connects, reconnects and reads the connection (redis-py would
        otherwise let a second coroutine reconnect the same socket, racing the reader's own
        reconnect mid-handshake). Others write here, without awaiting and without redis-py's
        retries: to the socket that finished its handshake, and only while it is still the
        connection's. A write that fails, or one skipped while the reader reconnects, is
        covered by the resubscription of the reconnect and by the caller asking again."""
        connection = pubsub.connection
        writer = self._ready_writer
        if connection is None or writer is None or connection._writer is not writer:
            return False
        try:
            connection._writer.writelines(connection.pack_command(*command))
        except (RuntimeError, OSError):  # closing: the reader will notice and reconnect
            return False
        return True

    def _nobody_follows(self, channel: str) -> None:
        pubsub = self._pubsub
        if pubsub is None or self._reader is None or self._reader.done():
            return
        key = _channel_key(pubsub, channel)
        # Out of the set the next reconnect resubscribes; a confirmation still on its
        # way finds nobody to route to.
        pubsub.channels.pop(key, None)
        if self._send(pubsub, "UNSUBSCRIBE", channel):
            pubsub.pending_unsubscribe_channels.add(key)

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
                async for replies in live_replies(pubsub):
                    lost_since = None
                    self._dispatch(replies)
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

    def _dispatch(self, replies: list[Any]) -> None:
        queues = self._queues
        for reply in replies:
            kind, channel = reply[0], reply[1]
            if kind in PUBLISHED:
                for queue in queues.get(as_text(channel), ()):
                    queue.put_nowait(reply[2])
            elif kind in (b"subscribe", "subscribe"):
                self._subscription_confirmed(as_text(channel))

    def _fail_everyone(self, exc: BaseException) -> None:
        """The connection is gone for good: every follower must hear it."""
        self._fail(list(self._queues.keys() | self._confirmations.keys()), exc)


def _channel_key(pubsub: PubSub, channel: str) -> Any:
    """``channel`` as redis-py keys ``pubsub.channels`` (bytes or text, by its encoder)."""
    return pubsub.encoder.decode(pubsub.encoder.encode(channel))
