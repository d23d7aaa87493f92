"""What an end waits for before anyone is told: its replicas (``WAIT``) and the primary's AOF
(``WAITAOF``).

An end (a request's terminal event, a callback's claim) is the one write that must survive a
failover: tokens Redis loses are produced again by a take-over, but an end that subscribers
saw and a promoted replica lacks makes the request end twice. So where the primary has
replicas, each end is followed, on the connection that wrote it and in the same pipeline, by
``WAIT <replicas> <timeout>`` (with ``fsync=local`` also ``WAITAOF 1 0 <timeout>``), and
published only once they answer. ``WAIT`` covers the connection's own last write (a fresh
connection whose script wrote nothing is told "acknowledged" at once even while its replica
is stalled), so every confirmation writes something on that connection first; replication
is ordered, so a replica that has that write has everything written before it. Tokens never
wait. A worker's own end that is still short when the bound passes is held
(``NotYetDurable``) and confirmed again, after its primary is read again, until it is
durable or nothing is left to wait for (the primary dropped the replica, or another primary
took over); any other end (a callback's claim, a cancel, an end written outside an attempt)
is told anyway. A shortfall is logged once per episode and counted.

- ``DurabilitySpec``: the policy asked for (a worker's ``--durable-ends``): ``auto``, ``off``,
  or ``replicas=N|all,fsync=none|local``.
- ``detect``: what one primary offers (replicas online, AOF on, ``WAITAOF`` known).
- ``EndWait``: what one end on one primary waits for: the commands, and the check of their
  replies (a ``Shortfall``).
- ``Durability``: the waits of one plane's primaries and the shortfalls' bookkeeping;
  ``DetectedDurability`` (workers: read with ``INFO``, again every ``DURABILITY_RECHECK_S``
  and right after a shortfall, and written to ``DURABILITY_KEY``) and ``PublishedDurability``
  (producers and gateways, which may not run ``INFO``: that record, read at most every
  ``DURABILITY_RECHECK_S``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import re
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

from redis.asyncio import Redis
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from streamq.broker.cluster import refresh_slot_map
from streamq.broker.replies import as_text
from streamq.broker.transport import pack_command
from streamq.env_vars import DURABLE_ENDS_ENV
from streamq.protocol.names import DEFAULT_DURABLE_ENDS, DURABILITY_KEY, DURABILITY_RECHECK_S, DURABILITY_TTL_MS
from streamq.tasks import stop_task

logger = logging.getLogger("streamq.durability")

REPLICA_REPLY: Final = "cannot be used with replica instances"
"""What ``WAIT`` and ``WAITAOF`` answer on a replica: a primary demoted under a connection,
which passes once the client reaches the new primary (a transient reply)."""
RECORD_VERSION: Final = 1


class NotYetDurable(Exception):
    """A worker's end that its replicas did not acknowledge within the bound: not told, and
    confirmed again (``ReplayLog.confirm`` returns its events as unsent with this error)."""


WaitHook = Callable[[str, float, bool], None]
"""Told of each confirmation: what waited (``end``, ``end_request``, ``callback``,
``cancel``), its seconds, and whether it fell short."""


# --- the policy asked for ------------------------------------------------------------


@dataclass(frozen=True)
class DurabilitySpec:
    """What an end waits for, as asked (``--durable-ends``)."""

    replicas: int | None = None
    """Replicas each end waits for; ``None``: every replica its primary reports online."""
    fsync: bool = False
    """Also the primary's own AOF fsync (``WAITAOF 1 0``), where the server has it and AOF is on."""

    @classmethod
    def parse(cls, text: str) -> DurabilitySpec:
        """``auto`` (every online replica, no fsync), ``off``, or a comma list of
        ``replicas=N|all`` and ``fsync=none|local`` (the one not given: ``all``, ``none``)."""
        spec = text.strip().lower()
        if spec == "auto":
            return AUTO
        if spec == "off":
            return OFF
        replicas: int | None = None
        fsync = False
        seen: set[str] = set()
        for part in spec.split(","):
            name, equals, value = (piece.strip() for piece in part.partition("="))
            if not equals or name in seen:
                raise ValueError(f"durable ends: {text!r}: want auto, off, or replicas=N|all,fsync=none|local")
            seen.add(name)
            if name == "replicas":
                if value != "all" and not value.isdigit():
                    raise ValueError(f"durable ends: replicas={value!r}: want a count (0 or more) or all")
                replicas = None if value == "all" else int(value)
            elif name == "fsync":
                if value not in ("none", "local"):
                    raise ValueError(
                        f"durable ends: fsync={value!r}: want none or local (waiting for the replicas' "
                        "fsync costs about a second per end: replicas report it once a second)"
                    )
                fsync = value == "local"
            else:
                raise ValueError(f"durable ends: {name!r}: want replicas= or fsync=")
        return cls(replicas, fsync)

    @property
    def off(self) -> bool:
        return self.replicas == 0 and not self.fsync

    def __str__(self) -> str:
        if self == AUTO:
            return "auto"
        if self.off:
            return "off"
        return f"replicas={'all' if self.replicas is None else self.replicas},fsync={'local' if self.fsync else 'none'}"


AUTO: Final = DurabilitySpec()
OFF: Final = DurabilitySpec(0, False)


def durable_ends_from_env(environ: Mapping[str, str] = os.environ) -> str:
    """``$STREAMQ_DURABLE_ENDS``, else ``auto`` (parsed by ``DurabilitySpec.parse``)."""
    return environ.get(DURABLE_ENDS_ENV) or DEFAULT_DURABLE_ENDS


# --- what one end waits for, and its check ----------------------------------------------


@dataclass(frozen=True)
class EndWait:
    """What one end on one primary waits for: ``replicas`` acknowledgements (``WAIT``) and,
    with ``fsync``, the primary's AOF fsync (``WAITAOF 1 0``), each at most ``timeout_ms``."""

    replicas: int = 0
    fsync: bool = False
    timeout_ms: int = 0

    @property
    def waits(self) -> bool:
        """False: nothing to wait for, ends go out at once (no extra command)."""
        return self.replicas > 0 or self.fsync

    def commands(self) -> list[tuple[str | int, ...]]:
        """The commands to send right after the end's write, on its connection."""
        commands: list[tuple[str | int, ...]] = []
        if self.replicas > 0:
            commands.append(("WAIT", self.replicas, self.timeout_ms))
        if self.fsync:
            commands.append(("WAITAOF", 1, 0, self.timeout_ms))
        return commands

    def packed(self) -> bytes:
        """``commands()`` as RESP, back to back."""
        return b"".join(pack_command(*command) for command in self.commands())

    @property
    def reply_count(self) -> int:
        return len(self.commands())

    def check(self, replies: Sequence[Any]) -> Shortfall | None:
        """``None`` when ``replies`` (of ``commands()``, an error reply as its exception) say
        the end is as durable as asked, else what fell short. Raises the error of a replica's
        reply (``REPLICA_REPLY``): transient, the caller sends the whole confirmation again."""
        acked: int | None = None
        fsynced: bool | None = None
        error: BaseException | None = None
        answers = iter(replies)
        if self.replicas > 0:
            reply = next(answers)
            if isinstance(reply, BaseException):
                error = reply
            else:
                acked = int(reply)
        if self.fsync:
            reply = next(answers)
            if isinstance(reply, BaseException):
                error = error or reply
            else:
                fsynced = int(reply[0]) >= 1
        if error is not None and REPLICA_REPLY in str(error):
            raise error
        if error is None and (acked is None or acked >= self.replicas) and fsynced is not False:
            return None
        return Shortfall(self, acked, fsynced, None if error is None else f"{type(error).__name__}: {error}")

    def __str__(self) -> str:
        parts = []
        if self.replicas > 0:
            parts.append(f"{self.replicas} replica{'s' if self.replicas > 1 else ''} (WAIT)")
        if self.fsync:
            parts.append("the primary's AOF fsync (WAITAOF)")
        return " and ".join(parts) or "nothing"


NO_WAIT: Final = EndWait()


@dataclass(frozen=True)
class Shortfall:
    """An end whose wait ended before it was as durable as asked (the bound passed)."""

    wait: EndWait
    acked: int | None
    """Replicas that acknowledged it (``None``: not asked, or the reply was an error)."""
    fsynced: bool | None
    """The primary fsynced it (``None``: not asked, or the reply was an error)."""
    error: str | None = None

    def __str__(self) -> str:
        parts = []
        if self.error is not None:
            parts.append(self.error)
        if self.acked is not None and self.acked < self.wait.replicas:
            parts.append(f"{self.acked} of {self.wait.replicas} replicas acknowledged it")
        if self.fsynced is False:
            parts.append("the primary had not fsynced it")
        return f"{'; '.join(parts)} within {self.wait.timeout_ms / 1000:g}s"


# --- what one primary offers --------------------------------------------------------------


@dataclass(frozen=True)
class Replica:
    address: str
    lag_s: int | None
    """Seconds since the replica's last acknowledgement, as its primary reports it."""


@dataclass(frozen=True)
class ServerState:
    """What ``detect`` found on one primary."""

    replicas: tuple[Replica, ...]
    """The replicas it reports ``state=online`` (a frozen link stays online until
    ``repl-timeout`` passes, its lag rising)."""
    aof: bool
    waitaof: bool
    """It knows ``WAITAOF`` (Redis 7.2 and later, Valkey) and this user may run it."""
    waitaof_note: str = ""
    """Why not, when it does not."""

    def lags(self) -> str:
        return ", ".join(f"{r.address} lag {'?' if r.lag_s is None else r.lag_s}s" for r in self.replicas) or "none"


_REPLICA_FIELD = re.compile(r"slave\d+")


async def detect(execute: Callable[..., Awaitable[Any]]) -> ServerState:
    """What the primary that ``execute`` (a client's or a cluster node's ``execute_command``)
    reaches offers: ``INFO replication`` (its online replicas), ``INFO persistence`` (AOF on),
    and a probe ``WAITAOF 0 0 0`` ("unknown command": none)."""
    replication = _info(await execute("INFO", "replication"))
    persistence = _info(await execute("INFO", "persistence"))
    replicas = []
    for name, value in replication.items():
        if _REPLICA_FIELD.fullmatch(name) and isinstance(value, Mapping) and str(value.get("state")) == "online":
            lag = value.get("lag")
            replicas.append(Replica(f"{value.get('ip')}:{value.get('port')}", None if lag is None else int(lag)))
    waitaof, note = True, ""
    try:
        await execute("WAITAOF", 0, 0, 0)
    except ResponseError as exc:
        text = str(exc)
        if REPLICA_REPLY not in text:  # a replica has it; an end never waits there
            waitaof = False
            note = "the server has no WAITAOF (Redis before 7.2)" if "unknown command" in text.lower() else text
    return ServerState(tuple(replicas), str(persistence.get("aof_enabled", "0")) == "1", waitaof, note)


async def _detect_node(node: ClusterNode) -> ServerState:
    """``detect`` on one cluster primary; a failure names it."""
    try:
        return await detect(node.execute_command)
    except (RedisConnectionError, RedisTimeoutError, OSError) as exc:
        raise RedisConnectionError(f"primary {node.name}: {exc}") from exc


def _info(reply: Any) -> dict[str, Any]:
    """An ``INFO`` reply as a dict (redis-py's parsed one as it is)."""
    if isinstance(reply, dict):
        return reply
    fields: dict[str, Any] = {}
    for line in as_text(reply).splitlines():
        key, colon, value = line.partition(":")
        if not colon or line.startswith("#"):
            continue
        if "=" in value:
            fields[key] = dict(item.partition("=")[::2] for item in value.split(","))
        else:
            fields[key] = value
    return fields


# --- a plane's waits ---------------------------------------------------------------


class Durability:
    """What ends wait for on the primaries of one plane (one Redis, or each primary of a
    Redis Cluster by its node name), and the bookkeeping of the waits: a shortfall is
    logged once per episode (until an end on that primary is acknowledged again) and told
    to ``on_wait``, as every wait is. Nothing to wait for until told otherwise."""

    holds_ends: bool = False
    """A worker's own end (``what`` ``end``) that falls short is held and confirmed again
    (``NotYetDurable``), rather than told."""

    def __init__(self, *, timeout_ms: int, on_wait: WaitHook | None = None) -> None:
        self.timeout_ms = timeout_ms
        self.on_wait = on_wait
        self._default = NO_WAIT
        self._nodes: dict[str, EndWait] = {}
        self._short: set[str] = set()

    def wait(self, node: str = "") -> EndWait:
        """What an end on ``node`` waits for (``""``: one Redis; on a cluster, an unknown node
        waits as the most demanding primary does). No I/O."""
        return self._nodes.get(node, self._default)

    def node_waits(self) -> dict[str, EndWait]:
        """Each cluster primary's wait, by node name (empty on one Redis)."""
        return dict(self._nodes)

    @property
    def waits(self) -> bool:
        """Some end somewhere waits for something (else every path is as without waits)."""
        return self._default.waits or any(wait.waits for wait in self._nodes.values())

    def set_waits(self, default: EndWait, nodes: Mapping[str, EndWait] | None = None) -> None:
        self._default = default
        self._nodes = dict(nodes or {})

    async def fresh(self) -> None:
        """Bring the waits up to date if they may be stale (a producer's read of the record);
        a no-op where they are kept fresh in the background (a worker's)."""

    def check_wait(
        self, wait: EndWait, replies: Sequence[Any], *, seconds: float, what: str, node: str = ""
    ) -> Shortfall | None:
        """Check ``replies`` to ``wait``'s commands (``EndWait.check``, which raises a
        replica's reply), note a shortfall, and tell ``on_wait``. A short end is told anyway,
        but where this returns a shortfall that ``held`` says is held."""
        shortfall = wait.check(replies)
        if self.on_wait is not None:
            self.on_wait(what, seconds, shortfall is not None)
        if shortfall is None:
            if node in self._short:
                self._short.discard(node)
                logger.info("durable ends: %s confirms ends again", _where(node))
            return None
        if self.held(what):
            self.holding(node)
        if node not in self._short:
            self._short.add(node)
            self.shortfall_began(shortfall, what, node)
        return shortfall

    def held(self, what: str) -> bool:
        """Whether a short end of this kind is held (confirmed again), rather than told."""
        return self.holds_ends and what == "end"

    def holding(self, node: str) -> None:
        """An end on ``node`` fell short and is held (every time it does)."""

    def shortfall_began(self, shortfall: Shortfall, what: str, node: str) -> None:
        """The first shortfall of an episode on ``node``: logged."""
        logger.warning("durable ends: %s", _shortfall_text(shortfall, what, node, held=self.held(what)))


def _where(node: str) -> str:
    return f"primary {node}" if node else "the primary"


def _shortfall_text(shortfall: Shortfall, what: str, node: str, *, held: bool, lags: str | None = None) -> str:
    where = _where(node)
    replicas = "" if lags is None else f" (replicas online: {lags})"
    if held:
        return (
            f"an end ({what}) on {where} is not durable yet: {shortfall}{replicas}; held, and confirmed again "
            f"until its replicas acknowledge it, {where} drops a replica it cannot reach (repl-timeout) or "
            "another primary takes over"
        )
    return (
        f"an end ({what}) on {where} was told before it was durable: {shortfall}{replicas}; told anyway, "
        f"and so is every end until {where} acknowledges them again"
    )


def _strictest(waits: Iterable[EndWait], timeout_ms: int) -> EndWait:
    """The wait that asks the most of any of ``waits``."""
    listed = list(waits)
    return EndWait(max((w.replicas for w in listed), default=0), any(w.fsync for w in listed), timeout_ms)


def primaries_of(redis: Redis | RedisCluster) -> frozenset[str] | None:
    """Where the data's primaries are, as far as the client knows without I/O: a cluster's
    primaries by node name, the master a Sentinel client last connected to; ``None`` for a
    plain client (one address, for good)."""
    if isinstance(redis, RedisCluster):
        return frozenset(node.name for node in redis.get_primaries())
    address = getattr(redis.connection_pool, "master_address", None)  # a Sentinel-managed pool's
    return None if address is None else frozenset({f"{address[0]}:{address[1]}"})


class DetectedDurability(Durability):
    """A worker's waits on one plane, read from its primaries (``detect``) for ``spec``; again
    every ``recheck_s`` and right after a shortfall (``start``), each time told to
    ``on_detected`` (which writes ``DURABILITY_KEY``)."""

    def __init__(
        self,
        redis: Redis | RedisCluster,
        spec: DurabilitySpec,
        *,
        timeout_ms: int,
        on_wait: WaitHook | None = None,
        recheck_s: float = DURABILITY_RECHECK_S,
        hold_ends: bool = True,
    ) -> None:
        super().__init__(timeout_ms=timeout_ms, on_wait=on_wait)
        self.holds_ends = hold_ends
        self.spec = spec
        self.states: dict[str, ServerState] = {}
        """What the last detection found, by node name (``""``: one Redis)."""
        self.on_detected: Callable[[], Awaitable[None]] | None = None
        self._redis = redis
        self._primaries: frozenset[str] | None = None
        """The primaries the last detection read (``primaries_of``)."""
        self._recheck_s = recheck_s
        self._again = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._reports: set[asyncio.Task[None]] = set()

    def resolve(self, state: ServerState) -> EndWait:
        """What an end on a primary in ``state`` waits for, under ``spec``."""
        replicas = len(state.replicas) if self.spec.replicas is None else self.spec.replicas
        return EndWait(replicas, self.spec.fsync and state.aof and state.waitaof, self.timeout_ms)

    async def detect(self) -> None:
        """Read every primary's state now and resolve its wait (``off``: reads nothing)."""
        if self.spec.off:
            self.states = {}
            self.set_waits(NO_WAIT)
            return
        redis = self._redis
        self._primaries = primaries_of(redis)
        if isinstance(redis, RedisCluster):
            primaries = redis.get_primaries()
            try:
                found = await asyncio.gather(*(_detect_node(node) for node in primaries))
            except (RedisConnectionError, RedisTimeoutError, OSError):
                # A primary away (failed over?): the slot map read again now, as a send that
                # meets a node away does. The client may have no other traffic that would,
                # and a dead primary it still lists would fail every detection.
                with contextlib.suppress(Exception):
                    await refresh_slot_map(redis)
                raise
            self.states = {node.name: state for node, state in zip(primaries, found, strict=True)}
            nodes = {name: self.resolve(state) for name, state in self.states.items()}
            self.set_waits(_strictest(nodes.values(), self.timeout_ms), nodes)
        else:
            state = await detect(redis.execute_command)
            self.states = {"": state}
            self.set_waits(self.resolve(state))

    def describe(self) -> str:
        """What each end waits for, in words (the start-up log line)."""
        if self.spec.off:
            return "off: ends are told as soon as the primary acknowledges them"
        timeout = f"at most {self.timeout_ms / 1000:g}s"
        lines = []
        for node, state in sorted(self.states.items()):
            wait = self.wait(node)
            where = f"primary {node}: " if node else ""
            if wait.waits:
                text = f"{where}each end waits for {wait}, {timeout}"
            else:
                durable = "AOF" if state.aof else "memory (AOF off)"
                text = f"{where}no replica: ends are as durable as the primary's {durable}"
            if self.spec.fsync and not wait.fsync:
                reason = state.waitaof_note if not state.waitaof else "AOF is off (appendonly no)"
                text += f"; fsync=local asked, but {reason}: no fsync wait"
            lines.append(text)
        return "; ".join(lines)

    def start(self) -> None:
        """Detect again every ``recheck_s`` (and at once after ``recheck()``) on the running loop."""
        self._task = asyncio.get_running_loop().create_task(self._recheck_forever(), name="durability-check")

    def recheck(self) -> None:
        self._again.set()

    async def close(self) -> None:
        await stop_task(self._task)
        self._task = None
        for task in list(self._reports):
            await stop_task(task)

    async def check(self) -> None:
        """Detect, then tell ``on_detected``; a failure is logged (the waits known stay), and
        so is a change of what ends wait for."""
        before = (self._default, self._nodes)
        try:
            await self.detect()
        except Exception as exc:  # Redis away, a shard failing over: the waits known stay
            logger.warning("durable ends: cannot read what the primary offers (%s); keeping the last", exc)
            return
        if (self._default, self._nodes) != before:
            logger.info("durable ends (%s) now: %s", self.spec, self.describe())
        if self.on_detected is not None:
            try:
                await self.on_detected()
            except Exception as exc:
                logger.warning("durable ends: cannot write %s: %s", DURABILITY_KEY, exc)

    async def fresh(self) -> None:
        """Detect now if the primaries are not those last read: after a failover the new
        primary's replicas (none, often) are what its ends wait for, not the old one's until
        the next ``recheck_s``: each end would wait out its bound for a replica not there.
        No I/O otherwise; once per change of primaries (``detect`` notes them first), and
        never longer than an end's bound (a primary that does not answer keeps the waits)."""
        if primaries_of(self._redis) != self._primaries:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.timeout_ms / 1000):
                    await self.check()

    async def _recheck_forever(self) -> None:
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._again.wait(), self._recheck_s)
            self._again.clear()
            await self.check()

    def holding(self, node: str) -> None:
        """Read the primary again before the held end's next confirmation: a replica it
        dropped is waited for no more."""
        self.recheck()

    def shortfall_began(self, shortfall: Shortfall, what: str, node: str) -> None:
        """Read the primary again at once (a replica gone is waited for no more), and log the
        shortfall with its replicas' lag."""
        task = asyncio.get_running_loop().create_task(self._report(shortfall, what, node), name="durability-report")
        self._reports.add(task)
        task.add_done_callback(self._reports.discard)

    async def _report(self, shortfall: Shortfall, what: str, node: str) -> None:
        await self.check()
        state = self.states.get(node)
        lags = f"{'?' if state is None else state.lags()}; now waiting for {self.wait(node)}"
        logger.warning("durable ends: %s", _shortfall_text(shortfall, what, node, held=self.held(what), lags=lags))


# --- the record workers write and producers read ------------------------------------------


def record(spec: DurabilitySpec, control: Durability, data: Durability) -> bytes:
    """``DURABILITY_KEY``'s value: what an end waits for on the control plane and on the
    data plane (``nodes``: each cluster primary's, by node name), as a worker resolved them."""
    return json.dumps(
        {
            "v": RECORD_VERSION,
            "spec": str(spec),
            "timeout_ms": data.timeout_ms,
            "control": _wait_fields(control.wait()),
            "data": _wait_fields(data.wait()),
            "nodes": {node: _wait_fields(wait) for node, wait in sorted(data.node_waits().items())},
        },
        separators=(",", ":"),
    ).encode()


def _wait_fields(wait: EndWait) -> dict[str, Any]:
    return {"replicas": wait.replicas, "fsync": wait.fsync}


async def write_record(control: Redis, spec: DurabilitySpec, control_waits: Durability, data: Durability) -> None:
    """Write ``record(...)`` to ``DURABILITY_KEY``, kept ``DURABILITY_TTL_MS``."""
    await control.set(DURABILITY_KEY, record(spec, control_waits, data), px=DURABILITY_TTL_MS)


class PublishedDurability(Durability):
    """A producer's (or gateway's) waits on ``plane`` (``control`` or ``data``), from the
    record workers write to ``DURABILITY_KEY`` on ``control``, read at most every
    ``fresh_s`` (``fresh``). No record (no worker, or one that predates it): no wait."""

    def __init__(
        self,
        control: Redis,
        plane: str = "data",
        *,
        fresh_s: float = DURABILITY_RECHECK_S,
        on_wait: WaitHook | None = None,
    ) -> None:
        if plane not in ("control", "data"):
            raise ValueError(f"plane must be control or data, not {plane!r}")
        super().__init__(timeout_ms=0, on_wait=on_wait)
        self.plane = plane
        self._control = control
        self._fresh_s = fresh_s
        self._read_at = float("-inf")

    async def fresh(self) -> None:
        now = time.monotonic()
        if now - self._read_at < self._fresh_s:
            return
        self._read_at = now
        try:
            raw = await self._control.get(DURABILITY_KEY)
        except Exception as exc:  # no permission, Redis away: the waits known stay
            logger.debug("durable ends: cannot read %s: %s", DURABILITY_KEY, exc)
            return
        self.apply(raw)

    def apply(self, raw: bytes | str | None) -> None:
        """Take the waits of ``plane`` from a record (``None``: none)."""
        if raw is None:
            self.set_waits(NO_WAIT)
            return
        try:
            fields = json.loads(raw)
            timeout_ms = int(fields["timeout_ms"])
            self.timeout_ms = timeout_ms
            default = _wait_of(fields[self.plane], timeout_ms)
            nodes = fields.get("nodes", {}) if self.plane == "data" else {}
            self.set_waits(default, {node: _wait_of(wait, timeout_ms) for node, wait in nodes.items()})
        except (ValueError, KeyError, TypeError) as exc:
            logger.warning(
                "durable ends: %s is not a record this client reads (%s); keeping the last", DURABILITY_KEY, exc
            )


def _wait_of(fields: Mapping[str, Any], timeout_ms: int) -> EndWait:
    return EndWait(int(fields["replicas"]), bool(fields["fsync"]), timeout_ms)
