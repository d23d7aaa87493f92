"""The dashboard's HTTP API on a real gateway and Redis, without an engine: the live
snapshot stream (and the overview's figures in it), one request's status, events (replay log, then live) and cancel, the
page's public routes, and who may read the data."""

from __future__ import annotations

import asyncio
import json
import re
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis.asyncio as aioredis
from fastapi import FastAPI

from devkit.redis_server import RedisServer
from gateway.dashboard import routes
from producer.client import StreamqClient
from streamq.broker.api_keys import ApiKeyStore, KeyRecord
from streamq.broker.registry import WorkerRegistry
from streamq.broker.replay_log import LogEvent, ReplayLog
from streamq.broker.worker_stats import WorkerStatsStore
from streamq.protocol import ChunkEvent, Event, FinalEvent, WorkerRegistration, encode_event, events_channel
from streamq.protocol.names import API_KEY_NAMES_KEY, API_KEYS_KEY, WORKER_STATS_KEY, WORKER_STATS_SEEN_KEY
from streamq.protocol.roles import GATEWAY
from streamq.protocol.worker_stats import WorkerStats
from tests.support.gateway_in_process import gateway_client

OPERATOR_KEY = "operator-secret"


@pytest.fixture
async def gateway(redis_server: RedisServer) -> AsyncIterator[tuple[FastAPI, httpx.AsyncClient]]:
    async with gateway_client(redis_server.url_for(GATEWAY)) as served:
        yield served


@pytest.fixture
def http(gateway: tuple[FastAPI, httpx.AsyncClient]) -> httpx.AsyncClient:
    return gateway[1]


@pytest.fixture
def request_id() -> str:
    return f"dash-{uuid.uuid4().hex}"


async def sse_events(response: httpx.Response) -> AsyncIterator[tuple[str, str]]:
    """``(event, data)`` of each server-sent event (comments skipped)."""
    kind, data = "", ""
    async for line in response.aiter_lines():
        if line.startswith("event: "):
            kind = line.removeprefix("event: ")
        elif line.startswith("data: "):
            data = line.removeprefix("data: ")
        elif line == "" and data:
            yield kind, data
            kind, data = "", ""


def chunk(request_id: str, seq: int, text: str) -> ChunkEvent:
    return ChunkEvent(request_id=request_id, seq=seq, text=text, token_ids=[seq])


def final(request_id: str, seq: int) -> FinalEvent:
    return FinalEvent(request_id=request_id, seq=seq, finish_reasons=["stop"], prompt_tokens=3, completion_tokens=seq)


async def log(admin: aioredis.Redis, *events: Event) -> None:
    """Write ``events`` to their request's replay log (and channel), as a worker does."""
    terminal = (FinalEvent,)
    await ReplayLog(admin).append(
        [LogEvent(e.request_id, e.seq, 1, encode_event(e), isinstance(e, terminal)) for e in events]
    )


async def subscribers(admin: aioredis.Redis, request_id: str) -> int:
    ((_, count),) = await admin.pubsub_numsub(events_channel(request_id))
    return int(count)


# --- the live snapshot -------------------------------------------------------------
async def test_live_sends_a_snapshot_at_once_and_then_every_second_the_same_to_every_watcher(
    gateway: tuple[FastAPI, httpx.AsyncClient],
) -> None:
    _, http = gateway

    async def watch() -> list[dict[str, Any]]:
        got = []
        async with http.stream("GET", "/dashboard/api/live") as response:
            assert response.status_code == 200
            assert response.headers["content-type"].startswith("text/event-stream")
            async for kind, data in sse_events(response):
                assert kind == "snapshot"
                got.append(json.loads(data))
                if len(got) == 3:
                    break
        return got

    first, second = await asyncio.gather(watch(), watch())
    for snapshots in (first, second):
        assert set(snapshots[0]) == {
            "now_ms",
            "window_s",
            "models",
            "workers",
            "running",
            "recent",
            "redis_memory",
            "batches",
        }
        stamps = [s["now_ms"] for s in snapshots]
        assert stamps == sorted(stamps) and len(set(stamps)) >= 2
    # both watchers were sent the same readings (Redis's clock of each): one read of Redis
    # a second for all, not one each
    assert len({s["now_ms"] for s in first} & {s["now_ms"] for s in second}) >= 2


async def test_live_snapshots_carry_the_overviews_affinity_and_prefix_cache_figures(
    http: httpx.AsyncClient, admin: aioredis.Redis
) -> None:
    """Beside tokens/s and the latencies, the overview shows prefix-aware pickup's hit rate
    with its expired holds, and vLLM's prefix-cache hit rate: from a live worker's report,
    over the live stream."""
    name = f"dash-api-{uuid.uuid4().hex[:8]}"
    registration = WorkerRegistration(worker_id=name, model=name, queue=f"streamq:queue:{name}")
    report = WorkerStats(
        worker_id=name,
        model=name,
        queue=registration.queue,
        host="h",
        pid=1,
        started_ms=int(time.time() * 1000) - 1000,  # inside the window: its totals are the window's
        affinity_hits=3,
        affinity_misses=1,
        affinity_expired=2,
        prefix_cache_queries=512,
        prefix_cache_hits=128,
    )
    await WorkerRegistry(admin).register(registration, ttl_ms=120_000)
    await WorkerStatsStore(admin).report(report)
    try:
        async with asyncio.timeout(10), http.stream("GET", "/dashboard/api/live") as response:
            async for _, data in sse_events(response):
                snap = json.loads(data)
                rows = [m for m in snap["models"] if m["model"] == name]
                if rows:
                    break
    finally:
        await WorkerRegistry(admin).unregister(registration)
        await admin.hdel(WORKER_STATS_KEY, name)  # type: ignore[misc]
        await admin.zrem(WORKER_STATS_SEEN_KEY, name)
    (row,) = rows
    assert (row["affinity_hits"], row["affinity_misses"], row["affinity_expired"]) == (3, 1, 2)
    assert row["affinity_hit_rate"] == 0.75
    assert (row["prefix_cache_queries"], row["prefix_cache_hits"], row["prefix_cache_hit_rate"]) == (512, 128, 0.25)
    (worker,) = [w for w in snap["workers"] if w["worker_id"] == name]
    assert (worker["affinity_hits"], worker["affinity_misses"]) == (3, 1)


# --- one request ------------------------------------------------------------------
async def test_redis_memory_and_its_limit_are_on_metrics_and_the_overview_as_the_gateways_user_reads_them(
    http: httpx.AsyncClient, redis_server: RedisServer
) -> None:
    admin = aioredis.Redis.from_url(redis_server.url)
    limit = 1 << 30
    await admin.config_set("maxmemory", limit)
    try:
        metrics = (await http.get("/metrics")).text
        snapshot = (await http.get("/dashboard/api/snapshot")).json()
        used = int((await admin.info("memory"))["used_memory"])
    finally:
        await admin.config_set("maxmemory", 0)
        await admin.aclose()
    (scraped_limit,) = re.findall(r'^streamq_redis_memory_max_bytes\{policy="noeviction"\} (\S+)$', metrics, re.M)
    assert float(scraped_limit) == limit
    (scraped,) = re.findall(r"^streamq_redis_memory_used_bytes (\S+)$", metrics, re.M)
    assert 0.5 * used < float(scraped) < 2 * used
    memory = snapshot["redis_memory"]
    assert memory["max_bytes"] == limit and memory["policy"] == "noeviction"
    assert 0.5 * used < memory["used_bytes"] < 2 * used


async def test_events_replay_the_log_and_end_at_the_terminal_event(
    http: httpx.AsyncClient, admin: aioredis.Redis, request_id: str
) -> None:
    events: list[Event] = [chunk(request_id, 0, "Hel"), chunk(request_id, 1, "lo"), final(request_id, 2)]
    await log(admin, *events)
    async with http.stream("GET", f"/dashboard/api/requests/{request_id}/events") as response:
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
        got = [(kind, json.loads(data)) async for kind, data in sse_events(response)]  # ends by itself
    assert got == [(e.__struct_config__.tag, json.loads(encode_event(e))) for e in events]
    assert [kind for kind, _ in got] == ["chunk", "chunk", "final"]


async def test_events_go_on_live_after_the_log_and_closing_the_stream_unsubscribes(
    http: httpx.AsyncClient, admin: aioredis.Redis, request_id: str
) -> None:
    await log(admin, chunk(request_id, 0, "a"))
    async with http.stream("GET", f"/dashboard/api/requests/{request_id}/events") as response:
        stream = sse_events(response)
        assert (await anext(stream))[0] == "chunk"
        await log(admin, chunk(request_id, 1, "b"))
        kind, data = await anext(stream)
        assert (kind, json.loads(data)["text"]) == ("chunk", "b")
        assert await subscribers(admin, request_id) == 1
    # the tab closed before the request ended: the gateway stops following it
    async with asyncio.timeout(10):
        while await subscribers(admin, request_id):
            await asyncio.sleep(0.05)

    other = f"{request_id}-2"
    await log(admin, chunk(other, 0, "a"))
    async with http.stream("GET", f"/dashboard/api/requests/{other}/events") as response:
        stream = sse_events(response)
        await anext(stream)
        await log(admin, final(other, 1))
        assert (await anext(stream))[0] == "final"
        with pytest.raises(StopAsyncIteration):
            await anext(stream)


async def test_unknown_and_malformed_request_ids(http: httpx.AsyncClient, request_id: str) -> None:
    for path in (f"/dashboard/api/requests/{request_id}", f"/dashboard/api/requests/{request_id}/events"):
        response = await http.get(path)
        assert response.status_code == 404, path
        assert response.json()["error"]["code"] == "request_not_found"
    for method, path in (
        ("GET", "/dashboard/api/requests/bad%20id"),
        ("GET", "/dashboard/api/requests/bad%20id/events"),
        ("POST", "/dashboard/api/requests/bad%20id/cancel"),
    ):
        response = await http.request(method, path)
        assert response.status_code == 400, path
        assert response.json()["error"]["param"] == "request_id"
    response = await http.post(f"/dashboard/api/requests/{request_id}/cancel")
    assert response.json() == {"request_id": request_id, "cancelled": False}


async def test_status_and_cancel_of_a_queued_request(
    http: httpx.AsyncClient, redis_url: str, parked_model: WorkerRegistration
) -> None:
    async with await StreamqClient.connect(redis_url) as client:
        handle = await client.submit(model=parked_model.model, prompt="hi")
        await handle.close()
    request_id = handle.request_id
    status = (await http.get(f"/dashboard/api/requests/{request_id}")).json()
    assert (status["state"], status["queue"], status["position"]) == ("queued", parked_model.queue, 1)

    response = await http.post(f"/dashboard/api/requests/{request_id}/cancel")
    assert response.status_code == 200
    assert response.json() == {"request_id": request_id, "cancelled": True}
    status = (await http.get(f"/dashboard/api/requests/{request_id}")).json()
    assert (status["state"], status["finish_reasons"]) == ("finished", ["cancelled"])
    async with http.stream("GET", f"/dashboard/api/requests/{request_id}/events") as events:
        got = [(kind, json.loads(data)) async for kind, data in sse_events(events)]
    assert [(kind, data["finish_reasons"]) for kind, data in got] == [("final", ["cancelled"])]
    again = await http.post(f"/dashboard/api/requests/{request_id}/cancel")
    assert again.json() == {"request_id": request_id, "cancelled": False}


# --- the page ---------------------------------------------------------------------
async def test_the_page_and_its_files_are_served_from_the_static_folder(
    redis_server: RedisServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(routes, "STATIC_DIR", tmp_path / "static")
    async with gateway_client(redis_server.url_for(GATEWAY), api_keys=[OPERATOR_KEY]) as (_, http):
        # not installed: 404, and the gateway runs
        assert (await http.get("/dashboard")).status_code == 404
        assert (await http.get("/dashboard/static/dashboard.js")).status_code == 404
        (tmp_path / "static").mkdir()
        (tmp_path / "static" / "index.html").write_text("<title>streamq</title>")
        (tmp_path / "static" / "dashboard.js").write_text("let x = 1;")
        for path in ("/dashboard", "/dashboard/"):
            page = await http.get(path)  # public, though the gateway has keys: no data in it
            assert page.status_code == 200 and page.text == "<title>streamq</title>"
            assert page.headers["content-type"].startswith("text/html")
        script = await http.get("/dashboard/static/dashboard.js")
        assert script.status_code == 200 and script.text == "let x = 1;"
        assert (await http.get("/dashboard/static/missing.css")).status_code == 404


# --- who may read the data --------------------------------------------------------
@pytest.fixture
async def stored_key(admin: aioredis.Redis) -> AsyncIterator[str]:
    """A tenant's key stored in Redis; every key is removed afterwards (a Redis holding
    keys closes later tests' open gateways)."""
    secret = await ApiKeyStore(admin).create(KeyRecord(f"tenant-{uuid.uuid4().hex[:8]}"))
    yield secret
    await admin.delete(API_KEYS_KEY, API_KEY_NAMES_KEY)


async def test_an_open_gateway_opens_the_dashboard_to_everyone(http: httpx.AsyncClient) -> None:
    assert (await http.get("/dashboard/api/snapshot")).status_code == 200


async def test_only_an_operator_key_reads_the_dashboards_data(redis_server: RedisServer, stored_key: str) -> None:
    async with gateway_client(redis_server.url_for(GATEWAY), api_keys=[OPERATOR_KEY]) as (_, http):

        def bearer(key: str) -> dict[str, str]:
            return {"Authorization": f"Bearer {key}"}

        for path in ("/dashboard/api/snapshot", "/dashboard/api/requests/r1", "/dashboard/api/live"):
            missing = await http.get(path)
            assert missing.status_code == 401 and missing.json()["error"]["code"] == "invalid_api_key", path
            assert (await http.get(path, headers=bearer("wrong"))).status_code == 401, path
            forbidden = await http.get(path, headers=bearer(stored_key))
            assert forbidden.status_code == 403, path
            error = forbidden.json()["error"]
            assert error["code"] == "dashboard_forbidden" and "command line" in error["message"]
        refused = await http.post("/dashboard/api/requests/r1/cancel", headers=bearer(stored_key))
        assert refused.status_code == 403
        assert (await http.get("/v1/models", headers=bearer(stored_key))).status_code == 200  # a good key elsewhere
        allowed = await http.get("/dashboard/api/snapshot", headers=bearer(OPERATOR_KEY))
        assert allowed.status_code == 200 and "models" in allowed.json()
        assert (await http.get("/dashboard/api/requests/r1", headers=bearer(OPERATOR_KEY))).status_code == 404
        for public in ("/dashboard", "/dashboard/static/dashboard.css"):
            assert (await http.get(public)).status_code not in (401, 403), public
