"""The data plane: where each request's replay log, owner key and event channel live.

One Redis carries both planes unless ``$STREAMQ_EVENTS_REDIS_URL`` (``--events-redis-url``)
names a Redis Cluster for the data plane (docs/redis-cluster.md): then those names carry a
hash tag (one bucket of requests per slot), events go out by ``SPUBLISH``, and the scripts
that decide on the control plane from a request's owner key read it first and pass its
value (``OwnerRead``). Which plane is which follows from the client's type alone, so a
component holds one client per plane and asks this module for the names.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster

from streamq.broker.cluster import connect_cluster
from streamq.broker.replies import as_text
from streamq.environment import check_events_url
from streamq.protocol.names import (
    EVENTS_CHANNEL_PREFIX,
    RECENT_ENDS_KEY,
    events_bucket,
    events_channel,
    owner_key,
    sharded_events_channel,
    sharded_owner_key,
    sharded_recent_ends_key,
    sharded_recent_ends_keys,
)

DataRedis = Redis | RedisCluster
"""A client of the data plane: the control plane's own Redis, or a Redis Cluster."""


async def connect_data_plane(control: Redis, url: str | None) -> DataRedis:
    """The data plane's client: ``control`` itself when ``url`` is ``None``, else the
    cluster ``url`` names, connected and checked (``ClusterUnusable`` when it is not whole)."""
    checked = check_events_url(url)
    if checked is None:
        return control
    return await connect_cluster(checked)


async def close_data_plane(control: Redis, data: DataRedis) -> None:
    """Close the data plane's client if it is not the control plane's."""
    if data is not control:
        await data.aclose()


@dataclass(frozen=True)
class DataNames:
    """The data plane's names for one deployment shape (PROTOCOL.md, "Names")."""

    sharded: bool
    """On a Redis Cluster: hash-tagged names, sharded pub/sub."""

    @property
    def publish_command(self) -> str:
        return "SPUBLISH" if self.sharded else "PUBLISH"

    def events(self, request_id: str) -> str:
        """The request's replay log, and its event channel."""
        return sharded_events_channel(request_id) if self.sharded else events_channel(request_id)

    def owner(self, request_id: str) -> str:
        """The request's owner key."""
        return sharded_owner_key(request_id) if self.sharded else owner_key(request_id)

    def recent_ends(self, request_id: str) -> str:
        """The list a terminal event of ``request_id`` is pushed to, for the dashboard."""
        return sharded_recent_ends_key(request_id) if self.sharded else RECENT_ENDS_KEY

    def all_recent_ends(self) -> list[str]:
        """Every list ``recent_ends`` names."""
        return sharded_recent_ends_keys() if self.sharded else [RECENT_ENDS_KEY]

    def request_id(self, events_key: bytes | str) -> str:
        """The request whose log ``events_key`` is."""
        name = as_text(events_key)[len(EVENTS_CHANNEL_PREFIX) :]
        return name.partition("}:")[2] if self.sharded else name


ONE_REDIS: Final = DataNames(sharded=False)
CLUSTER: Final = DataNames(sharded=True)


def names_of(redis: DataRedis) -> DataNames:
    """The names the data plane ``redis`` uses."""
    return CLUSTER if isinstance(redis, RedisCluster) else ONE_REDIS


class OwnerRead:
    """Owner keys read ahead of a control-plane script, where the data plane is a cluster.

    On one Redis, the scripts that fence by ownership (``renew_leases``, ``finish_job``,
    ``schedule_callback``) read the owner key themselves, atomically with their writes. On
    a cluster the owner key lives on another server, so its value is read first and passed
    in: ownership only moves forward (a newer attempt, then ``ended`` for good), so a value
    read a moment early can only make a script decide as it would have a moment earlier.
    What it writes lands later, though: ``renew_leases`` sets a lease only while the job is
    stored, so that a renewal after the job's end does not set its lease again."""

    def __init__(self, data: DataRedis) -> None:
        self.names = names_of(data)
        self._data = data

    @property
    def ahead(self) -> bool:
        """True when owners must be read ahead (the data plane is a cluster)."""
        return self.names.sharded

    async def values(self, request_ids: Sequence[str]) -> list[str]:
        """The owner keys' values of ``request_ids``, ``""`` for a key that does not exist.
        On a cluster, one ``MGET`` per bucket, all at once, and a bucket whose shard does not
        answer reads as ``""`` (nobody newer known): one shard away must not stop the
        renewal of every lease, and an attempt on that shard can write nothing anyway."""
        if not request_ids:
            return []
        keys = [self.names.owner(request_id) for request_id in request_ids]
        if not isinstance(self._data, RedisCluster):
            return [_text(value) for value in await self._data.mget(keys)]
        cluster = self._data
        buckets: dict[int, list[int]] = {}
        for index, request_id in enumerate(request_ids):
            buckets.setdefault(events_bucket(request_id), []).append(index)

        async def read(indices: list[int]) -> list[bytes | None]:
            try:
                found: list[bytes | None] = await cluster.mget([keys[i] for i in indices])
            except Exception:  # a shard away, or redis-py reading the slot map under the command
                return [None] * len(indices)
            return found

        values = [""] * len(keys)
        groups = list(buckets.values())
        for indices, found in zip(groups, await asyncio.gather(*map(read, groups)), strict=True):
            for index, value in zip(indices, found, strict=True):
                values[index] = _text(value)
        return values


def _text(value: bytes | str | None) -> str:
    return "" if value is None else as_text(value)
