"""The replay log: each request's events kept in a Redis Stream beside its channel.

Pub/sub keeps nothing, so late or reconnecting subscribers, and a worker taking over a
crashed request, read the log instead: entry ids are ``0-<seq + 1>``, written before the
channel by one Lua script per batch (``append_and_publish``), which also drops events
already logged or from a superseded attempt. Both scripts that write a terminal event
(``append_and_publish``, ``end_request``) also push it to ``RECENT_ENDS_KEY``, in the
same call, for the dashboard.

A batch's command is packed here in one pass: redis-py's asyncio packer copies its
buffer again for every argument, which made packing the worker's largest cost per event.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from redis.asyncio import Redis
from redis.asyncio.connection import AbstractConnection, ConnectionPool
from redis.exceptions import NoScriptError, ResponseError

from streamq.broker.replies import as_text
from streamq.protocol import (
    CALLBACKS_KEY,
    EVENTS_CHANNEL_PREFIX,
    LOG_MAXLEN,
    LOG_MAXLEN_ENV,
    LOG_TTL_ENV,
    LOG_TTL_MS,
    OWNER_KEY_PREFIX,
    ErrorEvent,
    FinalEvent,
    callback_key,
    encode_event,
    events_channel,
    owner_key,
)
from streamq.protocol.names import RECENT_ENDS_KEY, RECENT_ENDS_MAX
from streamq.protocol.scripts import register_script


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
        redis: Redis,
        *,
        maxlen: int | None = None,
        ttl_ms: int | None = None,
        recent_ends_max: int = RECENT_ENDS_MAX,
    ) -> None:
        """``maxlen`` and ``ttl_ms`` default to ``log_limits_from_env()``; ``recent_ends_max``
        caps ``RECENT_ENDS_KEY``, where every terminal event written here is pushed."""
        env_maxlen, env_ttl_ms = log_limits_from_env() if maxlen is None or ttl_ms is None else (0, 0)
        self._redis = redis
        self._maxlen = maxlen if maxlen is not None else env_maxlen
        self._ttl_ms = ttl_ms if ttl_ms is not None else env_ttl_ms
        if recent_ends_max < 1:
            raise ValueError(f"recent_ends_max must be >= 1, got {recent_ends_max}")
        self._recent_ends_max = recent_ends_max
        self._append_script = register_script(redis, "append_and_publish")
        self._take_over_script = register_script(redis, "take_over")
        self._end_script = register_script(redis, "end_request")

    async def append(self, events: Sequence[LogEvent]) -> Appended:
        """Log and publish ``events``, in order, in one command."""
        script = self._append_script
        if self._redis.connection is not None:  # a single-connection client: its own lock and path
            keys: list[str] = []
            args: list[str | int | bytes] = [self._maxlen, self._ttl_ms]
            for event in events:
                keys += [events_channel(event.request_id), owner_key(event.request_id)]
                args += [entry_id(event.seq), event.attempt, int(event.terminal), event.payload]
            args += [RECENT_ENDS_KEY, self._recent_ends_max, EVENTS_CHANNEL_PREFIX]
            reply = await script(keys=keys, args=args)
        else:
            command = pack_append(script.sha, self._maxlen, self._ttl_ms, events, self._recent_ends_max)
            [reply] = await self._send_appends(command, 1)
        skipped, superseded, out_of_step = reply
        return Appended(int(skipped), _request_ids(superseded), _request_ids(out_of_step))

    async def append_groups(self, groups: Sequence[Sequence[LogEvent]]) -> Appended:
        """Log and publish each group of ``events`` with a script call of its own, the calls
        pipelined on one connection (one write, one round trip), the replies merged as one
        call's would be. A Redis Cluster runs a script only on keys of one slot, so there a
        flush splits by slot (one request, or one bucket of requests, per group): this is
        that flush's shape, and ``python -m bench.redis_capacity --grouping`` its price."""
        groups = [group for group in groups if group]
        if not groups:
            return Appended(0)
        if self._redis.connection is not None:  # a single-connection client: no pipelining of its own
            results = [await self.append(group) for group in groups]
            return _merged(results)
        script = self._append_script
        command = b"".join(
            pack_append(script.sha, self._maxlen, self._ttl_ms, group, self._recent_ends_max) for group in groups
        )
        replies = await self._send_appends(command, len(groups))
        return _merged(
            Appended(int(skipped), _request_ids(superseded), _request_ids(out_of_step))
            for skipped, superseded, out_of_step in replies
        )

    async def _send_appends(self, command: bytes, count: int) -> list[Any]:
        """Send ``count`` packed ``append_and_publish`` calls in one write and read their
        replies; a restarted Redis that has forgotten the script (every call refused) gets
        it loaded, and the calls again."""
        pool = self._redis.connection_pool
        try:
            return await _execute_pipelined(pool, command, count)
        except NoScriptError:
            await self._redis.script_load(self._append_script.script)
            return await _execute_pipelined(pool, command, count)

    async def end(self, request_id: str, event: FinalEvent | ErrorEvent, *, attempt: int | None = None) -> int | None:
        """Log and publish ``event`` as ``request_id``'s last, numbered after whatever the
        log holds (computed in Redis), unless the request already ended. For the paths
        that end a request outside the attempt running it (a cancel while queued, a job
        arq gave up on); ``attempt``, when given, is the attempt on whose behalf it is
        written: nothing is written while a newer attempt owns the request. A callback
        stored at enqueue is made due, and the event pushed to ``RECENT_ENDS_KEY``, in the
        same script. Returns the seq given, or ``None`` if nothing was written."""
        keys = [events_channel(request_id), owner_key(request_id)]
        args: list[bytes | str | int] = [
            encode_event(event),
            self._maxlen,
            self._ttl_ms,
            callback_key(request_id),
            CALLBACKS_KEY,
            request_id,
            RECENT_ENDS_KEY,
            self._recent_ends_max,
        ]
        if attempt is not None:
            args.append(attempt)
        seq = int(await self._end_script(keys=keys, args=args))
        return None if seq < 0 else seq

    async def take_over(self, request_id: str, attempt: int) -> TakeOver:
        """Make ``attempt`` the request's owner, so that older attempts still running
        can no longer write (unless it ended, or a newer attempt owns it), and read
        everything logged so far, in one step."""
        keys = [events_channel(request_id), owner_key(request_id)]
        owns, entries = await self._take_over_script(keys=keys, args=[attempt, self._ttl_ms])
        return TakeOver(bool(owns), [_field(fields, b"event") for _, fields in entries])

    async def read(self, request_id: str, from_seq: int = 0) -> list[bytes]:
        """The logged events of ``request_id`` with ``seq >= from_seq``, in order."""
        entries = await self._redis.xrange(events_channel(request_id), min=entry_id(from_seq), max="+")
        return [fields[b"event"] for _, fields in entries]

    async def last(self, request_id: str) -> bytes | None:
        """The newest logged event of ``request_id``, or ``None`` when nothing is logged."""
        entries = await self._redis.xrevrange(events_channel(request_id), count=1)
        return entries[0][1][b"event"] if entries else None


_EVENTS_PREFIX = EVENTS_CHANNEL_PREFIX.encode()
_OWNER_PREFIX = OWNER_KEY_PREFIX.encode()


def pack_append(
    sha: str | bytes, maxlen: int, ttl_ms: int, events: Sequence[LogEvent], recent_ends_max: int = RECENT_ENDS_MAX
) -> bytes:
    """The RESP bytes of ``EVALSHA`` of ``append_and_publish`` for ``events``: per event
    its log and owner keys, then maxlen and ttl, then per event its entry id, attempt,
    terminal flag and payload, then the recent-ends list, its cap and the log keys' prefix
    (the script's KEYS and ARGV)."""
    keys: list[bytes] = []
    args: list[bytes] = []
    events_prefix, owner_prefix = len(_EVENTS_PREFIX), len(_OWNER_PREFIX)
    for event in events:
        request_id = event.request_id.encode()
        size = len(request_id)
        keys.append(
            b"$%d\r\n%b%b\r\n$%d\r\n%b%b\r\n"
            % (size + events_prefix, _EVENTS_PREFIX, request_id, size + owner_prefix, _OWNER_PREFIX, request_id)
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
        8 + 6 * len(events),
        len(sha_bytes),
        sha_bytes,
        len(numkeys),
        numkeys,
    )
    limits = b"$%d\r\n%b\r\n$%d\r\n%b\r\n" % (len(maxlen_bytes), maxlen_bytes, len(ttl_bytes), ttl_bytes)
    return b"".join((head, *keys, limits, *args, _pack_recent_ends(recent_ends_max)))


def _pack_recent_ends(recent_ends_max: int) -> bytes:
    """The RESP bytes of ``append_and_publish``'s last three arguments."""
    key, cap = RECENT_ENDS_KEY.encode(), b"%d" % recent_ends_max
    return b"$%d\r\n%b\r\n$%d\r\n%b\r\n$%d\r\n%b\r\n" % (
        len(key),
        key,
        len(cap),
        cap,
        len(_EVENTS_PREFIX),
        _EVENTS_PREFIX,
    )


async def _pooled_connection(pool: ConnectionPool) -> AbstractConnection:
    connection: AbstractConnection
    try:
        connection = await pool.get_connection()
    except TypeError:  # redis-py before 5.3 wants the command's name
        connection = await pool.get_connection("EVALSHA")
    return connection


async def _execute_pipelined(pool: ConnectionPool, commands: bytes, count: int) -> list[Any]:
    """Send ``count`` commands (RESP bytes, back to back) in one write on a connection of
    ``pool`` and read their ``count`` replies, as ``execute_command`` would one: the first
    error reply raises once every reply was read, so the connection goes back to the pool
    in step."""
    connection = await _pooled_connection(pool)
    try:
        await connection.send_packed_command(commands)
        replies = []
        for _ in range(count):
            try:
                replies.append(await connection.read_response())
            except ResponseError as error:
                replies.append(error)
    except BaseException:  # cut off mid-command or mid-reply: the connection is not reusable
        await connection.disconnect()
        raise
    finally:
        await pool.release(connection)
    for reply in replies:
        if isinstance(reply, ResponseError):
            raise reply
    return replies


def _merged(results: Iterable[Appended]) -> Appended:
    """What several calls' results say together."""
    skipped, superseded, out_of_step = 0, set[str](), set[str]()
    for result in results:
        skipped += result.skipped
        superseded |= result.superseded
        out_of_step |= result.out_of_step
    return Appended(skipped, frozenset(superseded), frozenset(out_of_step))


def _request_ids(log_keys: list[bytes | str]) -> frozenset[str]:
    """The request ids of ``log_keys`` (their names without ``EVENTS_CHANNEL_PREFIX``)."""
    prefix = len(EVENTS_CHANNEL_PREFIX)
    return frozenset(as_text(key)[prefix:] for key in log_keys)


def _field(flat: list[bytes], name: bytes) -> bytes:
    """A field of a stream entry as a Lua script returns it: [name, value, ...]."""
    return flat[flat.index(name) + 1]
