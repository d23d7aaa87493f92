"""The replay log: each request's events kept in a Redis Stream beside its channel.

Pub/sub keeps nothing, so late or reconnecting subscribers, and a worker taking over a
crashed request, read the log instead: entry ids are ``0-<seq + 1>``, written before the
channel by one Lua script per batch (``append_and_publish``), which also drops events
already logged or from a superseded attempt. Both scripts that write a terminal event
(``append_and_publish``, ``end_request``) also push it to ``RECENT_ENDS_KEY``, in the
same call, for the dashboard.

A batch's command is packed here in one pass (``pack_append``, held to the typed call
``AppendAndPublish`` by a test) and sent by ``streamq.broker.transport``: on one Redis in one
write, on a Redis Cluster (``streamq.broker.data_plane``), where a script call covers one
slot, split by bucket (the hash tag of its requests' names), the calls sent to their shards'
primaries and the replies merged as one call's would be. This module says what the commands
mean; the transport, how they reach Redis.

An end waits for its replicas before anyone is told (``streamq.broker.durability``): where
the log's ``durability`` has something to wait for, ``confirm`` (a worker's ends) and ``end``
(the ends written outside a running attempt) send the script deferred (it logs, publishes
nothing, and writes every key it names again) and the wait (``WAIT``, ``WAITAOF``) in one
pipeline on one connection, per primary on a cluster, then publish what it logged. A log
reader (``XRANGE``) may see such an end before it is durable, for as long as the wait takes.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, NamedTuple, TypeVar, cast

from redis.asyncio import Redis
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.exceptions import ResponseError

from streamq.broker.data_plane import ONE_REDIS, DataNames, DataRedis, OwnerRead, names_of
from streamq.broker.durability import Durability, EndWait, NotYetDurable
from streamq.broker.transport import (
    CLUSTER_GLITCHES,
    CLUSTER_ROUNDS,
    ClusterCall,
    ClusterSender,
    NodeReplies,
    OneRedisSender,
    SendAgain,
    Tail,
    pack_command,
    raise_first_error,
)
from streamq.env_vars import LOG_MAXLEN_ENV, LOG_TTL_ENV
from streamq.protocol import (
    CALLBACKS_KEY,
    EVENTS_CHANNEL_PREFIX,
    LOG_MAXLEN,
    LOG_TTL_MS,
    OWNER_KEY_PREFIX,
    ErrorEvent,
    FinalEvent,
    callback_key,
    encode_event,
    script_calls,
)
from streamq.protocol.names import RECENT_ENDS_KEY, RECENT_ENDS_MAX, events_bucket
from streamq.protocol.scripts import Script

T = TypeVar("T")


def log_limits_from_env(environ: Mapping[str, str] = os.environ) -> tuple[int, int]:
    """``(maxlen, ttl_ms)`` from ``$STREAMQ_LOG_MAXLEN`` and ``$STREAMQ_LOG_TTL_S`` (seconds),
    else the protocol's defaults: the one place they are read, by workers and producers alike
    (a producer ends queued requests it cancels in the same log)."""
    maxlen = int(environ.get(LOG_MAXLEN_ENV) or LOG_MAXLEN)
    ttl_ms = round(float(environ.get(LOG_TTL_ENV) or LOG_TTL_MS / 1000) * 1000)
    if maxlen < 1 or ttl_ms < 1000:
        raise ValueError(f"${LOG_MAXLEN_ENV} must be >= 1 and ${LOG_TTL_ENV} >= 1, got {maxlen} and {ttl_ms / 1000:g}")
    return maxlen, ttl_ms


class LogEvent(NamedTuple):
    """One event for ``ReplayLog.append``: its request, number, writer and JSON."""

    request_id: str
    seq: int
    attempt: int
    """The attempt that produced it; 0 is never fenced off (a producer's own event)."""
    payload: bytes
    terminal: bool = False
    """A final or error event: once logged, the request accepts no more events."""


@dataclass(frozen=True)
class Appended:
    """What became of a batch given to ``ReplayLog.append``."""

    skipped: int
    """Events not logged: already there, refused, or out of step."""
    superseded: frozenset[str] = frozenset()
    """Requests whose events were refused because another attempt owns the request, wrote
    the same entry, or ended it: the attempt that sent them should stop."""
    out_of_step: frozenset[str] = frozenset()
    """Requests whose events would have left a gap in their log (it lost entries that were
    written: a Redis that lost acknowledged writes): the attempt that sent them should hand
    its job back, so that the next one goes on from what the log holds."""
    unsent: tuple[LogEvent, ...] = ()
    """On a cluster, the events of the calls that failed (a shard away, say): not logged,
    in order; the rest of the batch was. ``error`` is the first call's failure."""
    error: BaseException | None = None


@dataclass(frozen=True)
class TakeOver:
    """What ``ReplayLog.take_over`` found."""

    owns: bool
    """The attempt owns the request now; else it ended, or a newer attempt owns it."""
    entries: list[bytes]
    """The events logged so far, in order."""


def entry_id(seq: int) -> str:
    """Stream entry id of the event with sequence number ``seq`` (ids must be > 0-0)."""
    return f"0-{seq + 1}"


class ReplayLog:
    """Appends events to request logs (publishing them too) and reads them back."""

    @property
    def ttl_ms(self) -> int:
        """How long a log outlives its last event."""
        return self._ttl_ms

    def __init__(
        self,
        redis: DataRedis,
        *,
        maxlen: int | None = None,
        ttl_ms: int | None = None,
        recent_ends_max: int = RECENT_ENDS_MAX,
        durability: Durability | None = None,
    ) -> None:
        """``maxlen`` and ``ttl_ms`` default to ``log_limits_from_env()``; ``recent_ends_max``
        caps ``RECENT_ENDS_KEY``, where every terminal event written here is pushed.
        ``redis`` is the data plane: one Redis, or a Redis Cluster. ``durability``: what an
        end written here waits for (a worker's, detected; a producer's, read from the
        workers' record); ``None``: nothing, as without replicas."""
        env_maxlen, env_ttl_ms = log_limits_from_env() if maxlen is None or ttl_ms is None else (0, 0)
        self._redis = redis
        self.names: DataNames = names_of(redis)
        self.owners = OwnerRead(redis)
        """The owner keys, for the control plane's scripts that fence by them."""
        self._cluster: ClusterSender | None = None
        """The sender of a Redis Cluster's data plane; ``None`` on one Redis (``_sender``)."""
        self._sender: OneRedisSender | None = None
        if isinstance(redis, RedisCluster):
            self._cluster = ClusterSender(redis)
        else:
            self._sender = OneRedisSender(cast(Redis, redis))  # mypy does not narrow the union
        self._maxlen = maxlen if maxlen is not None else env_maxlen
        self._ttl_ms = ttl_ms if ttl_ms is not None else env_ttl_ms
        if recent_ends_max < 1:
            raise ValueError(f"recent_ends_max must be >= 1, got {recent_ends_max}")
        self._recent_ends_max = recent_ends_max
        self._append_script = Script(redis, script_calls.AppendAndPublish)
        self._take_over_script = Script(redis, script_calls.TakeOver)
        self._end_script = Script(redis, script_calls.EndRequest)
        self.durability = durability

    async def append(self, events: Sequence[LogEvent]) -> Appended:
        """Log and publish ``events``, in order: in one command on one Redis, in one per
        bucket of requests, pipelined per shard, on a cluster (a call that fails there, its
        shard away say, fails alone: its events come back ``unsent``, with the error, and the
        rest are logged, so one shard's outage holds up only its own requests)."""
        if self._cluster is not None:
            appended, _ = await self._append_sharded(self._cluster, events)
            return appended
        [reply] = await self._send_appends(self._pack(events), 1)
        return self._appended(reply)

    def _appended(self, reply: Any) -> Appended:
        """One ``append_and_publish`` reply, read (a deferred call's positions left out)."""
        skipped, superseded, out_of_step = reply[:3]
        return Appended(
            int(skipped),
            frozenset(map(self.names.request_id, superseded)),
            frozenset(map(self.names.request_id, out_of_step)),
        )

    async def append_groups(self, groups: Sequence[Sequence[LogEvent]]) -> Appended:
        """Log and publish each group of ``events`` with a script call of its own, the calls
        pipelined on one connection (one write, one round trip), the replies merged as one
        call's would be. A Redis Cluster runs a script only on keys of one slot, so there a
        flush splits by slot (one request, or one bucket of requests, per group): this is
        that flush's shape, and ``python -m bench.redis_capacity --grouping`` its price."""
        groups = [group for group in groups if group]
        if not groups:
            return Appended(0)
        if self._cluster is not None:  # a cluster splits by bucket anyway
            return _merged([await self.append(group) for group in groups])
        command = b"".join(self._pack(group) for group in groups)
        replies = await self._send_appends(command, len(groups))
        return _merged(map(self._appended, replies))

    async def confirm(self, events: Sequence[LogEvent]) -> Appended:
        """Log ``events`` (ends, each with its request's events not yet logged) as durably as
        ``durability`` asks, then publish them, then return: ``append_and_publish`` deferred
        and the wait in one pipeline on one connection (per primary on a cluster), then the
        events it logged (and those it found logged already, with the same payload: a
        retry's) published. A wait that falls short is noted (``Durability.confirmed``); a
        worker's ends are then held: they come back ``unsent``, not published, with a
        ``NotYetDurable`` error, to be confirmed again (their events are duplicates then).
        On a cluster, a call that failed, or whose events could not be published, comes back
        ``unsent`` (all of its requests' events) too: confirm them again."""
        durability = self.durability
        if durability is None:
            return await self.append(events)
        await durability.fresh()  # after a failover: what the new primaries offer
        if self._cluster is not None:
            return await self._confirm_sharded(self._cluster, events, durability)
        wait = durability.wait()
        started = time.perf_counter()
        reply, waited = await self._then_wait(self._append_script, self._pack(events, defer=True), wait)
        shortfall = durability.check_wait(wait, waited, seconds=time.perf_counter() - started, what="end")
        appended = self._appended(reply)
        if shortfall is not None and durability.held("end"):
            refused = appended.superseded | appended.out_of_step  # nothing more to wait for
            held = tuple(event for event in events if event.request_id not in refused)
            return replace(appended, unsent=held, error=NotYetDurable(str(shortfall)) if held else None)
        await self._publish([events[int(position) - 1] for position in reply[3]])
        return appended

    async def _confirm_sharded(
        self, cluster: ClusterSender, events: Sequence[LogEvent], durability: Durability
    ) -> Appended:
        """``confirm`` on a cluster: ``_append_sharded`` deferred, then each event to publish
        by ``SPUBLISH`` on its slot's primary."""
        appended, publishable = await self._append_sharded(cluster, events, durability)
        calls = [
            ClusterCall(key, pack_command("SPUBLISH", key, event.payload), (event,))
            for event in publishable
            for key in (self.names.events(event.request_id),)
        ]
        if not calls:
            return appended
        _, errors = await cluster.send(calls)
        if not errors:
            return appended
        # logged, not published: their requests are confirmed again (duplicates, published then)
        failed = {event.request_id for call, _ in errors for event in call.of}
        unsent = {*appended.unsent, *(event for event in events if event.request_id in failed)}
        in_order = tuple(event for event in events if event in unsent)
        return replace(appended, unsent=in_order, error=appended.error or errors[0][1])

    async def _publish(self, events: Sequence[LogEvent]) -> None:
        """Publish ``events`` on their channels, in one round trip (one Redis)."""
        if not events:
            return
        publish = self.names.publish_command
        command = b"".join(pack_command(publish, self.names.events(e.request_id), e.payload) for e in events)
        raise_first_error(await self._one_redis().send(command, len(events)))

    async def _send_appends(self, command: bytes, count: int) -> list[Any]:
        """The replies to ``count`` packed ``append_and_publish`` calls, the first error raised."""
        return raise_first_error(await self._one_redis().send_script(self._append_script.text, command, count))

    async def _then_wait(self, script: Script[Any], command: bytes, wait: EndWait) -> tuple[Any, list[Any]]:
        """On one Redis, ``command`` (a packed call of ``script``) and ``wait``'s commands in one
        write: the call's reply (its error raised) and the replies to the wait's."""
        replies = await self._one_redis().send_script(script.text, command + wait.packed(), 1 + wait.reply_count)
        [reply] = raise_first_error(replies[:1])
        return reply, replies[1:]

    def _one_redis(self) -> OneRedisSender:
        """The data plane's sender, known to be one Redis's."""
        assert self._sender is not None
        return self._sender

    async def _append_sharded(
        self, cluster: ClusterSender, events: Sequence[LogEvent], durability: Durability | None = None
    ) -> tuple[Appended, list[LogEvent]]:
        """``append`` on a cluster: one call per bucket present in ``events`` (a bucket's
        names share one slot), sent to the slot's primary. With ``durability`` deferred,
        each primary's calls followed by its wait: then also the events to publish (logged
        now, or already: a retry's)."""
        buckets: dict[int, list[LogEvent]] = {}
        for event in events:
            buckets.setdefault(events_bucket(event.request_id), []).append(event)
        defer = durability is not None
        calls = [
            ClusterCall(self.names.events(group[0].request_id), self._pack(group, defer=defer), tuple(group))
            for group in buckets.values()
        ]
        tail = None if durability is None else _end_wait(durability, "end")
        answered, errors = await cluster.send(calls, self._append_script.text, tail)
        publishable = [call.of[int(p) - 1] for call, reply in answered if defer for p in reply[3]]
        merged = _merged(self._appended(reply) for _, reply in answered)
        if not errors:
            return merged, publishable
        unsent = tuple(event for call, _ in errors for event in call.of)
        return replace(merged, unsent=unsent, error=errors[0][1]), publishable

    def _append_call(self, events: Sequence[LogEvent], *, defer: bool = False) -> script_calls.AppendAndPublish:
        return append_call(self._maxlen, self._ttl_ms, events, self._recent_ends_max, self.names, defer=defer)

    def _pack(self, events: Sequence[LogEvent], *, defer: bool = False) -> bytes:
        sha = self._append_script.sha
        return pack_append(sha, self._maxlen, self._ttl_ms, events, self._recent_ends_max, self.names, defer=defer)

    async def end(self, request_id: str, event: FinalEvent | ErrorEvent, *, attempt: int | None = None) -> int | None:
        """Log and publish ``event`` as ``request_id``'s last, numbered after whatever the
        log holds (computed in Redis), unless the request already ended. For the paths
        that end a request outside the attempt running it (a cancel while queued, a job
        arq gave up on); ``attempt``, when given, is the attempt on whose behalf it is
        written: nothing is written while a newer attempt owns the request. A callback
        stored at enqueue is made due, and the event pushed to ``RECENT_ENDS_KEY``, in the
        same script. Returns the seq given, or ``None`` if nothing was written."""
        names = self.names
        call = script_calls.EndRequest(
            log_key=names.events(request_id),
            owner_key=names.owner(request_id),
            event=encode_event(event),
            maxlen=self._maxlen,
            ttl_ms=self._ttl_ms,
            callback_key="" if names.sharded else callback_key(request_id),  # on a cluster: the caller's
            callbacks_key=CALLBACKS_KEY,
            request_id=request_id,
            recent_ends_key=names.recent_ends(request_id),
            recent_ends_max=self._recent_ends_max,
            attempt="" if attempt is None else attempt,
            publish=names.publish_command,
        )
        durability = self.durability
        if durability is not None:
            await durability.fresh()
            if durability.waits:
                return await self._on_cluster(lambda: self._end_durably(call, durability))
        seq = int(await self._on_cluster(lambda: self._end_script(call)))
        return None if seq < 0 else seq

    async def _end_durably(self, call: script_calls.EndRequest, durability: Durability) -> int | None:
        """``end`` where it waits: ``end_request`` deferred (it logs the end and returns it,
        published by nobody) and the wait in one pipeline on one connection (on a cluster,
        the log's primary's); then the end published, a shortfall noted."""
        command = pack_command(*replace(call, publish="").command(self._end_script.sha))
        if self._cluster is not None:
            end_call = ClusterCall(call.log_key, command, ())
            tail = _end_wait(durability, "end_request")
            answered, errors = await self._cluster.send([end_call], self._end_script.text, tail)
            if errors:
                raise errors[0][1]
            [(_, reply)] = answered
        else:
            wait = durability.wait()
            started = time.perf_counter()
            reply, waited = await self._then_wait(self._end_script, command, wait)
            if isinstance(reply, list):  # else it wrote nothing: the wait covered nothing of it
                durability.check_wait(wait, waited, seconds=time.perf_counter() - started, what="end_request")
        if not isinstance(reply, list):
            return None  # -1: it had ended; -2: a newer attempt owns it
        seq, payload = int(reply[0]), reply[1]
        publish = pack_command(self.names.publish_command, call.log_key, payload)
        if self._cluster is not None:
            _, errors = await self._cluster.send([ClusterCall(call.log_key, publish, ())])
            if errors:
                raise errors[0][1]
        else:
            raise_first_error(await self._one_redis().send(publish, 1))
        return seq

    async def take_over(self, request_id: str, attempt: int) -> TakeOver:
        """Make ``attempt`` the request's owner, so that older attempts still running
        can no longer write (unless it ended, or a newer attempt owns it), and read
        everything logged so far, in one step."""
        call = script_calls.TakeOver(
            log_key=self.names.events(request_id),
            owner_key=self.names.owner(request_id),
            attempt=attempt,
            ttl_ms=self._ttl_ms,
        )
        owns, entries = await self._on_cluster(lambda: self._take_over_script(call))
        return TakeOver(bool(owns), [_field(fields, b"event") for _, fields in entries])

    async def read(self, request_id: str, from_seq: int = 0) -> list[bytes]:
        """The logged events of ``request_id`` with ``seq >= from_seq``, in order."""
        key = self.names.events(request_id)
        entries = await self._on_cluster(lambda: self._redis.xrange(key, min=entry_id(from_seq), max="+"))
        return [fields[b"event"] for _, fields in entries]

    async def last(self, request_id: str) -> bytes | None:
        """The newest logged event of ``request_id``, or ``None`` when nothing is logged."""
        key = self.names.events(request_id)
        entries = await self._on_cluster(lambda: self._redis.xrevrange(key, count=1))
        return entries[0][1][b"event"] if entries else None

    async def exists(self, request_id: str) -> bool:
        """True while ``request_id``'s log is kept."""
        key = self.names.events(request_id)
        return bool(await self._on_cluster(lambda: self._redis.exists(key)))

    async def _on_cluster(self, call: Callable[[], Awaitable[T]]) -> T:
        """``call()``; on a cluster, tried again (up to ``CLUSTER_ROUNDS`` times) after a failure
        that redis-py's own following of the cluster let through: reading the slot map again
        closes every connection, so commands then in flight to healthy shards fail once. The
        calls given here are idempotent, or say what they found (``end``: already ended)."""
        if self.names.sharded:
            for round_ in range(1, CLUSTER_ROUNDS):
                try:
                    return await call()
                except CLUSTER_GLITCHES:
                    await asyncio.sleep(0.1 * round_)
        return await call()


def append_call(
    maxlen: int,
    ttl_ms: int,
    events: Sequence[LogEvent],
    recent_ends_max: int = RECENT_ENDS_MAX,
    names: DataNames = ONE_REDIS,
    *,
    defer: bool = False,
) -> script_calls.AppendAndPublish:
    """``append_and_publish`` of ``events``, each terminal one pushed to the recent ends, by
    ``SPUBLISH`` on a cluster; ``defer``: published by the caller after its wait. On a
    cluster ``events`` are of one bucket (their prefix and recent-ends list are the first one's)."""
    recent_ends, prefix, publish = RECENT_ENDS_KEY, EVENTS_CHANNEL_PREFIX, None
    if names.sharded and events:
        first = events[0].request_id
        recent_ends, prefix = names.recent_ends(first), names.events(first).removesuffix(first)
        publish = names.publish_command
    if defer:
        publish = script_calls.AppendAndPublish.DEFER
    logged: list[script_calls.AppendedEvent] = []
    keys: dict[str, tuple[str, str]] = {}  # a batch holds several events of a request
    appended = script_calls.AppendedEvent._make
    for request_id, seq, attempt, payload, terminal in events:
        pair = keys.get(request_id)
        if pair is None:
            pair = keys[request_id] = (names.events(request_id), names.owner(request_id))
        logged.append(appended((*pair, entry_id(seq), attempt, 1 if terminal else 0, payload)))
    return script_calls.AppendAndPublish(
        maxlen=maxlen,
        ttl_ms=ttl_ms,
        events=logged,
        recent_ends_key=recent_ends,
        recent_ends_max=recent_ends_max,
        log_prefix=prefix,
        publish=publish,
    )


_EVENTS_PREFIX = EVENTS_CHANNEL_PREFIX.encode()
_OWNER_PREFIX = OWNER_KEY_PREFIX.encode()


def pack_append(
    sha: str | bytes,
    maxlen: int,
    ttl_ms: int,
    events: Sequence[LogEvent],
    recent_ends_max: int = RECENT_ENDS_MAX,
    names: DataNames = ONE_REDIS,
    *,
    defer: bool = False,
) -> bytes:
    """The RESP bytes of ``EVALSHA`` of ``append_and_publish`` for ``events``: per event
    its log and owner keys, then maxlen and ttl, then per event its entry id, attempt,
    terminal flag and payload, then the recent-ends list, its cap and the log keys' prefix,
    and on a cluster ``SPUBLISH``, deferred ``''`` (the script's KEYS and ARGV). On a
    cluster ``events`` are of one bucket (their prefix and recent-ends list are the first one's)."""
    keys: list[bytes] = []
    args: list[bytes] = []
    events_prefix, owner_prefix = _EVENTS_PREFIX, _OWNER_PREFIX
    tail = _pack_recent_ends(recent_ends_max)
    publish = b"" if defer else b"SPUBLISH"
    if names.sharded and events:
        first = events[0].request_id
        events_prefix = names.events(first).removesuffix(first).encode()
        owner_prefix = names.owner(first).removesuffix(first).encode()
        tail = _pack_args(names.recent_ends(first).encode(), b"%d" % recent_ends_max, events_prefix, publish)
    elif defer:
        tail += _pack_args(publish)
    for event in events:
        request_id = event.request_id.encode()
        size = len(request_id)
        keys.append(
            b"$%d\r\n%b%b\r\n$%d\r\n%b%b\r\n"
            % (size + len(events_prefix), events_prefix, request_id, size + len(owner_prefix), owner_prefix, request_id)
        )
        entry = b"0-%d" % (event.seq + 1)
        attempt = b"%d" % event.attempt
        payload = event.payload
        args.append(
            b"$%d\r\n%b\r\n$%d\r\n%b\r\n$1\r\n%b\r\n$%d\r\n%b\r\n"
            % (len(entry), entry, len(attempt), attempt, b"1" if event.terminal else b"0", len(payload), payload)
        )
    sha_bytes = sha.encode() if isinstance(sha, str) else sha
    numkeys, maxlen_bytes, ttl_bytes = b"%d" % (2 * len(events)), b"%d" % maxlen, b"%d" % ttl_ms
    head = b"*%d\r\n$7\r\nEVALSHA\r\n$%d\r\n%b\r\n$%d\r\n%b\r\n" % (
        (9 if names.sharded or defer else 8) + 6 * len(events),
        len(sha_bytes),
        sha_bytes,
        len(numkeys),
        numkeys,
    )
    limits = b"$%d\r\n%b\r\n$%d\r\n%b\r\n" % (len(maxlen_bytes), maxlen_bytes, len(ttl_bytes), ttl_bytes)
    return b"".join((head, *keys, limits, *args, tail))


def _pack_recent_ends(recent_ends_max: int) -> bytes:
    """The RESP bytes of ``append_and_publish``'s last three arguments on one Redis."""
    return _pack_args(RECENT_ENDS_KEY.encode(), b"%d" % recent_ends_max, _EVENTS_PREFIX)


def _pack_args(*args: bytes) -> bytes:
    """RESP bulk strings of ``args``, back to back."""
    return b"".join(b"$%d\r\n%b\r\n" % (len(arg), arg) for arg in args)


def _end_wait(durability: Durability, what: str) -> Tail:
    """A cluster send's tail for ends: each primary's wait after its calls, its replies checked
    (``Durability.check_wait``); a wait that falls short fails the primary's calls with
    ``NotYetDurable`` where such ends are held (confirmed again later)."""

    def packed(node: ClusterNode) -> tuple[bytes, int]:
        wait = durability.wait(node.name)
        return wait.packed(), wait.reply_count

    def check(sent: NodeReplies[Any]) -> BaseException | None:
        assert sent.node is not None
        node = sent.node.name
        try:
            short = durability.check_wait(
                durability.wait(node), sent.tail_replies, seconds=sent.seconds, what=what, node=node
            )
        except ResponseError as error:  # a primary demoted under the connection: its calls again
            raise SendAgain from error
        return NotYetDurable(str(short)) if short is not None and durability.held(what) else None

    return Tail(packed, check)


def _merged(results: Iterable[Appended]) -> Appended:
    """What several calls' results say together."""
    skipped, superseded, out_of_step = 0, set[str](), set[str]()
    unsent: list[LogEvent] = []
    error: BaseException | None = None
    for result in results:
        skipped += result.skipped
        superseded |= result.superseded
        out_of_step |= result.out_of_step
        unsent += result.unsent
        error = error or result.error
    return Appended(skipped, frozenset(superseded), frozenset(out_of_step), tuple(unsent), error)


def _field(flat: list[bytes], name: bytes) -> bytes:
    """A field of a stream entry as a Lua script returns it: [name, value, ...]."""
    return flat[flat.index(name) + 1]
