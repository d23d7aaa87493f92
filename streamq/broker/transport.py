"""Commands packed by the caller, sent many to a write and their replies read in step: the
replay log's transport, one sender per Redis setup. Neither sender knows what a command means.

redis-py's asyncio packer copies its buffer again for every argument, which made packing the
worker's largest cost per event; so the replay log packs its own commands (RESP bytes:
``pack_command``, ``streamq.broker.append_packing``) and sends them here:

- ``OneRedisSender``: one Redis. Commands in one write on a connection of the client's pool;
  a script's calls sent again, once it is loaded, where Redis forgot it.
- ``ClusterSender``: a Redis Cluster. Each call to its slot's primary, the calls of one primary
  in one write, all primaries at once; a call redirected (``MOVED``, ``ASK``), asked to try
  again (``TRYAGAIN``: a slot moving) or refused for a script the node forgot (``NOSCRIPT``,
  loaded then) is sent again, up to ``CLUSTER_ROUNDS`` times. What follows a primary's calls on
  its connection (an end's wait) and the check of its replies are the caller's.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Generic, TypeVar

from redis.asyncio import Redis
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.asyncio.connection import AbstractConnection, ConnectionPool
from redis.exceptions import (
    AskError,
    MovedError,
    NoScriptError,
    RedisClusterException,
    ResponseError,
    SlotNotCoveredError,
    TryAgainError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from streamq.broker.cluster import refresh_slot_map

W = TypeVar("W")

CLUSTER_GLITCHES = (RedisConnectionError, RedisTimeoutError, RedisClusterException, OSError, AttributeError)
"""What a cluster command may fail with while redis-py reads the slot map again (AttributeError:
a connection closed under a command being sent), or while a shard is away."""
CLUSTER_ROUNDS = 4
"""How many times a cluster send sends the calls a shard redirected (``MOVED``, ``ASK``), had
no script for, or asked to try again (``TRYAGAIN``: a slot moving) before it gives up with the
error, which the publisher retries as transient."""
MAP_REFRESH_S = 0.5
"""A cluster send that met a node away reads the slot map again at most this often."""

_ASKING = b"*1\r\n$6\r\nASKING\r\n"


def pack_command(*args: str | bytes | int | float) -> bytes:
    """One command as RESP (an array of bulk strings)."""
    encoded = [arg if isinstance(arg, bytes) else str(arg).encode() for arg in args]
    return b"*%d\r\n" % len(encoded) + b"".join(b"$%d\r\n%b\r\n" % (len(arg), arg) for arg in encoded)


def raise_first_error(replies: Sequence[Any]) -> list[Any]:
    """``replies``, unless one is an error reply: then the first is raised (as
    ``execute_command`` raises one command's)."""
    for reply in replies:
        if isinstance(reply, BaseException):
            raise reply
    return list(replies)


async def exchange(connection: AbstractConnection, commands: bytes, count: int) -> list[Any]:
    """Send ``commands`` in one write and read ``count`` replies, an error reply as its
    ``ResponseError``; a connection cut off mid-way is disconnected (not reusable) and
    the error raised."""
    try:
        await connection.send_packed_command(commands)
        replies: list[Any] = []
        for _ in range(count):
            try:
                replies.append(await connection.read_response())
            except ResponseError as error:
                replies.append(error)
    except BaseException:
        await connection.disconnect()
        raise
    return replies


class OneRedisSender:
    """Packed commands on one Redis, on connections of ``redis``'s pool."""

    def __init__(self, redis: Redis) -> None:
        if redis.single_connection_client:
            raise ValueError("the replay log needs a pooled client (single_connection_client=False)")
        self._redis = redis
        self._pool: ConnectionPool = redis.connection_pool

    async def send(self, commands: bytes, count: int) -> list[Any]:
        """The ``count`` replies to ``commands`` (RESP, back to back), sent in one write on
        one connection, every reply read before the connection goes back (so it stays in
        step); an error reply is its exception, in its place."""
        connection = await self._connection()
        try:
            return await exchange(connection, commands, count)
        finally:
            await self._pool.release(connection)

    async def send_script(self, script_text: str, commands: bytes, count: int) -> list[Any]:
        """``send``, ``commands`` starting with ``EVALSHA`` of ``script_text``: a Redis that forgot
        the script (a restart, a ``SCRIPT FLUSH``: every call of it refused, none ran) gets it
        loaded, and all of ``commands`` sent again."""
        replies = await self.send(commands, count)
        if isinstance(replies[0], NoScriptError):
            await self._redis.script_load(script_text)
            replies = await self.send(commands, count)
        return replies

    async def _connection(self) -> AbstractConnection:
        connection: AbstractConnection
        try:
            connection = await self._pool.get_connection()
        except TypeError:  # redis-py before 5.3 wants the command's name
            connection = await self._pool.get_connection("EVALSHA")
        return connection


@dataclass(frozen=True)
class ClusterCall(Generic[W]):
    """One packed command of a cluster send: a key of its slot, what it carries (``of``: the
    caller's, handed back with its reply), and, after an ``ASK``, the node to ask."""

    key: str
    command: bytes
    of: W
    asking: tuple[str, int] | None = None


@dataclass(frozen=True)
class NodeReplies(Generic[W]):
    """What one primary answered to its calls of a cluster send: per call its reply (an error
    reply, or the node's connection error, as an exception), and the replies to what followed."""

    node: ClusterNode | None
    """``None``: the calls whose slot no node serves."""
    calls: list[ClusterCall[W]]
    replies: list[Any]
    tail: bytes = b""
    """What was sent after the calls on the same connection (an end's wait)."""
    tail_replies: list[Any] = field(default_factory=list)
    """The replies to ``tail`` (none when the node could not be reached)."""
    seconds: float = 0.0
    """From the send to the last reply."""


class SendAgain(Exception):
    """Raised by a ``ClusterSender.send`` check: this node's calls are sent again (a primary
    demoted under the connection, say)."""


@dataclass(frozen=True)
class Tail:
    """What a cluster send writes after each primary's calls, and how it reads the replies."""

    packed: Callable[[ClusterNode], tuple[bytes, int]]
    """The commands for a node (RESP) and how many replies they get."""
    check: Callable[[NodeReplies[Any]], BaseException | None]
    """Called with a node's replies before its calls' are read: ``None`` to read them, an
    error to fail each call with; raises ``SendAgain`` to send them again."""


class ClusterSender:
    """Packed commands on a Redis Cluster, each to its slot's primary."""

    def __init__(self, cluster: RedisCluster) -> None:
        self._cluster = cluster
        self._refreshed_at = float("-inf")

    async def send(
        self, calls: Sequence[ClusterCall[W]], script_text: str | None = None, tail: Tail | None = None
    ) -> tuple[list[tuple[ClusterCall[W], Any]], list[tuple[ClusterCall[W], BaseException]]]:
        """Each call to its slot's primary, the calls of one primary in one write (``tail``'s
        commands after them), all primaries at once; each call's redirect or missing script
        (``script_text`` loaded) dealt with and that call sent again, up to ``CLUSTER_ROUNDS``
        times. Returns the calls answered, with their replies, and those that failed, with
        their errors."""
        cluster = self._cluster
        answered: list[tuple[ClusterCall[W], Any]] = []
        errors: list[tuple[ClusterCall[W], BaseException]] = []
        with contextlib.suppress(*CLUSTER_GLITCHES):  # a no-op once connected; failing, the map it has
            await cluster.initialize()
        for round_ in range(CLUSTER_ROUNDS):
            again: list[ClusterCall[W]] = []
            for sent in await self._send_by_node(calls, tail):
                node, replies = sent.node, sent.replies
                if tail is not None and node is not None and sent.tail_replies:
                    try:
                        failed = tail.check(sent)
                    except SendAgain:
                        again += [replace(call, asking=None) for call in sent.calls]
                        continue
                    if failed is not None:
                        errors += [(call, failed) for call in sent.calls]
                        continue
                for call, reply in zip(sent.calls, replies, strict=True):
                    if not isinstance(reply, BaseException):
                        answered.append((call, reply))
                    elif isinstance(reply, AskError):
                        again.append(replace(call, asking=(reply.host, reply.port)))
                    elif isinstance(reply, (MovedError, NoScriptError, TryAgainError)):
                        again.append(replace(call, asking=None))
                    else:
                        errors.append((call, reply))
                if script_text and node is not None and any(isinstance(r, NoScriptError) for r in replies):
                    await node.execute_command("SCRIPT", "LOAD", script_text)
            if not again:
                break
            if any(not call.asking for call in again):
                await refresh_slot_map(cluster)  # a slot moved: read the map again
            calls = again
            if round_ + 1 == CLUSTER_ROUNDS:
                error = TryAgainError(f"still redirected after {CLUSTER_ROUNDS} tries")
                errors += [(call, error) for call in again]
            else:
                await asyncio.sleep(0.05 * round_)
        if any(not isinstance(error, ResponseError) for _, error in errors) and self._may_refresh():
            with contextlib.suppress(Exception):  # a node away (failing over?): read the map again
                await refresh_slot_map(cluster)
        return answered, errors

    def _may_refresh(self) -> bool:
        """True at most once per ``MAP_REFRESH_S``: reading the slot map closes every
        connection, so a shard that stays away must not have it read at every send."""
        now = time.monotonic()
        if now - self._refreshed_at < MAP_REFRESH_S:
            return False
        self._refreshed_at = now
        return True

    async def _send_by_node(self, calls: Sequence[ClusterCall[W]], tail: Tail | None) -> list[NodeReplies[W]]:
        """Each node's calls sent in one write (an ``ASK``ed call after ``ASKING``), then
        ``tail``'s commands for the node, all nodes at once; per node its calls and replies."""
        cluster = self._cluster
        by_node: dict[str, tuple[ClusterNode, list[ClusterCall[W]]]] = {}
        uncovered: list[ClusterCall[W]] = []
        for call in calls:
            if call.asking is None:
                try:
                    owner = cluster.get_node_from_key(call.key)
                except SlotNotCoveredError:
                    owner = None
                if owner is None:
                    uncovered.append(call)
                    continue
                node = owner
            else:
                host, port = call.asking
                node = cluster.get_node(host, port) or ClusterNode(
                    host, port, **cluster.nodes_manager.connection_kwargs
                )
            by_node.setdefault(node.name, (node, []))[1].append(call)

        async def send(node: ClusterNode, node_calls: list[ClusterCall[W]]) -> NodeReplies[W]:
            after, after_count = tail.packed(node) if tail is not None else (b"", 0)
            command = b"".join(_ASKING + call.command if call.asking else call.command for call in node_calls)
            count = sum(2 if call.asking else 1 for call in node_calls)
            started = time.perf_counter()
            connection = node.acquire_connection()
            try:
                replies = await exchange(connection, command + after, count + after_count)
            except Exception as error:  # the node is away: every call of it failed so
                return NodeReplies(node, node_calls, [error] * len(node_calls), after)
            finally:
                node._free.append(connection)  # ClusterNode's own release (it has no public one)
            answers, out = iter(replies[:count]), []
            for call in node_calls:
                if call.asking:
                    next(answers)  # ASKING's own OK, just before the call's reply
                out.append(next(answers))
            return NodeReplies(node, node_calls, out, after, replies[count:], time.perf_counter() - started)

        sent = list(by_node.values())
        # an ASK's importing node that the map does not name yet is this send's own: closed after
        passing = [node for node, _ in sent if cluster.get_node(node_name=node.name) is not node]
        try:
            answered = list(await asyncio.gather(*(send(node, node_calls) for node, node_calls in sent)))
        finally:
            await asyncio.gather(*(node.disconnect() for node in passing), return_exceptions=True)
        if uncovered:
            error = SlotNotCoveredError("no primary serves the slot (a shard down?)")
            answered.append(NodeReplies(None, uncovered, [error] * len(uncovered)))
        return answered
