"""Reaching a Redis Cluster: ``redis+cluster://`` URLs, and a client that refuses, at
start-up and in words an operator can act on, anything that is not a whole cluster.

``redis+cluster://[user:password@]host:port[,host:port...]`` names seed nodes (any nodes of
the cluster: the client learns the rest from them); ``rediss+cluster://`` is the same over
TLS, with the certificate and host-name checks of ``rediss://`` and its query options
(``streamq.broker.tls``). A cluster has only database 0, so the URL names none.

The cluster carries the data plane (docs/redis-cluster.md); this module is its connection,
checked once: no seed answering, a seed that is a Redis without cluster mode, and slots that
no primary serves each fail ``connect_cluster`` with a ``ClusterUnusable`` that says so,
within the connect and reply timeouts, rather than a hang or redis-py's generic message.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any, Final
from urllib.parse import unquote, urlsplit

from redis._parsers.commands import AsyncCommandsParser
from redis.asyncio.cluster import ClusterNode, NodesManager, RedisCluster
from redis.asyncio.connection import AbstractConnection
from redis.exceptions import RedisClusterException, RedisError

from streamq.broker.connection import CONNECT_TIMEOUT_S, SOCKET_TIMEOUT_S, StreamqRedisSettings
from streamq.broker.tls import apply_tls_query
from streamq.environment import CLUSTER_SCHEMES
from streamq.environment import is_cluster_url as is_cluster_url  # re-exported
from streamq.redaction import redact_url

DEFAULT_PORT: Final = 6379
SLOTS: Final = 16384
FORGET_REPLACED_AFTER_S: Final = 60.0
"""A replaced node is closed again at each reading of the map for this long: no command
holds a node longer (a command's reply timeout and retries are well under it)."""


class ClusterUnusable(RedisError):
    """The URL does not lead to a whole Redis Cluster: nothing answered, a node is not in
    cluster mode, or some slots have no primary. A configuration error, not retried."""


@dataclass(frozen=True)
class ClusterURL:
    """What a ``redis+cluster://`` URL says."""

    seeds: tuple[tuple[str, int], ...]
    username: str | None
    password: str | None
    tls: dict[str, Any]
    """redis-py's ``ssl*`` keyword arguments (``ssl=False`` alone without TLS)."""


def parse_cluster_url(url: str) -> ClusterURL:
    """``url``'s seeds, credentials and TLS options; ``ValueError`` naming what is wrong."""
    scheme, sep, _ = url.partition("://")
    shown = redact_url(url)
    if not sep or scheme not in CLUSTER_SCHEMES:
        raise ValueError(f"{shown!r}: a cluster URL starts with {' or '.join(s + '://' for s in CLUSTER_SCHEMES)}")
    parts = urlsplit(url)
    if parts.path.strip("/") not in ("", "0"):
        raise ValueError(f"{shown!r}: a Redis Cluster has only database 0, so the URL names no other")
    credentials, at, hosts = parts.netloc.rpartition("@")
    username, _, password = credentials.partition(":") if at else ("", "", "")
    seeds: list[tuple[str, int]] = []
    for address in hosts.split(","):
        host, _, port = address.rpartition(":") if ":" in address else (address, "", "")
        if not host:
            raise ValueError(f"{shown!r}: a seed node's address is empty")
        if port and not port.isdigit():
            raise ValueError(f"{shown!r}: {address!r} has no valid port")
        seeds.append((host.strip("[]"), int(port) if port else DEFAULT_PORT))
    settings = StreamqRedisSettings(ssl=CLUSTER_SCHEMES[scheme])
    apply_tls_query(settings, url)
    tls: dict[str, Any] = {"ssl": settings.ssl}
    if settings.ssl:
        tls |= {
            name: getattr(settings, name)
            for name in ("ssl_keyfile", "ssl_certfile", "ssl_cert_reqs", "ssl_ca_certs", "ssl_check_hostname")
        }
    return ClusterURL(tuple(seeds), unquote(username) or None, unquote(password) or None, tls)


class _CommandTableOnce(AsyncCommandsParser):
    """redis-py's table of commands' key positions, read once per client: redis-py reads it
    again from the first primary at every reading of the slot map, so a dead first primary
    made every later command fail (``SeededCluster``)."""

    async def initialize(self, node: ClusterNode | None = None) -> None:
        if not self.commands:
            await super().initialize(node)


class _NodesClosedForGood(NodesManager):
    """redis-py's map of the cluster's nodes, which closes the nodes it replaces for good.

    Every reading of the slot map replaces every node object; redis-py closes the old ones'
    connections in tasks nobody holds or awaits. A command already under way on an old node
    (a flush sent as the map was read) connects it again, and nothing closes that
    connection any more: its socket stays open until the garbage collector finds it (a file
    descriptor per straggler for the life of a worker, and a ResourceWarning). Here the
    replaced nodes are kept: closed at once, their idle connections closed again at each later
    reading of the map and with the client, and forgotten once closed and
    ``FORGET_REPLACED_AFTER_S`` old."""

    __slots__ = ("_replaced", "_closing")

    def __init__(self, manager: NodesManager) -> None:
        super().__init__(
            list(manager.startup_nodes.values()),
            manager.require_full_coverage,
            manager.connection_kwargs,
            address_remap=manager.address_remap,
            event_dispatcher=manager._event_dispatcher,
        )
        self._replaced: dict[int, tuple[float, ClusterNode]] = {}
        self._closing: set[asyncio.Task[None]] = set()

    def set_nodes(self, old: dict[str, ClusterNode], new: dict[str, ClusterNode], remove_old: bool = False) -> None:
        """redis-py's: a node replaced or removed has all its connections closed at once (commands
        in flight on it fail once, as in redis-py); it is kept so that what a straggler opens on
        it later is closed too (``_close_idle``)."""
        now = time.monotonic()
        replaced = [old.pop(name) for name in list(old) if remove_old and name not in new]
        for name, node in new.items():
            previous = old.get(name)
            if previous is not None and previous is not node:  # by identity: nodes compare by name
                replaced.append(previous)
            old[name] = node
        for node in replaced:
            if id(node) not in self._replaced:
                self._replaced[id(node)] = (now, node)
                self._start(node.disconnect())
        self._close_idle(now)

    def _start(self, closing: Coroutine[Any, Any, Any]) -> None:
        task = asyncio.get_running_loop().create_task(closing)
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    def _idle_connections(self, now: float) -> list[AbstractConnection]:
        """The open connections of replaced nodes that no command holds now (a straggler's, once
        its command is done); replaced nodes named again, or closed and old, are forgotten."""
        current = {id(node) for node in (*self.nodes_cache.values(), *self.startup_nodes.values())}
        idle: list[AbstractConnection] = []
        for key, (since, node) in list(self._replaced.items()):
            if key in current:  # named again by a later reading of the map
                del self._replaced[key]
                continue
            idle += [connection for connection in node._free if connection.is_connected]
            if now - since > FORGET_REPLACED_AFTER_S and not any(c.is_connected for c in node._connections):
                del self._replaced[key]
        return idle

    def _close_idle(self, now: float) -> None:
        for connection in self._idle_connections(now):
            self._start(connection.disconnect())

    async def aclose(self, attr: str = "nodes_cache") -> None:
        """redis-py's, and the replaced nodes' idle connections closed too: redis-py also calls
        this at every connection error, so a command still under way keeps its connection."""
        await super().aclose(attr)
        idle = self._idle_connections(time.monotonic())
        await asyncio.gather(*(connection.disconnect() for connection in idle), *self._closing, return_exceptions=True)


class SeededCluster(RedisCluster):
    """redis-py's asyncio cluster client, which never runs out of seeds.

    On a connection error redis-py drops the node it was talking to from its seeds and
    closes every node's connections (``aclose``), which cuts off the commands then in flight
    to the other nodes, which drop theirs in turn: with one node dead and a few tasks sharing
    the client (a worker's), the seeds run out within a second, and the client can never read
    the slot map again ("cannot be connected ... : None"). So the seeds the URL named are put
    back before every reading of the map. And redis-py reads its table of commands again at
    each reading of the map, from the first primary, which may be the dead one: the table is
    read once (``_CommandTableOnce``). (Reading the map also replaces every node's object and
    closes the old ones' connections, for good: ``_NodesClosedForGood``; commands in flight
    then fail once, which the callers that must not fail retry: ``streamq.broker.replay_log``.)"""

    seeds: tuple[tuple[str, int], ...] = ()

    def restore_seeds(self) -> None:
        """Put the URL's seeds back among the nodes the client reads the slot map from."""
        manager = self.nodes_manager
        for host, port in self.seeds:
            if f"{host}:{port}" not in manager.startup_nodes:
                node = ClusterNode(host, port, **manager.connection_kwargs)
                manager.startup_nodes[node.name] = node

    async def initialize(self) -> SeededCluster:
        if self._initialize:  # redis-py's flag: the map is to be read (else this is a no-op, once per flush)
            self.restore_seeds()
        await super().initialize()
        return self  # redis-py's returns Any

    async def refresh_slot_map(self) -> None:
        """Read the slot map again now (a slot moved, a node is away)."""
        self.restore_seeds()
        await self.nodes_manager.initialize()


async def refresh_slot_map(cluster: RedisCluster) -> None:
    """Read ``cluster``'s slot map again now, from its URL's seeds too where it knows them."""
    if isinstance(cluster, SeededCluster):
        await cluster.refresh_slot_map()
    else:
        await cluster.nodes_manager.initialize()


def cluster_client(url: str) -> SeededCluster:
    """A client of the cluster ``url`` names, not connected yet: the connect and reply
    timeouts, keepalive and health checks of every streamq connection, every slot required."""
    address = parse_cluster_url(url)
    settings = StreamqRedisSettings()
    client: SeededCluster = SeededCluster(
        startup_nodes=[ClusterNode(host, port) for host, port in address.seeds],
        require_full_coverage=True,
        username=address.username,
        password=address.password,
        socket_connect_timeout=CONNECT_TIMEOUT_S,
        socket_timeout=SOCKET_TIMEOUT_S,
        socket_keepalive=settings.socket_keepalive,
        socket_keepalive_options=settings.socket_keepalive_options,
        health_check_interval=settings.health_check_interval,
        **address.tls,
    )
    client.seeds = address.seeds
    client.commands_parser = _CommandTableOnce()
    client.nodes_manager = _NodesClosedForGood(client.nodes_manager)
    return client


async def connect_cluster(url: str) -> SeededCluster:
    """``cluster_client(url)``, connected: it has read the slot map from a seed and every
    slot has a primary. ``ClusterUnusable`` otherwise, saying which of the three it is."""
    client = cluster_client(url)
    try:
        await client.initialize()
    except RedisClusterException as error:
        await client.aclose()
        raise _unusable(url, client, error) from error
    return client


def _unusable(url: str, client: RedisCluster, error: RedisClusterException) -> ClusterUnusable:
    """redis-py's start-up error, said for the operator who wrote ``url``."""
    shown, message = redact_url(url), str(error)
    seeds = ", ".join(f"{node.host}:{node.port}" for node in client.nodes_manager.startup_nodes.values())
    if "Cluster mode is not enabled" in message:
        return ClusterUnusable(
            f"{shown}: a seed ({seeds}) answered as a Redis without cluster mode (cluster_enabled:0); a "
            f"redis+cluster:// URL names nodes of a Redis Cluster (one Redis takes a redis:// URL)"
        )
    if message.startswith("All slots are not covered"):
        covered = message.split(". ", 1)[1].split(" of ")[0]
        return ClusterUnusable(
            f"{shown}: the cluster serves {covered} of {SLOTS} hash slots; every slot needs a primary "
            f"(redis-cli --cluster check shows which are missing, --cluster fix assigns them)"
        )
    cause = error.__cause__ or error
    return ClusterUnusable(f"{shown}: no seed node answered ({seeds}): {cause}")
