"""``redis+cluster://`` URLs and the cluster client's start-up: a whole cluster connects; no
answering seed, a Redis without cluster mode, and unserved slots each fail at once with an
error that says which. Real servers (``devkit.redis_cluster``)."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import time
from collections.abc import Iterator

import pytest
import redis

from devkit.redis_cluster import RedisCluster
from devkit.redis_server import RedisServer, free_port
from streamq.broker.cluster import (
    ClusterUnusable,
    connect_cluster,
    is_cluster_url,
    parse_cluster_url,
    refresh_slot_map,
)


@pytest.fixture(scope="module")
def cluster() -> Iterator[RedisCluster]:
    with RedisCluster(primaries=3) as cluster:
        yield cluster


def test_a_cluster_url_names_seeds_credentials_and_tls() -> None:
    plain = parse_cluster_url("redis+cluster://app:s%40cret@10.0.0.1:7000,10.0.0.2,[::1]:7002")
    assert plain.seeds == (("10.0.0.1", 7000), ("10.0.0.2", 6379), ("::1", 7002))
    assert (plain.username, plain.password, plain.tls) == ("app", "s@cret", {"ssl": False})
    secure = parse_cluster_url("rediss+cluster://node:7000?ssl_ca_certs=/etc/ca.pem")
    assert secure.tls["ssl"] and secure.tls["ssl_cert_reqs"] == "required" and secure.tls["ssl_check_hostname"]
    assert secure.tls["ssl_ca_certs"] == "/etc/ca.pem"
    assert is_cluster_url("redis+cluster://a:1") and not is_cluster_url("redis://a:1")


@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("redis://app:pw@host:7000", "a cluster URL starts with redis\\+cluster:// or rediss\\+cluster://"),
        ("redis+cluster://app:pw@host:7000/3", "only database 0"),
        ("redis+cluster://app:pw@host:7000,,host2:7001", "address is empty"),
        ("redis+cluster://app:pw@host:70x0", "no valid port"),
    ],
)
def test_a_malformed_cluster_url_is_refused_without_showing_its_password(url: str, says: str) -> None:
    with pytest.raises(ValueError, match=says) as refused:
        parse_cluster_url(url)
    assert "pw" not in str(refused.value)


async def test_a_whole_cluster_connects_and_routes_keys_to_their_shards(cluster: RedisCluster) -> None:
    client = await connect_cluster(cluster.url)
    try:
        for i in range(30):
            await client.set(f"streamq:owner:{{r{i}}}", i)
        assert [await client.get(f"streamq:owner:{{r{i}}}") for i in range(30)] == [b"%d" % i for i in range(30)]
        assert len({cluster.primary_of(f"streamq:owner:{{r{i}}}").port for i in range(30)}) == 3
    finally:
        await client.aclose()


async def test_no_answering_seed_is_an_error_that_names_the_seeds() -> None:
    ports = [free_port(), free_port()]
    url = "redis+cluster://app:pw@" + ",".join(f"127.0.0.1:{port}" for port in ports)
    started = time.monotonic()
    with pytest.raises(ClusterUnusable, match="no seed node answered") as refused:
        await connect_cluster(url)
    assert all(f"127.0.0.1:{port}" in str(refused.value) for port in ports)
    assert "pw" not in str(refused.value).replace("app:***", "")
    assert time.monotonic() - started < 30  # refused connections: no hang


async def test_a_redis_without_cluster_mode_is_named_as_such() -> None:
    with RedisServer() as server, pytest.raises(ClusterUnusable, match="without cluster mode"):
        await connect_cluster(f"redis+cluster://127.0.0.1:{server.port}")


async def test_slots_without_a_primary_are_refused_at_start_up() -> None:
    with RedisCluster(primaries=2) as cluster:
        first = cluster.nodes[0]
        client = redis.Redis(port=first.port)
        try:
            client.execute_command("CLUSTER", "DELSLOTSRANGE", 0, 8191)  # its half, as it sees the cluster now
        finally:
            client.close()
        with pytest.raises(ClusterUnusable, match="serves 8192 of 16384 hash slots"):
            await connect_cluster(f"redis+cluster://127.0.0.1:{first.port}")


async def test_the_client_keeps_its_seeds_through_a_dead_node_and_concurrent_commands() -> None:
    """redis-py drops a node from its seeds at each connection error, the healthy ones too
    when its resets cut their commands off: with one node dead and commands in flight from a
    few tasks, it ran out of seeds within a second and could never read the slot map again.
    The URL's seeds come back, and the live shards keep answering; no connection is left open
    for the garbage collector (this test's ``gc.collect()``, under the suite's warnings-as-errors)."""
    with RedisCluster(primaries=3) as three:
        client = await connect_cluster(three.url)
        try:
            keys = [f"streamq:owner:{{k{i}}}" for i in range(30)]
            for key in keys:
                await client.set(key, "1")
            dead = three.primary_of(keys[0])
            three.kill(dead)
            live = [key for key in keys if three.primary_of(key) is not dead]

            async def hammer(which: list[str]) -> None:
                for _ in range(8):
                    for key in which:
                        with contextlib.suppress(Exception):  # the dead shard's keys, commands cut off
                            await client.get(key)

            await asyncio.gather(hammer(keys), hammer(keys[::-1]), hammer(keys[::2]))
            assert client.nodes_manager.startup_nodes  # redis-py alone ends with none
            await client.initialize()
            assert [await client.get(key) for key in live] == [b"1"] * len(live)
        finally:
            await client.aclose()
            gc.collect()  # a connection left open would warn here (ResourceWarning), failing this test


async def test_a_node_replaced_by_a_reading_of_the_map_is_closed_even_if_a_command_reopens_it(
    cluster: RedisCluster,
) -> None:
    """Each reading of the slot map replaces the node objects. A command still holding an old
    one (a straggler) connects it again; that connection is closed at the next reading of the
    map and, at the latest, with the client: no socket left for the garbage collector."""
    client = await connect_cluster(cluster.url)
    old = client.get_node_from_key("streamq:owner:{0}:a")

    def connected() -> bool:
        return any(connection.is_connected for connection in old._connections)

    async def closed_soon() -> bool:
        """Whether the replaced node's connections close within a second (a task closes them)."""
        for _ in range(100):
            if not connected():
                return True
            await asyncio.sleep(0.01)
        return False

    try:
        assert await old.execute_command("PING")
        await refresh_slot_map(client)
        assert client.get_node_from_key("streamq:owner:{0}:a") is not old
        assert await closed_soon()
        assert await old.execute_command("PING")  # the straggler connects the replaced node again
        assert connected()
        await refresh_slot_map(client)
        assert await closed_soon()
        assert await old.execute_command("PING")
        assert connected()
    finally:
        await client.aclose()
    assert not connected()
