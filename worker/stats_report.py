"""``StatsReporter``: this worker's report for the dashboard, rewritten every
``WORKER_STATS_INTERVAL_S`` (``streamq.protocol.worker_stats.WorkerStats``).

Nothing here counts anything per token: the requests running now are the ``Progress``
objects their jobs keep anyway (``RunningRequests``), and the counters and latency
histograms are read from the worker's own Prometheus metrics (``worker/metrics.py``), and
vLLM's prefix-cache counters from the same default registry, once per report. A report
that fails is logged and tried again at the next interval; serving never waits on it.
The last report, on shutdown, says when and why the worker stopped.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import socket
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Protocol

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Histogram
from redis.asyncio import Redis

from streamq.broker.worker_stats import WorkerStatsStore
from streamq.protocol import GenerateRequest, WorkerRegistration
from streamq.protocol.names import WORKER_STATS_INTERVAL_S
from streamq.protocol.worker_stats import InFlightRequest, WorkerStats
from streamq.tasks import stop_task
from worker import metrics
from worker.failure_log import RepeatedFailure

logger = logging.getLogger("streamq.worker")

VLLM_PREFIX_CACHE_QUERIES: str = "vllm:prefix_cache_queries"
"""vLLM's counter of prompt tokens looked up in its prefix cache, one series per engine
(``vllm/v1/metrics/loggers.py``); registered by vLLM in the default registry."""
VLLM_PREFIX_CACHE_HITS: str = "vllm:prefix_cache_hits"
"""Of those, the tokens found cached."""

SHUTDOWN: str = "shutdown"
ENGINE_DIED: str = "engine died"


def _now_ms() -> int:
    return int(time.time() * 1000)


class TokenCount(Protocol):
    """What a running request's progress shows: its tokens so far (``worker.progress.Progress``)."""

    @property
    def completion_tokens(self) -> int: ...


@dataclass(eq=False)
class RunningRequest:
    request_id: str
    attempt: int
    started_ms: int
    tenant: str | None
    priority: int | None
    model: str | None = None
    progress: TokenCount | None = None
    """Set by the job once it knows it (a take-over rebuilds it from the log first)."""

    def in_flight(self) -> InFlightRequest:
        return InFlightRequest(
            request_id=self.request_id,
            started_ms=self.started_ms,
            attempt=self.attempt,
            completion_tokens=self.progress.completion_tokens if self.progress is not None else 0,
            tenant=self.tenant,
            priority=self.priority,
            model=self.model,
        )


class RunningRequests:
    """The requests this worker runs now, each with its progress: the jobs add and remove
    themselves (``track``), a report reads them."""

    def __init__(self) -> None:
        self._running: dict[tuple[str, int], RunningRequest] = {}

    @contextmanager
    def track(self, request: GenerateRequest, attempt: int) -> Iterator[RunningRequest]:
        """Count ``request``'s ``attempt`` as running here while the block runs; the block
        sets the entry's ``progress``."""
        key = (request.request_id, attempt)
        entry = self._running[key] = RunningRequest(
            request_id=request.request_id,
            attempt=attempt,
            started_ms=_now_ms(),
            tenant=request.tenant,
            priority=request.priority,
            model=request.model,
        )
        try:
            yield entry
        finally:
            self._running.pop(key, None)

    def in_flight(self) -> list[InFlightRequest]:
        """The running requests as a report lists them, longest-running first."""
        return sorted((entry.in_flight() for entry in self._running.values()), key=lambda r: r.started_ms)


def _samples(metric: Counter | Histogram, suffix: str) -> Iterator[tuple[dict[str, str], float]]:
    """The samples of ``metric`` whose name ends with ``suffix`` (``_total``, ``_bucket``...)."""
    for family in metric.collect():
        for sample in family.samples:
            if sample.name.endswith(suffix):
                yield sample.labels, sample.value


def _counter_total(counter: Counter) -> int:
    return int(sum(value for _, value in _samples(counter, "_total")))


def registry_counter_total(name: str, registry: CollectorRegistry = REGISTRY) -> int:
    """The sum over every label set of the ``_total`` samples of the counter family
    ``name`` in ``registry``, 0 when none is registered (vLLM's metrics are absent with a
    scripted engine or ``--disable-log-stats``).

    For counters this module does not own (vLLM creates and re-creates its own): the
    restricted registry collects only that family, not every ``vllm:*`` histogram and
    the process collectors, so a report stays cheap on the worker's event loop."""
    sample_name = f"{name}_total"
    return int(
        sum(
            sample.value
            for family in registry.restricted_registry([sample_name]).collect()
            if family.name == name
            for sample in family.samples
            if sample.name == sample_name
        )
    )


def _counts_by(counter: Counter, label: str) -> dict[str, int]:
    """Each non-zero value of a labelled counter, by ``label``."""
    return {labels[label]: int(value) for labels, value in _samples(counter, "_total") if value > 0}


def _buckets(histogram: Histogram) -> tuple[list[tuple[float, int]], int]:
    """A histogram's finite cumulative buckets (``(upper bound, count)``) and its count."""
    buckets = []
    for labels, value in _samples(histogram, "_bucket"):
        bound = float(labels["le"])
        if math.isfinite(bound):
            buckets.append((bound, int(value)))
    count = int(sum(value for _, value in _samples(histogram, "_count")))
    return sorted(buckets), count


class StatsReporter:
    """Writes this worker's ``WorkerStats`` now and every ``interval_s`` until closed."""

    def __init__(
        self,
        redis: Redis,
        *,
        registration: WorkerRegistration,
        running: RunningRequests,
        engine_dead: Callable[[], bool],
        interval_s: float = WORKER_STATS_INTERVAL_S,
    ) -> None:
        self._store = WorkerStatsStore(redis)
        self._registration = registration
        self._running = running
        self._engine_dead = engine_dead
        self._interval_s = interval_s
        self._host = socket.gethostname()
        self._pid = os.getpid()
        self._started_ms = _now_ms()
        self._task: asyncio.Task[None] | None = None
        self._failures = RepeatedFailure(logger, "writing the stats report")

    def stats(self) -> WorkerStats:
        """The report as of now."""
        registration = self._registration
        ttft_buckets, ttft_count = _buckets(metrics.TIME_TO_FIRST_TOKEN)
        itl_buckets, itl_count = _buckets(metrics.INTER_TOKEN_LATENCY)
        return WorkerStats(
            worker_id=registration.worker_id,
            model=registration.model,
            queue=registration.queue,
            host=self._host,
            pid=self._pid,
            started_ms=self._started_ms,
            in_flight=self._running.in_flight(),
            generated_tokens=_counter_total(metrics.GENERATED_TOKENS),
            requests_finished=_counter_total(metrics.REQUESTS_FINISHED),
            errors=_counts_by(metrics.REQUEST_ERRORS, "code"),
            ttft_buckets=ttft_buckets,
            ttft_count=ttft_count,
            itl_buckets=itl_buckets,
            itl_count=itl_count,
            affinity_hits=_counter_total(metrics.AFFINITY_HITS),
            affinity_misses=_counter_total(metrics.AFFINITY_MISSES),
            affinity_expired=_counter_total(metrics.AFFINITY_EXPIRED),
            prefix_cache_queries=registry_counter_total(VLLM_PREFIX_CACHE_QUERIES),
            prefix_cache_hits=registry_counter_total(VLLM_PREFIX_CACHE_HITS),
        )

    def start(self) -> None:
        """Report now and then every interval, in the background."""
        self._task = asyncio.create_task(self._run(), name="stats-report")

    async def _report(self, stats: WorkerStats) -> None:
        try:
            await self._store.report(stats)
        except Exception as exc:  # Redis away (or full): the next interval tries again
            self._failures.failed("could not write the worker's stats report: %s", exc)
        else:
            self._failures.passed()

    async def _run(self) -> None:
        while True:
            await self._report(self.stats())
            await asyncio.sleep(self._interval_s)

    async def close(self) -> None:
        """Stop reporting and write the last report: when the worker stopped, and why.
        Runs once the worker's jobs are done, so it lists none in flight (unless the
        engine died under them)."""
        await stop_task(self._task)
        self._task = None
        stats = self.stats()
        stats.stopped_ms = _now_ms()
        stats.stop_reason = ENGINE_DIED if self._engine_dead() else SHUTDOWN
        await self._report(stats)
