"""The local Redis Cluster the cluster tests and benchmarks run on (``devkit.redis_cluster``):
it serves every slot over its shards, moves a slot with its keys, and fails over to a
replica when a primary is SIGKILLed, as a deployed cluster does. Real servers."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import redis
from redis.cluster import ClusterNode
from redis.cluster import RedisCluster as ClusterClient

from devkit.redis_cluster import RedisCluster


@pytest.fixture
def cluster() -> Iterator[RedisCluster]:
    with RedisCluster(primaries=3, replicas_per_primary=1) as cluster:
        yield cluster


def client_of(cluster: RedisCluster) -> ClusterClient:
    client: ClusterClient = ClusterClient(
        startup_nodes=[ClusterNode(host, port) for host, port in cluster.seeds], socket_timeout=5
    )
    return client


def test_every_slot_is_served_and_keys_spread_over_the_shards(cluster: RedisCluster) -> None:
    ranges = cluster.slot_ranges()
    assert sorted((low, high) for low, high, _ in ranges) == [(0, 5460), (5461, 10921), (10922, 16383)]
    assert len(cluster.primary_ports()) == 3
    assert all(len(cluster.replicas_of(cluster.node(port))) == 1 for port in cluster.primary_ports())
    client = client_of(cluster)
    try:
        for i in range(60):
            client.set(f"key:{{{i}}}", i)
        shards = {cluster.primary_of(f"key:{{{i}}}").port for i in range(60)}
        assert shards == set(cluster.primary_ports())
        assert [client.get(f"key:{{{i}}}") for i in range(60)] == [b"%d" % i for i in range(60)]
    finally:
        client.close()


def test_a_sharded_message_reaches_a_subscriber_at_the_slots_primary(cluster: RedisCluster) -> None:
    channel = "streamq:events:{sharded}"
    client = client_of(cluster)
    at_primary = redis.Redis(port=cluster.primary_of(channel).port, socket_timeout=5)
    pubsub = at_primary.pubsub()
    try:
        pubsub.ssubscribe(channel)
        received: list[object] = []
        deadline = time.monotonic() + 10
        while not received and time.monotonic() < deadline:
            assert client.spublish(channel, b"hello") in (0, 1)  # 0 until the subscription is in
            while (message := pubsub.get_message(timeout=0.2)) is not None:
                if message["type"] == "smessage":
                    received.append(message["data"])
        assert received[:1] == [b"hello"]
    finally:
        pubsub.close()
        at_primary.close()
        client.close()


def test_a_migrated_slot_takes_its_keys_to_the_new_primary(cluster: RedisCluster) -> None:
    key = "streamq:events:{moving}"
    client = client_of(cluster)
    try:
        client.xadd(key, {"event": b"first"}, id="0-1")
        source = cluster.primary_of(key)
        target = cluster.node(next(port for port in cluster.primary_ports() if port != source.port))
        cluster.migrate_slot(cluster.slot_of(key), target)
        assert cluster.primary_of(key).port == target.port
        client.xadd(key, {"event": b"second"}, id="0-2")  # the client follows MOVED
        entries: list[tuple[bytes, dict[bytes, bytes]]] = client.xrange(key)  # type: ignore[assignment]
        assert [fields[b"event"] for _, fields in entries] == [b"first", b"second"]
    finally:
        client.close()


def test_a_killed_primary_fails_over_to_its_replica_with_its_writes(cluster: RedisCluster) -> None:
    key = "streamq:owner:{failover}"
    client = client_of(cluster)
    try:
        client.set(key, "3")
        primary = cluster.primary_of(key)
        [replica] = cluster.replicas_of(primary)
        assert primary.port != replica.port
        with client.get_redis_connection(client.get_node_from_key(key)) as node_client:
            assert node_client.execute_command("WAIT", 1, 5000) == 1  # the write reached the replica
        started = time.monotonic()
        cluster.kill(primary)
        cluster.wait_for_primary(replica)
        assert time.monotonic() - started < 30
        assert cluster.primary_of(key).port == replica.port
    finally:
        client.close()
    after = client_of(cluster)  # a client that starts now finds the new map from the live seeds
    try:
        assert after.get(key) == b"3"
    finally:
        after.close()
