"""Many request channels over Redis Cluster's sharded pub/sub: one connection per shard.

A sharded channel lives on the shard that serves its slot, and ``SSUBSCRIBE`` is answered
only there (elsewhere: ``MOVED``). So ``ShardedEventSubscriber`` keeps one pub/sub connection
per primary that holds a followed channel, each read by a task of its own (``_ShardReader``),
and routes each message to its channel's inboxes, as ``EventSubscriber`` does over one
connection. redis-py's asyncio client has no sharded pub/sub, so this speaks the commands
itself over plain connections.

What can happen to a shard, and what the followers see:

- **Its connection drops** (a restart, the network): the reader reconnects and subscribes
  its channels again; each re-confirmation queues ``RESYNC`` (events published meanwhile
  were missed: the follower re-reads the replay log from its next ``seq``).
- **Its slots move** (a slot migration, a failover to a replica): Redis unsubscribes the
  moved channels (a ``sunsubscribe`` nobody asked for) or answers ``MOVED``, or the old
  primary stops answering. The subscriber reads the slot map again and subscribes each
  channel at the slot's new primary: the same ``RESYNC``.
- **It stays down** longer than ``reconnect_for_s`` with no replica promoted: its followers
  get the error (the handle's own error path), the other shards' followers carry on.

As in ``EventSubscriber``, only a shard's reader connects, reconnects and reads its socket;
other coroutines write a command to it only while it is subscribed and in step.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from typing import Any

from redis.asyncio.cluster import RedisCluster
from redis.asyncio.connection import Connection
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import AskError, ClusterDownError, RedisClusterException, ResponseError, TryAgainError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from producer.subscriber import CONFIRM_WITHIN_S, RECONNECT_DELAY_S, RECONNECT_FOR_S, ChannelFollowers
from streamq.broker.cluster import refresh_slot_map
from streamq.broker.replies import as_text
from streamq.tasks import stop_task

PING_AFTER_S = 5.0
"""Silence after which a reader asks its shard for a PONG."""
REPLY_WITHIN_S = 10.0
"""How long that PONG may take before the connection counts as dead."""
REFRESH_DELAY_S = 0.1


class ShardedEventSubscriber(ChannelFollowers):
    """Routes sharded pub/sub messages of many channels, over the shards of ``cluster``,
    to per-channel inboxes: ``subscribe`` and ``unsubscribe`` as ``EventSubscriber``'s."""

    def __init__(self, cluster: RedisCluster, *, reconnect_for_s: float = RECONNECT_FOR_S) -> None:
        super().__init__()
        self._cluster = cluster
        self._reconnect_for_s = reconnect_for_s
        self._readers: dict[str, _ShardReader] = {}
        """By node name (``host:port``)."""
        self._home: dict[str, _ShardReader] = {}
        """Where each followed channel is subscribed (or being subscribed)."""
        self._refresh_wanted = False
        self._refresher: asyncio.Task[None] | None = None
        """Reads the slot map again while a refresh is wanted: one at a time, none missed."""
        self._closed = False

    async def _prepare(self) -> None:
        if self._closed:
            raise RuntimeError("the subscriber is closed")

    async def _subscribe_until_confirmed(self, channel: str, confirmed: asyncio.Future[None]) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._reconnect_for_s
        again = False
        while True:
            self._place(channel, again=again)
            again = True
            await asyncio.wait((confirmed,), timeout=CONFIRM_WITHIN_S)
            if confirmed.done():
                return confirmed.result()
            if loop.time() >= deadline:
                raise RedisConnectionError(f"no sharded subscription to {channel} for {self._reconnect_for_s:.0f}s")
            self._refresh_soon()  # not confirmed in time: perhaps its slot moved

    def _place(self, channel: str, *, again: bool = False) -> None:
        """Subscribe ``channel`` at the shard the slot map names, moving it there if it
        was held elsewhere; ``again`` sends SSUBSCRIBE even where it is held already."""
        node = self._cluster.get_node_from_key(channel)
        if node is None:
            raise RedisClusterException(f"no primary serves the slot of {channel}")
        reader = self._readers.get(node.name)
        if reader is None or reader.done:
            reader = self._readers[node.name] = _ShardReader(self, node.host, int(node.port), node.connection_kwargs)
        old = self._home.get(channel)
        if old is not None and old is not reader:
            old.drop(channel)
        self._home[channel] = reader
        reader.add(channel, again=again)

    def _nobody_follows(self, channel: str) -> None:
        reader = self._home.pop(channel, None)
        if reader is not None:
            reader.drop(channel)

    async def close(self) -> None:
        """Stop every reader and close its connection."""
        self._closed = True
        await stop_task(self._refresher)
        readers, self._readers = list(self._readers.values()), {}
        await asyncio.gather(*(reader.stop() for reader in readers))

    def _refresh_soon(self) -> None:
        """Ask for the slot map to be read again; a refresh under way when this is asked
        is followed by another, so no cause is left unanswered."""
        self._refresh_wanted = True
        if not self._closed and (self._refresher is None or self._refresher.done()):
            self._refresher = asyncio.get_running_loop().create_task(self._refresh_while_wanted())

    async def _refresh_while_wanted(self) -> None:
        """Read the slot map again and subscribe every followed channel at its slot's
        primary (those whose slot moved, and those Redis dropped), until nobody asks again."""
        while self._refresh_wanted and not self._closed:
            self._refresh_wanted = False
            await asyncio.sleep(REFRESH_DELAY_S)  # several causes at once: one refresh
            with contextlib.suppress(RedisClusterException, RedisConnectionError, RedisTimeoutError, OSError):
                await refresh_slot_map(self._cluster)  # unreachable: the readers ask again
            for channel in list(self._queues):
                with contextlib.suppress(RedisClusterException):  # no primary for it now: asked again later
                    self._place(channel)

    def _dispatch(self, reader: _ShardReader, reply: list[Any]) -> None:
        kind, channel = as_text(reply[0]), as_text(reply[1])
        if kind == "smessage":
            self._deliver(channel, reply[2])
        elif kind == "ssubscribe":
            if self._home.get(channel) is reader:  # else a late one from where it no longer lives
                self._subscription_confirmed(channel)
        elif kind == "sunsubscribe" and reader.unasked(channel) and self._home.get(channel) is reader:
            # Redis dropped it: its slot moved. Find the new primary and subscribe there.
            self._evict(reader, lambda c: c == channel)

    def _evict(self, reader: _ShardReader, which: Callable[[str], bool]) -> None:
        """The channels of ``reader`` that ``which`` picks are not subscribed there any more
        (their slot moved): forget them there and find where they live now."""
        for channel in [c for c, home in self._home.items() if home is reader and which(c)]:
            del self._home[channel]
            reader.forget(channel)
        self._refresh_soon()

    def _moved(self, reader: _ShardReader, slot: int | None) -> None:
        """``reader``'s shard no longer serves ``slot`` (it answered MOVED), or, with ``None``,
        cannot be reached: the slot map may be stale."""
        if slot is None:
            self._refresh_soon()
        else:
            self._evict(reader, lambda channel: self._cluster.keyslot(channel) == slot)

    def _shard_lost(self, reader: _ShardReader, error: BaseException) -> None:
        """``reader``'s shard stayed unreachable: its followers hear it, unless the slot
        map now puts their channels elsewhere."""
        if self._readers.get(reader.name) is reader:
            del self._readers[reader.name]
        lost = [channel for channel, home in self._home.items() if home is reader]
        for channel in lost:
            del self._home[channel]
        self._fail(lost, error)


class _ShardReader:
    """One shard's pub/sub connection: its channels, and the task that reads it."""

    def __init__(self, owner: ShardedEventSubscriber, host: str, port: int, connection_kwargs: dict[str, Any]) -> None:
        self.name = f"{host}:{port}"
        self._owner = owner
        options = {k: v for k, v in connection_kwargs.items() if k not in ("retry", "host", "port")}
        options["retry"] = Retry(NoBackoff(), 0)  # the reader's own loop decides when to try again
        self._connection = Connection(host=host, port=port, **options)
        self._channels: set[str] = set()
        self._unsubscribing: set[str] = set()
        self._subscribed = False
        """Connected, and SSUBSCRIBE sent for every channel: others may write now."""
        self._task = asyncio.get_running_loop().create_task(self._run(), name=f"sharded-subscriber {self.name}")

    @property
    def done(self) -> bool:
        return self._task.done()

    def add(self, channel: str, *, again: bool = False) -> None:
        if channel in self._channels and not again:
            return
        self._channels.add(channel)
        self._unsubscribing.discard(channel)
        self._write("SSUBSCRIBE", channel)

    def forget(self, channel: str) -> None:
        """``channel`` is no longer subscribed here (Redis dropped it or refused it)."""
        self._channels.discard(channel)
        self._unsubscribing.discard(channel)

    def drop(self, channel: str) -> None:
        if channel in self._channels:
            self._channels.discard(channel)
            if self._write("SUNSUBSCRIBE", channel):
                self._unsubscribing.add(channel)

    def unasked(self, channel: str) -> bool:
        """Whether a ``sunsubscribe`` of ``channel`` came without our asking (a slot move)."""
        if channel in self._unsubscribing:
            self._unsubscribing.discard(channel)
            return False
        return channel in self._channels

    async def stop(self) -> None:
        await stop_task(self._task)
        await self._connection.disconnect()

    def _write(self, *command: str) -> bool:
        """Write ``command`` now if the connection is subscribed and in step; else the
        (re)connect subscribes every channel in the set anyway."""
        writer = self._connection._writer
        if not self._subscribed or writer is None:
            return False
        try:
            writer.writelines(self._connection.pack_command(*command))
        except (RuntimeError, OSError):
            return False
        return True

    async def _run(self) -> None:
        lost_since: float | None = None
        while True:
            try:
                await self._connect()
                lost_since = None
                await self._read()
            except asyncio.CancelledError:
                raise
            except ResponseError as error:  # an answer nobody can act on (a refused ACL, ...)
                self._subscribed = False
                await self._connection.disconnect()
                self._owner._shard_lost(self, error)
                return
            except (RedisConnectionError, RedisTimeoutError, OSError) as error:
                self._subscribed = False
                await self._connection.disconnect()
                now = time.monotonic()
                lost_since = lost_since or now
                if now - lost_since >= self._owner._reconnect_for_s:
                    self._owner._shard_lost(self, error)
                    return
                self._owner._moved(self, None)  # a failover moves the slots: read the map again
                await asyncio.sleep(RECONNECT_DELAY_S)

    async def _connect(self) -> None:
        await self._connection.connect()
        self._unsubscribing.clear()
        sent: set[str] = set()
        # One command per channel (a command's channels must share a slot), until none was
        # added meanwhile; from then on ``add`` writes its own.
        while pending := self._channels - sent:
            for channel in pending:
                await self._connection.send_command("SSUBSCRIBE", channel, check_health=False)
            sent |= pending
        self._subscribed = True

    async def _read(self) -> None:
        """Hand every reply to the owner; a connection silent past ``PING_AFTER_S`` is
        pinged, and one that does not answer within ``REPLY_WITHIN_S`` is dead."""
        heard = time.monotonic()
        pinged = False
        while True:
            try:
                reply = await self._connection.read_response(
                    timeout=min(PING_AFTER_S, REPLY_WITHIN_S) / 2, disconnect_on_error=False
                )
            except AskError as error:  # MOVED or ASK, the reply to one command: still in step
                heard, pinged = time.monotonic(), False
                self._owner._moved(self, error.slot_id)
                continue
            except (ClusterDownError, TryAgainError):  # a slot in flux: look again shortly
                heard, pinged = time.monotonic(), False
                self._owner._moved(self, None)
                continue
            now = time.monotonic()
            if reply is not None:
                heard, pinged = now, False
                if isinstance(reply, list) and len(reply) >= 2 and as_text(reply[0]) != "pong":
                    self._owner._dispatch(self, reply)
                continue
            if now - heard >= PING_AFTER_S + REPLY_WITHIN_S:
                raise RedisConnectionError(f"no reply from {self.name} for {now - heard:.1f}s: the connection is dead")
            if now - heard >= PING_AFTER_S and not pinged:
                self._write("PING")
                pinged = True
