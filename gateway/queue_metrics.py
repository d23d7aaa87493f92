"""The requests waiting on each queue, and Redis's memory, on ``/metrics`` (the gateway's,
and the exporter's): what an autoscaler scales workers on, with every worker gone too, and
how near Redis is to refusing writes (docs/operations/redis.md).

Read from Redis at each scrape (``streamq.broker.waiting``), so each replica reports the same
deployment-wide figures: scrape one replica for them, or take ``max`` across replicas, not
``sum``. ``QueueTender`` keeps them exact between scrapes while no worker claims.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from producer.internal_client import InternalClient
from streamq.broker.memory_policy import MemoryPolicy, read_memory_policy
from streamq.broker.waiting import QueueWaiting, WaitingRequests, queues_of
from streamq.tasks import stop_task

logger = logging.getLogger("streamq.gateway")

TEND_INTERVAL_S = 1.0
"""How often the waiting sets are made exact with no worker claiming (a deferred request
that came due, a dead worker's lapsed lease): within this, the signal counts them."""


class _Snapshot(Collector):
    def __init__(self, queues: list[QueueWaiting], memory: MemoryPolicy | None) -> None:
        self.queues = queues
        self.memory = memory

    def collect(self) -> Iterable[GaugeMetricFamily]:
        waiting = GaugeMetricFamily(
            "streamq_requests_waiting",
            "Requests due and not started (waiting for a free worker, or for a take-over), by queue and its model",
            labels=["queue", "model"],
        )
        oldest = GaugeMetricFamily(
            "streamq_oldest_waiting_seconds",
            "How long the longest waiting request of the queue has waited (0 when none waits)",
            labels=["queue", "model"],
        )
        for queue in self.queues:
            waiting.add_metric([queue.queue, queue.model], queue.waiting)
            oldest.add_metric([queue.queue, queue.model], queue.oldest_wait_s)
        if self.memory is None:  # INFO refused to this Redis user, or not answered by a proxy
            return [waiting, oldest]
        used = GaugeMetricFamily("streamq_redis_memory_used_bytes", "Redis's used_memory (INFO memory)")
        used.add_metric([], self.memory.used)
        limit = GaugeMetricFamily(
            "streamq_redis_memory_max_bytes",
            "Redis's maxmemory, where it refuses writes under noeviction (0: no limit)",
            labels=["policy"],
        )
        limit.add_metric([self.memory.policy], self.memory.maxmemory)
        return [waiting, oldest, used, limit]


async def waiting_now(client: InternalClient, waiting: WaitingRequests) -> list[QueueWaiting]:
    """Every queue's waiting requests now: those a worker ever served, the client's own and
    its declared models' queues."""
    routes = await client.routes()
    return await waiting.read(queues_of(routes, also=[client.queue], declared=client.declared_models))


async def waiting_exposition(client: InternalClient, waiting: WaitingRequests) -> bytes:
    """``streamq_requests_waiting``, ``streamq_oldest_waiting_seconds`` and Redis's memory
    (``streamq_redis_memory_used_bytes``, ``streamq_redis_memory_max_bytes``) in Prometheus's
    text format."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Snapshot(await waiting_now(client, waiting), await read_memory_policy(client.redis)))
    return generate_latest(registry)


class QueueTender:
    """Tends every queue's waiting set once a ``TEND_INTERVAL_S`` (``WaitingRequests.tend``)."""

    def __init__(self, client: InternalClient, waiting: WaitingRequests, interval_s: float = TEND_INTERVAL_S) -> None:
        self._client = client
        self._waiting = waiting
        self._interval_s = interval_s
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._tend_forever(), name="queue-tender")

    async def stop(self) -> None:
        await stop_task(self._task)

    async def _tend_forever(self) -> None:
        while True:
            try:
                routes = await self._client.routes()
                queues = queues_of(routes, also=[self._client.queue], declared=self._client.declared_models)
                await self._waiting.tend(queues)
            except Exception as exc:  # Redis away for a moment: the next round tends it
                logger.warning("cannot tend the waiting requests: %s", exc)
            await asyncio.sleep(self._interval_s)
