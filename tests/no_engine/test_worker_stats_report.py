"""``StatsReporter`` on a real Redis, as the worker role, without an engine: what runs
now comes from the jobs' progress, the counters from the worker's Prometheus metrics
(and vLLM's prefix-cache counters from the same registry);
the last report says why it stopped; a Redis that refuses a report costs a warning only."""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis
from prometheus_client import REGISTRY, Counter

from devkit.redis_server import RedisServer
from streamq.broker.worker_stats import WorkerStatsStore
from streamq.protocol import GenerateRequest, WorkerRegistration
from streamq.protocol.roles import PRODUCER, WORKER
from streamq.protocol.worker_stats import WorkerStats
from worker import metrics
from worker.stats_report import RunningRequests, StatsReporter


class _Progress:
    completion_tokens = 0


@pytest.fixture
async def worker_redis(redis_server: RedisServer) -> AsyncIterator[aioredis.Redis]:
    client = aioredis.Redis.from_url(redis_server.url_for(WORKER))
    yield client
    await client.aclose()


def _registration() -> WorkerRegistration:
    name = f"w-{uuid.uuid4().hex[:8]}"
    return WorkerRegistration(worker_id=name, model="tiny", queue="streamq:queue:stats")


async def _report_of(admin: aioredis.Redis, worker_id: str) -> WorkerStats:
    return next(s for s in await WorkerStatsStore(admin).read() if s.worker_id == worker_id)


async def test_the_report_lists_running_requests_and_reads_the_metrics(
    worker_redis: aioredis.Redis, admin: aioredis.Redis
) -> None:
    registration, running = _registration(), RunningRequests()
    reporter = StatsReporter(worker_redis, registration=registration, running=running, engine_dead=lambda: False)
    before = reporter.stats()
    request = GenerateRequest(request_id="r-1", prompt="hi", tenant="team", priority=-1)
    progress = _Progress()
    with running.track(request, 2) as entry:
        entry.progress = progress
        progress.completion_tokens = 7
        metrics.GENERATED_TOKENS.inc(7)
        metrics.REQUESTS_FINISHED.inc()
        metrics.REQUEST_ERRORS.labels(code="worker_lost").inc()
        metrics.TIME_TO_FIRST_TOKEN.observe(0.003)
        metrics.INTER_TOKEN_LATENCY.observe(100.0)  # past the last finite bucket
        metrics.AFFINITY_HITS.inc(3)
        metrics.AFFINITY_MISSES.inc(2)
        metrics.AFFINITY_EXPIRED.inc()
        reporter.start()
        try:
            stats = reporter.stats()
            [in_flight] = stats.in_flight
            assert (in_flight.request_id, in_flight.attempt, in_flight.completion_tokens) == ("r-1", 2, 7)
            assert (in_flight.tenant, in_flight.priority) == ("team", -1)
            assert stats.generated_tokens == before.generated_tokens + 7
            assert stats.requests_finished == before.requests_finished + 1
            assert stats.errors["worker_lost"] == before.errors.get("worker_lost", 0) + 1
            assert all(count > 0 for count in stats.errors.values()), "codes never seen are left out"
            assert stats.ttft_count == before.ttft_count + 1
            bounds = [bound for bound, _ in stats.ttft_buckets]
            assert bounds == sorted(bounds) and bounds[-1] == 10.24, "finite buckets, ascending"
            ttft = dict(stats.ttft_buckets)
            assert ttft[0.005] == dict(before.ttft_buckets)[0.005] + 1
            assert ttft[0.0025] == dict(before.ttft_buckets)[0.0025]
            assert stats.itl_count == before.itl_count + 1
            assert stats.itl_buckets == before.itl_buckets, "counted only in +Inf, which is not sent"
            assert (stats.affinity_hits, stats.affinity_misses, stats.affinity_expired) == (
                before.affinity_hits + 3,
                before.affinity_misses + 2,
                before.affinity_expired + 1,
            )
            assert (stats.worker_id, stats.model, stats.queue) == (registration.worker_id, "tiny", registration.queue)
            for _ in range(100):  # the first report goes out at once
                reports = [s for s in await WorkerStatsStore(admin).read() if s.worker_id == registration.worker_id]
                if reports:
                    break
                await asyncio.sleep(0.05)
            assert [r.request_id for r in reports[0].in_flight] == ["r-1"]
            assert (reports[0].affinity_hits, reports[0].affinity_misses, reports[0].affinity_expired) == (
                stats.affinity_hits,
                stats.affinity_misses,
                stats.affinity_expired,
            )
        finally:
            await reporter.close()
    assert running.in_flight() == []
    last = await _report_of(admin, registration.worker_id)
    assert last.stop_reason == "shutdown" and last.stopped_ms is not None and last.stopped_ms >= last.started_ms


async def test_the_report_sums_vllms_prefix_cache_counters_over_its_engines(
    worker_redis: aioredis.Redis, admin: aioredis.Redis
) -> None:
    """vLLM's counters are in the same default registry, one series per engine (as its
    ``PrometheusStatLogger`` registers them); without them (a scripted engine) they read 0."""
    registration = _registration()
    reporter = StatsReporter(
        worker_redis, registration=registration, running=RunningRequests(), engine_dead=lambda: False
    )
    absent = reporter.stats()
    assert (absent.prefix_cache_queries, absent.prefix_cache_hits) == (0, 0)
    labels = ["model_name", "engine"]
    queries = Counter("vllm:prefix_cache_queries", "Prefix cache queries, in tokens", labels)
    hits = Counter("vllm:prefix_cache_hits", "Prefix cache hits, in tokens", labels)
    # a family whose name only contains the one wanted is not summed with it
    external = Counter("vllm:external_prefix_cache_hits", "External prefix cache hits, in tokens", labels)
    try:
        queries.labels(model_name="tiny", engine="0").inc(1000)
        queries.labels(model_name="tiny", engine="1").inc(24)
        hits.labels(model_name="tiny", engine="0").inc(640)
        hits.labels(model_name="tiny", engine="1").inc(16)
        external.labels(model_name="tiny", engine="0").inc(5000)
        stats = reporter.stats()
        assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (1024, 656)
        await reporter.close()
        stored = await _report_of(admin, registration.worker_id)
        assert (stored.prefix_cache_queries, stored.prefix_cache_hits) == (1024, 656)
    finally:
        for counter in (queries, hits, external):
            REGISTRY.unregister(counter)


async def test_the_last_report_of_a_worker_whose_engine_died_says_so(
    worker_redis: aioredis.Redis, admin: aioredis.Redis
) -> None:
    registration = _registration()
    reporter = StatsReporter(
        worker_redis, registration=registration, running=RunningRequests(), engine_dead=lambda: True
    )
    await reporter.close()  # never started: the last report all the same
    assert (await _report_of(admin, registration.worker_id)).stop_reason == "engine died"


async def test_a_refused_report_only_logs_a_warning(
    redis_server: RedisServer, admin: aioredis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    """As a user that may not write the reports: the reporter goes on, and says why, once
    while the refusals repeat (its retries at DEBUG)."""
    producer = aioredis.Redis.from_url(redis_server.url_for(PRODUCER))
    registration = _registration()
    reporter = StatsReporter(
        producer, registration=registration, running=RunningRequests(), engine_dead=lambda: False, interval_s=0.01
    )
    try:
        with caplog.at_level(logging.DEBUG, logger="streamq.worker"):
            reporter.start()
            for _ in range(200):
                if sum("stats report" in r.getMessage() for r in caplog.records) >= 2:
                    break
                await asyncio.sleep(0.01)
            await reporter.close()
        said = [r for r in caplog.records if "stats report" in r.getMessage()]
        assert len(said) >= 3, "retried, then the last one"
        assert [r.levelno for r in said].count(logging.WARNING) == 1, "said once while it repeats"
        assert registration.worker_id not in [s.worker_id for s in await WorkerStatsStore(admin).read()]
    finally:
        await producer.aclose()
