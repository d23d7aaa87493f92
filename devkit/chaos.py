"""Fault injection for soak tests: a fleet of real workers to kill and replace, a
Redis to restart, a Redis Cluster shard to fail over, and a witness that records every
event published.

Everything here acts on real processes (``WorkerProcess``, ``RedisServer``), as an
operator's outage would: SIGKILL to a worker's whole process group, a Redis stopped (or
killed) and started again on the same port with its data on disk.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from devkit.redis_cluster import RedisCluster
from devkit.redis_server import RedisServer
from devkit.worker_process import WorkerProcess
from producer.sharded_subscriber import ShardedEventSubscriber
from producer.subscriber import Inbox
from streamq.broker.cluster import SeededCluster, connect_cluster
from streamq.broker.connection import SENTINEL_SCHEME, close_pool, redis_client, redis_settings_for
from streamq.broker.data_plane import CLUSTER
from streamq.protocol import EVENTS_CHANNEL_PREFIX, IN_PROGRESS_PREFIX

SERVING_LINE = "registered model "
"""What a worker logs once its engine is up and it is about to take jobs. (The health
check key cannot tell one worker from another on a shared queue.)"""
_LEASE_HOLDER = re.compile(r"-(\d+)-[0-9a-f]{8}(?::\d+)?$")
"""An in-progress key's value: ``<host>-<pid>-<hex>``, then ``:<attempt>`` once renewed."""


def is_serving(worker: WorkerProcess) -> bool:
    """True once ``worker`` has its engine up; raises if it exited meanwhile."""
    assert worker.process is not None, "start() first"
    if worker.process.poll() is not None:
        raise RuntimeError(f"worker exited with {worker.process.returncode}:\n{worker.log_tail()}")
    try:
        return SERVING_LINE in worker.log_path.read_text(errors="replace")
    except OSError:
        return False


class WorkerFleet:
    """Real workers on one queue; faults kill one (SIGKILL) and a replacement starts.

    ``make`` builds an unstarted worker given its log path. Killed workers are kept
    (with their logs) so that a report can point at what each one did."""

    def __init__(self, make: Callable[[Path], WorkerProcess], log_dir: Path) -> None:
        self._make = make
        self._log_dir = log_dir
        self.live: list[WorkerProcess] = []
        self.killed: list[WorkerProcess] = []
        self._started = 0

    def start_one(self) -> WorkerProcess:
        self._started += 1
        worker = self._make(self._log_dir / f"worker-{self._started}.log").start()
        self.live.append(worker)
        return worker

    def serving(self) -> list[WorkerProcess]:
        return [worker for worker in self.live if is_serving(worker)]

    async def wait_serving(self, count: int, timeout_s: float = 300.0) -> None:
        """Wait until ``count`` live workers have their engines up."""
        deadline = time.monotonic() + timeout_s
        while len(self.serving()) < count:
            if time.monotonic() > deadline:
                tails = "\n\n".join(f"{w.log_path}:\n{w.log_tail()}" for w in self.live)
                raise RuntimeError(f"fewer than {count} workers serving after {timeout_s:.0f}s:\n{tails}")
            await asyncio.sleep(0.2)

    async def busy(self, redis: aioredis.Redis) -> list[WorkerProcess]:
        """Serving workers that hold the lease of a running job (named in its in-progress key)."""
        pids = set()
        async for key in redis.scan_iter(IN_PROGRESS_PREFIX + "*"):
            holder = await redis.get(key)
            match = _LEASE_HOLDER.search(holder.decode()) if holder else None
            if match:
                pids.add(int(match.group(1)))
        return [w for w in self.serving() if w.process is not None and w.process.pid in pids]

    async def kill_one(self, rng: random.Random, redis: aioredis.Redis) -> WorkerProcess:
        """SIGKILL a random serving worker (engine processes too), one that runs jobs if
        any does (with every job on one worker, killing an idle one proves little), and
        start its replacement."""
        victim = rng.choice(await self.busy(redis) or self.serving())
        await asyncio.to_thread(victim.kill)
        self.live.remove(victim)
        self.killed.append(victim)
        self.start_one()
        return victim

    def unexpected_exits(self) -> list[WorkerProcess]:
        """Live workers (never killed by a fault) that exited by themselves."""
        return [w for w in self.live if w.process is not None and w.process.poll() is not None]

    def stop_all(self) -> dict[str, int]:
        """SIGTERM every live worker; each one's log path -> exit status."""
        return {str(worker.log_path): worker.stop() for worker in self.live}

    def kill_all(self) -> None:
        for worker in self.live + self.killed:
            worker.kill()


async def restart_redis(server: RedisServer, down_s: float, *, crash: bool = False) -> tuple[float, float]:
    """Stop Redis (SIGTERM; ``crash``: SIGKILL, with no chance to write anything more),
    keep it down ``down_s`` seconds, start it on the same port (its data persists when the
    server is ``persistent``). Returns the monotonic times it was gone and it answered again."""
    await asyncio.to_thread(server.kill if crash else server.stop)
    down_at = time.monotonic()
    await asyncio.sleep(down_s)
    await asyncio.to_thread(server.start, 30.0)
    return down_at, time.monotonic()


class Gate:
    """Lets calls through while open; ``close`` waits for the ones already inside.

    A soak producer submits and cancels through the gate, so no request is half
    submitted at the moment Redis goes down (a refused submit is the caller's to retry
    and is not what a soak measures)."""

    def __init__(self) -> None:
        self._open = asyncio.Event()
        self._open.set()
        self._inside = 0
        self._idle = asyncio.Event()
        self._idle.set()

    async def __aenter__(self) -> None:
        await self._open.wait()
        self._inside += 1
        self._idle.clear()

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._inside -= 1
        if self._inside == 0:
            self._idle.set()

    async def close(self) -> None:
        self._open.clear()
        await self._idle.wait()

    def open(self) -> None:
        self._open.set()


@dataclass
class WireEvent:
    """One event as it crossed the wire (pub/sub), with when it was seen."""

    at: float
    event: dict[str, Any]


@dataclass
class EventWitness:
    """Records every event published on any request channel (a pattern subscription
    on its own connection, resubscribed after Redis restarts). Events published while
    it reconnects are not seen; everything seen is kept, duplicates included. ``url`` may
    be a ``redis+sentinel://`` URL: the witness then follows the master through failovers."""

    url: str
    events: dict[str, list[WireEvent]] = field(default_factory=dict)
    reconnects: int = 0
    _task: asyncio.Task[None] | None = None
    _subscribed: asyncio.Event = field(default_factory=asyncio.Event)

    async def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="event-witness")
        async with asyncio.timeout(10):
            await self._subscribed.wait()

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _run(self) -> None:
        while True:
            sentinel = self.url.startswith(SENTINEL_SCHEME + "://")
            client = redis_client(redis_settings_for(self.url)) if sentinel else aioredis.Redis.from_url(self.url)
            pubsub = client.pubsub()
            try:
                await pubsub.psubscribe(EVENTS_CHANNEL_PREFIX + "*")
                self._subscribed.set()
                while True:
                    message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=1.0)
                    if message is None or message["type"] != "pmessage":
                        continue
                    event = json.loads(message["data"])
                    self.events.setdefault(event["request_id"], []).append(WireEvent(time.monotonic(), event))
            except (RedisConnectionError, RedisTimeoutError, OSError):
                self.reconnects += 1
                await asyncio.sleep(0.2)
            finally:
                with contextlib.suppress(RedisConnectionError, RedisTimeoutError, OSError):
                    await pubsub.aclose()
                    await close_pool(client)  # aclose(), and the Sentinels' connections too


class ShardedEventWitness:
    """``EventWitness`` for a data plane on a Redis Cluster, whose sharded channels no
    pattern matches: each request is followed from before it is submitted (``follow``), at
    its slot's node, through slot moves and failovers (``ShardedEventSubscriber``). Events
    published while a shard's connection is re-established are not seen."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.events: dict[str, list[WireEvent]] = {}
        self.reconnects = 0
        self._client: SeededCluster | None = None
        self._subscriber: ShardedEventSubscriber | None = None
        self._tasks: list[asyncio.Task[None]] = []

    async def start(self) -> None:
        self._client = await connect_cluster(self.url)
        self._subscriber = ShardedEventSubscriber(self._client)

    async def follow(self, request_id: str) -> None:
        """Record ``request_id``'s events from now until ``stop()``: past its first end too
        (a second end is what a soak looks for)."""
        assert self._subscriber is not None, "start() first"
        inbox = await self._subscriber.subscribe(CLUSTER.events(request_id))
        self._tasks.append(asyncio.create_task(self._record(request_id, inbox), name=f"witness {request_id}"))

    async def _record(self, request_id: str, inbox: Inbox) -> None:
        seen = self.events.setdefault(request_id, [])
        while True:
            item = await inbox.get()
            if isinstance(item, bytes):
                event = json.loads(item)
                seen.append(WireEvent(time.monotonic(), event))
            elif isinstance(item, BaseException):
                self.reconnects += 1
                return
            else:  # RESYNC: the subscription moved with its slot
                self.reconnects += 1

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._subscriber is not None:
            await self._subscriber.close()
        if self._client is not None:
            await self._client.aclose()


def shards_to_fail_over(cluster: RedisCluster) -> list[RedisServer]:
    """The primaries of the shards that still have a replica, in slot order."""
    return [cluster.node(port) for port in cluster.primary_ports() if cluster.replicas_of(cluster.node(port))]


def fail_over(cluster: RedisCluster, primary: RedisServer) -> str:
    """SIGKILL ``primary`` and wait until its replica serves its slots: says which, in words."""
    replica = cluster.replicas_of(primary)[0]
    cluster.kill(primary)
    cluster.wait_for_primary(replica, timeout_s=60)
    return f"primary {primary.port} killed, replica {replica.port} promoted"


def percentile(values: list[float], fraction: float) -> float:
    """The ``fraction`` quantile (nearest rank) of ``values``; NaN for none."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(fraction * (len(ordered) - 1))))]
