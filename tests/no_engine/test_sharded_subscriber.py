"""The producer's subscriber over Redis Cluster's sharded pub/sub: each channel followed at
its slot's primary, every message delivered once and in order, and a slot that moves (a
migration, a failover) followed to its new primary with a ``RESYNC``; a shard that stays
down fails only its own followers. Real servers (``devkit.redis_cluster``)."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator

import pytest
from redis.asyncio.cluster import RedisCluster as ClusterClient

from devkit.redis_cluster import RedisCluster
from producer.sharded_subscriber import ShardedEventSubscriber
from producer.subscriber import RESYNC, Inbox
from streamq.broker.cluster import connect_cluster
from streamq.protocol import events_channel


def channel_named(tag: str) -> str:
    """A request's channel, its id as the hash tag (the cluster's naming)."""
    return events_channel("{" + f"{tag}-{uuid.uuid4().hex}" + "}")


async def next_items(inbox: Inbox, count: int, timeout_s: float = 20.0) -> list[object]:
    async with asyncio.timeout(timeout_s):
        return [await inbox.get() for _ in range(count)]


async def spublish(client: ClusterClient, channel: str, data: bytes) -> int:
    """SPUBLISH at the primary that the client's slot map names (following MOVED)."""
    return int(await client.execute_command("SPUBLISH", channel, data))


async def published_until_delivered(client: ClusterClient, channel: str, inbox: Inbox) -> list[object]:
    """Publish numbered messages on ``channel`` until one reaches ``inbox``: what arrived,
    up to and including the first message (``RESYNC`` first, after a slot moved)."""
    items: list[object] = []
    async with asyncio.timeout(30):
        for n in range(10_000):
            await spublish(client, channel, b"after-%d" % n)
            while not inbox.empty():
                items.append(inbox.get_nowait())
            if any(isinstance(item, bytes) for item in items):
                return items
            await asyncio.sleep(0.1)
    raise AssertionError("never delivered")


@pytest.fixture
async def three_shards() -> AsyncIterator[RedisCluster]:
    with RedisCluster(primaries=3, replicas_per_primary=1) as cluster:
        yield cluster


@pytest.fixture
async def connected(three_shards: RedisCluster) -> AsyncIterator[tuple[ClusterClient, ShardedEventSubscriber]]:
    """A cluster client of ``three_shards`` and a subscriber over it."""
    client = await connect_cluster(three_shards.url)
    subscriber = ShardedEventSubscriber(client)
    try:
        yield client, subscriber
    finally:
        await subscriber.close()
        await client.aclose()


async def test_channels_on_every_shard_get_their_messages_once_and_in_order(
    three_shards: RedisCluster, connected: tuple[ClusterClient, ShardedEventSubscriber]
) -> None:
    client, subscriber = connected
    by_shard: dict[int, list[str]] = {port: [] for port in three_shards.primary_ports()}
    while min(len(names) for names in by_shard.values()) < 4:
        channel = channel_named("r")
        by_shard[three_shards.primary_of(channel).port].append(channel)
    channels = [channel for names in by_shard.values() for channel in names[:4]]  # 4 on each shard
    inboxes = [await subscriber.subscribe(c) for c in channels]
    second = await subscriber.subscribe(channels[0])  # two followers of one channel
    for n in range(50):
        for channel in channels:
            await spublish(client, channel, b"%d" % n)
    expected = [b"%d" % n for n in range(50)]
    for inbox in [*inboxes, second]:
        assert await next_items(inbox, 50) == expected
    await subscriber.unsubscribe(channels[1], inboxes[1])
    await spublish(client, channels[1], b"unheard")
    await spublish(client, channels[0], b"heard")
    assert await next_items(inboxes[0], 1) == [b"heard"]
    assert inboxes[1].empty()


async def test_a_migrated_slot_is_followed_to_its_new_primary(
    three_shards: RedisCluster, connected: tuple[ClusterClient, ShardedEventSubscriber]
) -> None:
    client, subscriber = connected
    channel = channel_named("moving")
    inbox = await subscriber.subscribe(channel)
    source = three_shards.primary_of(channel)
    target = three_shards.node(next(port for port in three_shards.primary_ports() if port != source.port))
    await asyncio.to_thread(three_shards.migrate_slot, three_shards.slot_of(channel), target)
    items = await published_until_delivered(client, channel, inbox)
    assert items[0] is RESYNC, items  # told to re-read the log before anything else
    assert all(item is RESYNC for item in items[:-1]) and isinstance(items[-1], bytes)


async def test_a_failover_is_followed_to_the_promoted_replica(
    three_shards: RedisCluster, connected: tuple[ClusterClient, ShardedEventSubscriber]
) -> None:
    client, subscriber = connected
    channel, elsewhere = channel_named("failing"), channel_named("steady")
    inbox = await subscriber.subscribe(channel)
    primary = three_shards.primary_of(channel)
    while three_shards.primary_of(elsewhere).port == primary.port:
        elsewhere = channel_named("steady")
    steady = await subscriber.subscribe(elsewhere)
    [replica] = three_shards.replicas_of(primary)
    three_shards.kill(primary)
    await asyncio.to_thread(three_shards.wait_for_primary, replica)
    items = await published_until_delivered(client, channel, inbox)
    assert items[0] is RESYNC and isinstance(items[-1], bytes), items
    await spublish(client, elsewhere, b"still here")
    assert (await next_items(steady, 1))[-1] == b"still here"


async def test_a_shard_down_for_good_fails_its_followers_and_no_others() -> None:
    with RedisCluster(primaries=3) as cluster:
        client = await connect_cluster(cluster.url)
        subscriber = ShardedEventSubscriber(client, reconnect_for_s=3.0)
        try:
            doomed = channel_named("doomed")
            survivor = channel_named("survivor")
            while cluster.primary_of(survivor).port == cluster.primary_of(doomed).port:
                survivor = channel_named("survivor")
            lost, kept = await subscriber.subscribe(doomed), await subscriber.subscribe(survivor)
            cluster.kill(cluster.primary_of(doomed))
            async with asyncio.timeout(30):
                while not isinstance(item := await lost.get(), BaseException):
                    assert item is RESYNC
            await spublish(client, survivor, b"carried on")
            async with asyncio.timeout(10):
                while (item := await kept.get()) is RESYNC:
                    pass
            assert item == b"carried on"
        finally:
            await subscriber.close()
            await client.aclose()
