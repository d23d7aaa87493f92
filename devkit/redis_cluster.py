"""A throwaway Redis Cluster on loopback, for the tests and the benchmarks.

``RedisCluster`` starts ``primaries`` cluster-mode servers (``devkit.redis_server``), each
with ``replicas_per_primary`` replicas, splits the 16,384 hash slots evenly among the
primaries, and waits until every node reports the cluster ``ok`` with the same slot map,
as ``redis-cli --cluster create`` does, but with the commands themselves (``CLUSTER
ADDSLOTSRANGE``, ``MEET``, ``REPLICATE``), so no CLI binary is needed. For fault tests:
SIGKILL a node (``kill``) and wait for its replica to take over (``wait_for_primary``), or
move a slot and its keys to another primary (``migrate_slot``), as ``redis-cli --cluster
reshard`` does.

``python -m devkit.redis_cluster`` runs one in the foreground and prints its URL.
"""

from __future__ import annotations

import argparse
import contextlib
import signal
import sys
import time
from collections.abc import Callable, Iterator
from types import TracebackType
from typing import Any

import redis

from devkit.redis_server import RedisServer, free_ports

SLOTS = 16384
NODE_TIMEOUT_MS = 1000
"""How long a node may be silent before its peers call it failed: short, so that a test's
failover takes seconds (a production cluster uses 15 s)."""


class RedisCluster:
    """``primaries`` shards on loopback, each with ``replicas_per_primary`` replicas."""

    def __init__(
        self,
        primaries: int = 3,
        replicas_per_primary: int = 0,
        *,
        node_timeout_ms: int = NODE_TIMEOUT_MS,
        persistent: bool = False,
    ) -> None:
        if primaries < 1 or replicas_per_primary < 0:
            raise ValueError("a cluster needs at least one primary and no negative replica count")
        count = primaries * (1 + replicas_per_primary)
        ports = free_ports(2 * count)  # each node's and its bus's, all different
        self.nodes = [
            RedisServer(
                ports[2 * i],
                cluster_node_timeout_ms=node_timeout_ms,
                cluster_bus_port=ports[2 * i + 1],
                persistent=persistent,
            )
            for i in range(count)
        ]
        self._primaries = primaries
        self._ids: dict[int, str] = {}
        """Node id by port, as each node named itself."""

    @property
    def url(self) -> str:
        """``redis+cluster://`` with every node as a seed."""
        return "redis+cluster://" + ",".join(f"127.0.0.1:{node.port}" for node in self.nodes)

    @property
    def seeds(self) -> list[tuple[str, int]]:
        return [("127.0.0.1", node.port) for node in self.nodes]

    def start(self, timeout_s: float = 30.0) -> RedisCluster:
        for node in self.nodes:
            node.start()
        first_primaries = self.nodes[: self._primaries]
        for index, node in enumerate(first_primaries):
            low = index * SLOTS // self._primaries
            high = (index + 1) * SLOTS // self._primaries - 1
            with _client(node.port) as client:
                self._ids[node.port] = client.execute_command("CLUSTER", "MYID").decode()
                client.execute_command("CLUSTER", "ADDSLOTSRANGE", low, high)
        for node in self.nodes[self._primaries :]:
            with _client(node.port) as client:
                self._ids[node.port] = client.execute_command("CLUSTER", "MYID").decode()
        for node in self.nodes[1:]:
            with _client(node.port) as client:
                client.execute_command(
                    "CLUSTER", "MEET", "127.0.0.1", self.nodes[0].port, self.nodes[0].cluster_bus_port
                )
        deadline = time.monotonic() + timeout_s
        _poll(lambda: all(len(self._known_ids(node.port)) == len(self.nodes) for node in self.nodes), deadline)
        for index, node in enumerate(self.nodes[self._primaries :]):
            primary = first_primaries[index % self._primaries]
            with _client(node.port) as client:
                client.execute_command("CLUSTER", "REPLICATE", self._ids[primary.port])
        replicas = len(self.nodes) - self._primaries
        _poll(
            lambda: (
                all(self._replicating(node.port) for node in self.nodes[self._primaries :])
                and all(len(self._replica_lines(node.port)) == replicas for node in self.nodes)
            ),
            deadline,
            what="every replica to be in sync and known to every node",
        )
        self.wait_ok(timeout_s=max(1.0, deadline - time.monotonic()))
        return self

    def wait_ok(self, timeout_s: float = 30.0) -> None:
        """Until every live node says the cluster is ``ok`` and all agree on who serves each slot."""
        deadline = time.monotonic() + timeout_s
        _poll(self._agreed, deadline, what="the cluster to agree that it is ok")

    def _agreed(self) -> bool:
        live = [node for node in self.nodes if node.process is not None]
        maps = set()
        for node in live:
            with _client(node.port) as client:
                info = client.execute_command("CLUSTER", "INFO").decode()
                if "cluster_state:ok" not in info:
                    return False
                maps.add(_slot_map(client))
        return len(maps) == 1

    def _replicating(self, port: int) -> bool:
        with _client(port) as client:
            info: dict[str, Any] = client.info("replication")  # type: ignore[assignment]
        return info.get("master_link_status") == "up"

    def _replica_lines(self, port: int) -> list[list[str]]:
        """The replicas in ``port``'s ``CLUSTER NODES``, each split into its fields."""
        return [fields for fields in _cluster_nodes(port) if "slave" in fields[2].split(",")]

    def _known_ids(self, port: int) -> set[str]:
        return {fields[0] for fields in _cluster_nodes(port)}

    def primary_ports(self) -> list[int]:
        """The ports of the nodes serving slots now, in slot order."""
        return list(dict.fromkeys(port for _, _, port in sorted(self.slot_ranges())))

    def slot_ranges(self) -> list[tuple[int, int, int]]:
        """``(first slot, last slot, primary's port)`` for each range, as a live node sees them."""
        return [(int(low), int(high), int(primary[1])) for low, high, primary, *_ in self._slots()]

    def _slots(self) -> list[list[Any]]:
        node = next(node for node in self.nodes if node.process is not None)
        with _client(node.port) as client:
            return _cluster_slots(client)

    def node(self, port: int) -> RedisServer:
        return next(node for node in self.nodes if node.port == port)

    def slot_of(self, key: str) -> int:
        node = next(node for node in self.nodes if node.process is not None)
        with _client(node.port) as client:
            return int(client.execute_command("CLUSTER", "KEYSLOT", key))

    def primary_of(self, key: str) -> RedisServer:
        """The node serving ``key``'s slot now."""
        slot = self.slot_of(key)
        port = next(p for low, high, p in self.slot_ranges() if low <= slot <= high)
        return self.node(port)

    def replicas_of(self, primary: RedisServer) -> list[RedisServer]:
        """The nodes that replicate ``primary`` now."""
        node_id = self._ids[primary.port]
        ports = {
            int(fields[1].split(":")[1].split("@")[0])
            for fields in self._replica_lines(primary.port)
            if fields[3] == node_id
        }
        return [node for node in self.nodes if node.port in ports]

    def kill(self, node: RedisServer) -> None:
        """SIGKILL ``node``: its peers learn it only by its silence."""
        node.kill()

    def wait_for_primary(self, replica: RedisServer, timeout_s: float = 30.0) -> None:
        """Until ``replica`` serves slots (its primary failed over to it) and the cluster is ok."""
        deadline = time.monotonic() + timeout_s
        _poll(lambda: replica.port in self.primary_ports(), deadline, what=f"node {replica.port} to be promoted")
        self.wait_ok(timeout_s=max(1.0, deadline - time.monotonic()))

    def migrate_slot(self, slot: int, target: RedisServer) -> None:
        """Move ``slot`` and its keys to the primary ``target``, as ``redis-cli --cluster
        reshard`` does: IMPORTING at the target, MIGRATING at the source, MIGRATE the keys a
        batch at a time (meanwhile a command for a moved key gets ``ASK``), then NODE on
        every primary (from then on ``MOVED``)."""
        source = next(self.node(p) for low, high, p in self.slot_ranges() if low <= slot <= high)
        if source.port == target.port:
            raise ValueError(f"slot {slot} is already served by {target.port}")
        target_id, source_id = self._ids[target.port], self._ids[source.port]
        with _client(target.port) as to, _client(source.port) as source_client:
            to.execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", source_id)
            source_client.execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", target_id)
            while keys := source_client.execute_command("CLUSTER", "GETKEYSINSLOT", slot, 100):
                source_client.execute_command("MIGRATE", "127.0.0.1", target.port, "", 0, 5000, "KEYS", *keys)
        for port in self.primary_ports():
            with _client(port) as client:
                client.execute_command("CLUSTER", "SETSLOT", slot, "NODE", target_id)
        self.wait_ok()

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()

    def __enter__(self) -> RedisCluster:
        try:
            return self.start()
        except BaseException:
            self.close()
            raise

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def close(self) -> None:
        for node in self.nodes:
            node.__exit__(None, None, None)


@contextlib.contextmanager
def _client(port: int) -> Iterator[redis.Redis]:
    client = redis.Redis(port=port, socket_timeout=5)
    try:
        yield client
    finally:
        client.close()


def _cluster_nodes(port: int) -> list[list[str]]:
    """``CLUSTER NODES`` as ``port`` sees the cluster, a node per line split into its fields."""
    with _client(port) as client:
        return [line.split() for line in client.execute_command("CLUSTER", "NODES").decode().splitlines()]


def _slot_map(client: redis.Redis) -> tuple[tuple[int, int, int], ...]:
    return tuple(sorted((int(low), int(high), int(primary[1])) for low, high, primary, *_ in _cluster_slots(client)))


def _cluster_slots(client: redis.Redis) -> list[list[Any]]:
    """``CLUSTER SLOTS`` as Redis sends it: ``[low, high, [host, port, id], replicas...]``."""
    return client.execute_command("CLUSTER SLOTS", NEVER_DECODE=True)  # type: ignore[no-any-return]


def _poll(ready: Callable[[], bool], deadline: float, what: str = "the cluster") -> None:
    while True:
        with contextlib.suppress(redis.ConnectionError, redis.ResponseError, redis.TimeoutError):
            if ready():
                return
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out waiting for {what}")
        time.sleep(0.1)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m devkit.redis_cluster", description=__doc__.split("\n\n")[0])
    parser.add_argument("--primaries", type=int, default=3)
    parser.add_argument("--replicas", type=int, default=0, help="replicas per primary")
    args = parser.parse_args()
    # A SIGTERM (``timeout``, a service manager) unwinds like Ctrl-C, so the nodes are stopped.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    with RedisCluster(args.primaries, args.replicas) as cluster:
        print(cluster.url, flush=True)
        with contextlib.suppress(KeyboardInterrupt):
            while True:
                time.sleep(3600)


if __name__ == "__main__":
    main()
