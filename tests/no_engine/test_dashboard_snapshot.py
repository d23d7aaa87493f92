"""The dashboard's Snapshot, read by a real gateway from a real Redis holding what fake
workers reported (``WorkerStatsStore.report``, as workers do), registered workers, a
queue and recent ends: every field an operator reads, from known numbers."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
import redis.asyncio as aioredis

from devkit.redis_server import RedisServer
from streamq.broker.registry import WorkerRegistry
from streamq.broker.worker_stats import WorkerStatsStore
from streamq.protocol import (
    RESULT_KEY_PREFIX,
    AdapterCard,
    ErrorEvent,
    FinalEvent,
    WorkerRegistration,
    encode_event,
)
from streamq.protocol.names import RECENT_ENDS_KEY, WORKER_STATS_KEY, WORKER_STATS_SEEN_KEY
from streamq.protocol.roles import GATEWAY
from streamq.protocol.worker_stats import InFlightRequest, WorkerStats
from tests.support.gateway_in_process import gateway_client

HOUR_MS = 3_600_000


@pytest.fixture
async def http(redis_server: RedisServer) -> AsyncIterator[httpx.AsyncClient]:
    async with gateway_client(redis_server.url_for(GATEWAY)) as (_, client):
        yield client


@dataclass
class Fleet:
    """One model's fake workers: what they register and report."""

    admin: aioredis.Redis
    tag: str

    @property
    def model(self) -> str:
        return f"dash-{self.tag}"

    @property
    def queue(self) -> str:
        return f"streamq:queue:dash-{self.tag}"

    def worker_id(self, name: str) -> str:
        return f"{self.model}-{name}"

    def stats(self, name: str, **fields: Any) -> WorkerStats:
        return WorkerStats(
            worker_id=self.worker_id(name), model=self.model, queue=self.queue, host=f"host-{name}", pid=100, **fields
        )

    async def register(self, name: str) -> None:
        registration = WorkerRegistration(worker_id=self.worker_id(name), model=self.model, queue=self.queue)
        await WorkerRegistry(self.admin).register(registration, ttl_ms=120_000)

    async def report(self, stats: WorkerStats) -> int:
        """Store ``stats``; the report's time (Redis's clock), as the gateway will read it."""
        await WorkerStatsStore(self.admin).report(stats)
        score = await self.admin.zscore(WORKER_STATS_SEEN_KEY, stats.worker_id)
        assert score is not None
        return int(score)


@pytest.fixture
async def fleet(admin: aioredis.Redis) -> AsyncIterator[Fleet]:
    fleet = Fleet(admin, uuid.uuid4().hex[:10])
    yield fleet
    names = [fleet.worker_id(name) for name in "abcd"]
    await admin.hdel(WORKER_STATS_KEY, *names)  # type: ignore[misc]
    await admin.zrem(WORKER_STATS_SEEN_KEY, *names)
    for name in "abcd":
        registration = WorkerRegistration(worker_id=fleet.worker_id(name), model=fleet.model, queue=fleet.queue)
        await WorkerRegistry(admin).unregister(registration)
    await admin.delete(fleet.queue)


async def snapshot(http: httpx.AsyncClient) -> dict[str, Any]:
    response = await http.get("/dashboard/api/snapshot")
    assert response.status_code == 200, response.text
    assert response.headers["content-type"] == "application/json"
    body: dict[str, Any] = response.json()
    return body


def now_ms() -> int:
    return int(time.time() * 1000)


async def test_a_snapshot_reads_rates_windows_queue_and_workers_from_two_reports(
    http: httpx.AsyncClient, fleet: Fleet, admin: aioredis.Redis
) -> None:
    t = now_ms()
    ids = [f"{fleet.tag}-r{i}" for i in range(4)]
    # a: live, started long before the window; d: live, started inside it (counted from zero)
    await fleet.register("a")
    await fleet.register("d")
    running_a = [
        InFlightRequest(ids[1], started_ms=t - 5000, completion_tokens=7),
        InFlightRequest(ids[2], started_ms=t - 2000, attempt=2, completion_tokens=3, tenant="t1", priority=2),
    ]
    running_d = [InFlightRequest(ids[3], started_ms=t - 9000, completion_tokens=30)]
    ttft_before = [(0.01, 5), (0.05, 5), (0.1, 5), (0.5, 5)]
    ttft_after = [(0.01, 7), (0.05, 11), (0.1, 14), (0.5, 15)]
    a1 = fleet.stats(
        "a",
        started_ms=t - HOUR_MS,
        in_flight=running_a,
        generated_tokens=100,
        requests_finished=10,
        errors={"invalid_request": 1},
        ttft_buckets=ttft_before,
        ttft_count=5,
        affinity_hits=10,
        affinity_misses=5,
        affinity_expired=1,
        prefix_cache_queries=1000,
        prefix_cache_hits=400,
    )
    # d's counters count from zero: it started inside the window
    d_prefix = {"affinity_hits": 2, "prefix_cache_queries": 100, "prefix_cache_hits": 90}
    d1 = fleet.stats(
        "d", started_ms=t - 1000, in_flight=running_d, requests_finished=2, errors={"timeout": 1}, **d_prefix
    )
    # b said it stopped; c went quiet without a word (neither is registered)
    b = fleet.stats(
        "b", started_ms=t - HOUR_MS, stopped_ms=t, stop_reason="shutdown", requests_finished=4, affinity_hits=50
    )
    c = fleet.stats("c", started_ms=t - HOUR_MS, generated_tokens=9, errors={"internal": 2, "timeout": 1})
    seen_a1 = await fleet.report(a1)
    seen_d1 = await fleet.report(d1)
    await fleet.report(b)
    time.sleep(0.01)
    seen_c = await fleet.report(c)
    await admin.zadd(fleet.queue, {f"{fleet.tag}-job{i}": i for i in range(5)})  # 3 running + 2 waiting

    first = await snapshot(http)
    (row,) = [m for m in first["models"] if m["model"] == fleet.model]
    assert row["tokens_per_s"] == 0  # one report each: no rate yet
    assert row["ttft_ms"] is None and row["finished"] == 2 and row["errors"] == {"timeout": 1}
    # a's and b's first reports inside the window are their base: only d's counts count
    assert (row["affinity_hits"], row["affinity_misses"], row["affinity_hit_rate"]) == (2, 0, 1.0)
    assert (row["prefix_cache_queries"], row["prefix_cache_hits"], row["prefix_cache_hit_rate"]) == (100, 90, 0.9)

    time.sleep(0.01)  # a later report, by Redis's clock
    a2 = fleet.stats(
        "a",
        started_ms=t - HOUR_MS,
        in_flight=running_a,
        generated_tokens=160,
        requests_finished=15,
        errors={"invalid_request": 3},
        ttft_buckets=ttft_after,
        ttft_count=15,
        affinity_hits=16,
        affinity_misses=7,
        affinity_expired=4,
        prefix_cache_queries=1600,
        prefix_cache_hits=700,
    )
    d2 = fleet.stats(
        "d",
        started_ms=t - 1000,
        in_flight=running_d,
        generated_tokens=40,
        requests_finished=2,
        errors={"timeout": 1},
        **d_prefix,
    )
    seen_a2 = await fleet.report(a2)
    seen_d2 = await fleet.report(d2)
    second = await snapshot(http)

    rate_a = 60 / ((seen_a2 - seen_a1) / 1000)
    rate_d = 40 / ((seen_d2 - seen_d1) / 1000)
    (row,) = [m for m in second["models"] if m["model"] == fleet.model]
    history = row.pop("history")
    assert row == {
        "model": fleet.model,
        "queue": fleet.queue,
        "live_workers": 2,
        "waiting": 2,
        "running": 3,
        "tokens_per_s": pytest.approx(rate_a + rate_d, abs=0.01),
        # a's buckets' increase: 2 <= 10 ms, 6 <= 50 ms, 9 <= 100 ms, 10 <= 500 ms
        "ttft_ms": {"p50": 40.0, "p90": 100.0, "p99": 460.0},
        "itl_ms": None,
        "finished": 5 + 2,
        "errors": {"invalid_request": 2, "timeout": 1},
        # a's increases (6 hits, 2 misses, 3 expired) and d's from zero (2 hits)
        "affinity_hits": 6 + 2,
        "affinity_misses": 2,
        "affinity_hit_rate": 0.8,
        "affinity_expired": 3,
        "prefix_cache_queries": 600 + 100,
        "prefix_cache_hits": 300 + 90,
        "prefix_cache_hit_rate": round(390 / 700, 4),
    }
    assert history and all(second["now_ms"] - 300_000 <= p["t_ms"] <= second["now_ms"] for p in history)
    assert [p["t_ms"] for p in history] == sorted(p["t_ms"] for p in history)
    assert {"waiting": 2, "running": 3} in [{"waiting": p["waiting"], "running": p["running"]} for p in history]
    assert second["window_s"] == 300 and second["now_ms"] >= seen_a2

    workers = [w for w in second["workers"] if w["model"] == fleet.model]
    assert [(w["worker_id"], w["state"], w["stop_reason"]) for w in workers] == [
        (fleet.worker_id("a"), "live", None),
        (fleet.worker_id("d"), "live", None),
        (fleet.worker_id("c"), "lost", "stopped reporting"),  # heard from after b
        (fleet.worker_id("b"), "stopped", "shutdown"),
    ]
    assert workers[0] == {
        "worker_id": fleet.worker_id("a"),
        "model": fleet.model,
        "queue": fleet.queue,
        "host": "host-a",
        "pid": 100,
        "started_ms": t - HOUR_MS,
        "reported_ms": seen_a2,
        "state": "live",
        "stop_reason": None,
        "in_flight": 2,
        "tokens_per_s": pytest.approx(rate_a, abs=0.01),
        "generated_tokens": 160,
        "requests_finished": 15,
        "errors": 3,
        "affinity_hits": 16,  # since it started, as its tokens
        "affinity_misses": 7,
        "adapters": [],
    }
    assert workers[2]["errors"] == 3 and workers[2]["reported_ms"] == seen_c and workers[2]["in_flight"] == 0
    assert workers[3]["tokens_per_s"] == 0

    running = [r for r in second["running"] if r["model"] == fleet.model]
    assert [r["request_id"] for r in running] == [ids[3], ids[1], ids[2]]  # longest-running first
    assert running[2] == {
        "request_id": ids[2],
        "model": fleet.model,
        "worker_id": fleet.worker_id("a"),
        "tenant": "t1",
        "priority": 2,
        "attempt": 2,
        "completion_tokens": 3,
        "started_ms": t - 2000,
        "age_s": pytest.approx((second["now_ms"] - (t - 2000)) / 1000, abs=0.06),
    }
    assert (running[1]["tenant"], running[1]["priority"], running[1]["attempt"]) == ("default", 0, 1)


async def test_a_workers_adapters_and_each_adapters_running_requests_are_shown(
    http: httpx.AsyncClient, fleet: Fleet, admin: aioredis.Redis
) -> None:
    t = now_ms()
    sql = AdapterCard(name=f"{fleet.model}-sql", path="/adapters/sql")
    registration = WorkerRegistration(
        worker_id=fleet.worker_id("a"), model=fleet.model, queue=fleet.queue, adapters=(sql,)
    )
    base_id, sql_id = f"{fleet.tag}-base", f"{fleet.tag}-sql"
    await WorkerRegistry(admin).register(registration, ttl_ms=120_000)
    try:
        running = [
            InFlightRequest(base_id, started_ms=t - 1000),
            InFlightRequest(sql_id, started_ms=t - 500, model=sql.name),
        ]
        await fleet.report(fleet.stats("a", started_ms=t - HOUR_MS, in_flight=running))
        snap = await snapshot(http)
    finally:
        await WorkerRegistry(admin).unregister(registration)
    (worker,) = [w for w in snap["workers"] if w["worker_id"] == fleet.worker_id("a")]
    assert (worker["model"], worker["adapters"], worker["in_flight"]) == (fleet.model, [sql.name], 2)
    rows = {m["model"]: m for m in snap["models"] if m["queue"] == fleet.queue}
    assert {model: (row["live_workers"], row["running"]) for model, row in rows.items()} == {
        fleet.model: (1, 1),
        sql.name: (1, 1),
    }
    assert {r["request_id"]: r["model"] for r in snap["running"] if r["worker_id"] == worker["worker_id"]} == {
        base_id: fleet.model,
        sql_id: sql.name,
    }


async def test_a_model_with_queued_jobs_and_no_live_worker_is_shown(
    http: httpx.AsyncClient, fleet: Fleet, admin: aioredis.Redis
) -> None:
    await fleet.register("a")
    await WorkerRegistry(admin).unregister(
        WorkerRegistration(worker_id=fleet.worker_id("a"), model=fleet.model, queue=fleet.queue)
    )
    assert not [m for m in (await snapshot(http))["models"] if m["model"] == fleet.model]  # known, idle: not shown
    await admin.zadd(fleet.queue, {f"{fleet.tag}-job": 1})
    (row,) = [m for m in (await snapshot(http))["models"] if m["model"] == fleet.model]
    assert (row["live_workers"], row["waiting"], row["running"], row["tokens_per_s"]) == (0, 1, 0, 0)
    # nothing claimed with prefix keys, no prefix-cache lookup: no rate (the page shows "–"), not 0
    assert (row["affinity_hits"], row["affinity_misses"], row["affinity_expired"]) == (0, 0, 0)
    assert row["affinity_hit_rate"] is None and row["prefix_cache_hit_rate"] is None


async def test_recent_ends_newest_first_with_their_model_where_known(
    http: httpx.AsyncClient, fleet: Fleet, admin: aioredis.Redis
) -> None:
    t = now_ms()
    seen, stored, by_queue, unknown, filler = (
        f"{fleet.tag}-{name}" for name in ("seen", "stored", "queue", "unknown", "x")
    )
    await fleet.register("a")
    # `seen` runs on a while the dashboard looks: its model is remembered
    await fleet.report(fleet.stats("a", started_ms=t, in_flight=[InFlightRequest(seen, started_ms=t)]))
    await snapshot(http)
    await fleet.report(fleet.stats("a", started_ms=t, requests_finished=1))

    def final(request_id: str, tokens: int) -> bytes:
        event = FinalEvent(
            request_id=request_id, seq=tokens, finish_reasons=["length"], prompt_tokens=4, completion_tokens=tokens
        )
        return f"{request_id} {t}".encode() + b" " + encode_event(event)

    failed = ErrorEvent(request_id=by_queue, seq=0, code="invalid_request", message="bad parameters")
    entries = [final(f"{filler}{i}", 1) for i in range(55)]
    entries += [
        final(seen, 16),
        final(stored, 8),
        f"{by_queue} {t + 1}".encode() + b" " + encode_event(failed),
        final(unknown, 2),
    ]
    # the job's stored result names the model (or only its queue, which one model serves)
    await admin.set(
        RESULT_KEY_PREFIX + stored,
        json.dumps({"s": True, "a": [{"request_id": stored, "model": fleet.model}], "q": fleet.queue}),
    )
    await admin.set(RESULT_KEY_PREFIX + by_queue, json.dumps({"s": False, "a": [], "q": fleet.queue}))
    try:
        for entry in entries:
            await admin.lpush(RECENT_ENDS_KEY, entry)  # type: ignore[misc]
        recent = (await snapshot(http))["recent"]
    finally:
        for entry in entries:
            await admin.lrem(RECENT_ENDS_KEY, 1, entry)  # type: ignore[misc]
        await admin.delete(RESULT_KEY_PREFIX + stored, RESULT_KEY_PREFIX + by_queue)

    assert len(recent) == 50  # at most 50, the newest
    assert [r["request_id"] for r in recent[:4]] == [unknown, by_queue, stored, seen]
    assert [r["model"] for r in recent[:4]] == [None, fleet.model, fleet.model, fleet.model]
    assert recent[3] == {
        "request_id": seen,
        "model": fleet.model,
        "state": "finished",
        "finish_reasons": ["length"],
        "error_code": None,
        "error_message": None,
        "prompt_tokens": 4,
        "completion_tokens": 16,
        "ended_ms": t,
    }
    assert recent[1] == {
        "request_id": by_queue,
        "model": fleet.model,
        "state": "failed",
        "finish_reasons": None,
        "error_code": "invalid_request",
        "error_message": "bad parameters",
        "prompt_tokens": None,
        "completion_tokens": None,
        "ended_ms": t + 1,
    }
    assert all(r["request_id"].startswith(filler) for r in recent[4:])
