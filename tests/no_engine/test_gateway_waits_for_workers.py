"""A gateway (as the gateway role) whose model has no live worker, and no worker at all: its
requests are accepted and wait in the queue; a stream opens and carries keep-alive comments;
the waiting gauges count them; one that waits past the gateway's queue timeout ends with a
503 (an error event inside a stream already open), its job taken off the queue; a model past
its memory, or never seen, is refused at once. The real-worker side (a worker that starts
and serves them) is tests/real_engine/test_scale_from_zero.py."""

from __future__ import annotations

import asyncio
import json
import re
import time
import uuid
from collections.abc import AsyncIterator

import httpx
import pytest
import redis.asyncio as aioredis
from fastapi import FastAPI

from streamq.broker.registry import WorkerRegistry
from streamq.protocol import (
    IN_PROGRESS_PREFIX,
    JOB_KEY_PREFIX,
    FinalEvent,
    WorkerRegistration,
    decode_event,
    events_channel,
)
from streamq.protocol.names import queue_waiting_key
from streamq.protocol.script_calls import ClaimJobs
from streamq.protocol.scripts import Script
from tests.support.gateway_in_process import gateway_client

KEEPALIVE_S = 0.25
QUEUE_TIMEOUT_S = 1.5


@pytest.fixture
def queue() -> str:
    return f"streamq:queue:zero-{uuid.uuid4().hex[:8]}"


@pytest.fixture
async def gateway(gateway_url: str, queue: str) -> AsyncIterator[tuple[FastAPI, httpx.AsyncClient]]:
    """A gateway that takes requests for 'declared' (on ``queue``) with no worker ever seen."""
    async with gateway_client(
        gateway_url,
        keepalive_s=KEEPALIVE_S,
        queue_timeout_s=QUEUE_TIMEOUT_S,
        declared_models={"declared": queue},
        model_memory_s=3600,
    ) as served:
        yield served


async def stream_lines(
    http: httpx.AsyncClient, body: dict[str, object], headers: dict[str, str]
) -> AsyncIterator[tuple[float, str]]:
    """Each line of a streamed completion as it arrives, with its time since the POST."""
    sent = time.monotonic()
    async with http.stream("POST", "/v1/completions", json={**body, "stream": True}, headers=headers) as response:
        assert response.status_code == 200, await response.aread()
        async for line in response.aiter_lines():
            if line:
                yield time.monotonic() - sent, line


async def test_a_stream_for_a_model_with_no_worker_waits_with_keep_alives_then_ends_with_a_503_error(
    gateway: tuple[FastAPI, httpx.AsyncClient], raw_redis: aioredis.Redis, queue: str
) -> None:
    _, http = gateway
    request_id = f"zero-{uuid.uuid4().hex}"
    body = {"model": "declared", "prompt": "Hi", "max_tokens": 4}
    lines = [line async for line in stream_lines(http, body, {"x-streamq-request-id": request_id})]
    keepalives = [at for at, line in lines if line == ": keep-alive"]
    assert len(keepalives) >= 3, lines
    assert keepalives[0] < KEEPALIVE_S * 3  # the stream opened without its first event
    gaps = [b - a for a, b in zip(keepalives, keepalives[1:], strict=False)]
    assert max(gaps) < KEEPALIVE_S * 3
    *_, (ended_at, error), (_, done) = lines
    assert done == "data: [DONE]"
    assert ended_at >= QUEUE_TIMEOUT_S
    body = json.loads(error.removeprefix("data: "))["error"]
    assert body["code"] == "queue_timeout"
    assert "no worker of model 'declared' started the request within 1.5 s" in body["message"]
    # Its request ended once, with the protocol's own reason, and left the queue and the signal.
    logged = [decode_event(entry[b"event"]) for _, entry in await raw_redis.xrange(events_channel(request_id))]
    assert len(logged) == 1 and isinstance(logged[0], FinalEvent)
    assert logged[0].finish_reasons == ["queue_timeout"]
    assert not await raw_redis.exists(JOB_KEY_PREFIX + request_id)
    assert await raw_redis.zcard(queue) == 0
    assert await raw_redis.zcard(queue_waiting_key(queue)) == 0


async def test_a_whole_response_that_waited_past_the_bound_is_a_503_with_retry_after(
    gateway: tuple[FastAPI, httpx.AsyncClient], raw_redis: aioredis.Redis, queue: str
) -> None:
    _, http = gateway
    request_id = f"zero-{uuid.uuid4().hex}"
    started = time.monotonic()
    response = await http.post(
        "/v1/completions",
        json={"model": "declared", "prompt": "Hi", "max_tokens": 4},
        headers={"x-streamq-request-id": request_id},
    )
    assert time.monotonic() - started >= QUEUE_TIMEOUT_S
    assert response.status_code == 503
    assert int(response.headers["retry-after"]) > 0
    assert response.json()["error"]["code"] == "queue_timeout"
    logged = [decode_event(entry[b"event"]) for _, entry in await raw_redis.xrange(events_channel(request_id))]
    assert len(logged) == 1 and isinstance(logged[0], FinalEvent)
    assert logged[0].finish_reasons == ["queue_timeout"]
    assert not await raw_redis.exists(JOB_KEY_PREFIX + request_id)
    assert await raw_redis.zcard(queue) == 0


async def test_the_gauges_count_the_requests_waiting_for_a_worker_and_the_oldest_wait(
    gateway: tuple[FastAPI, httpx.AsyncClient], queue: str
) -> None:
    _, http = gateway
    body = {"model": "declared", "prompt": "Hi", "max_tokens": 4}
    waiting = [asyncio.ensure_future(http.post("/v1/completions", json=body)) for _ in range(3)]
    try:
        await asyncio.sleep(0.5)
        metrics = (await http.get("/metrics")).text
        labels = f'model="declared",queue="{queue}"'
        assert re.search(rf"^streamq_requests_waiting\{{{labels}\}} 3\.0$", metrics, re.M), metrics
        (oldest,) = re.findall(rf"^streamq_oldest_waiting_seconds\{{{labels}\}} (\S+)$", metrics, re.M)
        assert 0.3 <= float(oldest) < QUEUE_TIMEOUT_S
    finally:
        responses = await asyncio.gather(*waiting)
    assert [response.status_code for response in responses] == [503] * 3
    metrics = (await http.get("/metrics")).text
    assert f'streamq_requests_waiting{{model="declared",queue="{queue}"}} 0.0' in metrics


async def test_a_model_is_listed_and_takes_requests_within_its_memory_and_is_refused_past_it(
    gateway_url: str, redis_url: str, queue: str
) -> None:
    admin = aioredis.Redis.from_url(redis_url)
    try:
        registration = WorkerRegistration(worker_id=f"w-{uuid.uuid4().hex[:6]}", model="gone-model", queue=queue)
        registry = WorkerRegistry(admin)
        await registry.register(registration)
        await registry.unregister(registration)  # its last worker stopped: scaled to zero
    finally:
        await admin.aclose()
    body = {"model": "gone-model", "prompt": "Hi", "max_tokens": 4}
    async with gateway_client(gateway_url, queue_timeout_s=0.3, model_memory_s=3600) as (_, http):
        listed = (await http.get("/v1/models")).json()["data"]
        assert {"id": "gone-model", "workers": 0}.items() <= {m["id"]: m for m in listed}["gone-model"].items()
        response = await http.post("/v1/completions", json=body)
        assert response.status_code == 503  # it waited, and no worker came
        assert response.json()["error"]["code"] == "queue_timeout"
        unknown = await http.post("/v1/completions", json={**body, "model": "never-seen"})
        assert unknown.status_code == 404
    async with gateway_client(gateway_url, model_memory_s=0) as (_, http):
        assert "gone-model" not in {m["id"] for m in (await http.get("/v1/models")).json()["data"]}
        refused = await http.post("/v1/completions", json=body)
        assert refused.status_code == 503
        assert refused.json()["error"]["code"] == "no_live_worker"
        assert int(refused.headers["retry-after"]) > 0


async def test_the_gateway_counts_a_dead_workers_request_as_waiting_once_its_lease_lapses(
    gateway: tuple[FastAPI, httpx.AsyncClient], raw_redis: aioredis.Redis, queue: str
) -> None:
    _, http = gateway
    waiting = asyncio.ensure_future(http.post("/v1/completions", json={"model": "declared", "prompt": "Hi"}))
    try:
        labels = f'model="declared",queue="{queue}"'
        async with asyncio.timeout(5):
            while f"streamq_requests_waiting{{{labels}}} 1.0" not in (await http.get("/metrics")).text:
                await asyncio.sleep(0.05)
        claim = ClaimJobs(  # a worker takes it, with a 200 ms lease, and dies
            queue=queue, wanted=1, lease_ms=200, page=100, in_progress_prefix=IN_PROGRESS_PREFIX, worker_id="doomed"
        )
        await Script(raw_redis, ClaimJobs)(claim)
        assert await raw_redis.zcard(queue_waiting_key(queue)) == 0
        async with asyncio.timeout(5):  # the gateway's tending notices the lapse: no worker claims
            while await raw_redis.zcard(queue_waiting_key(queue)) == 0:
                await asyncio.sleep(0.05)
        assert f"streamq_requests_waiting{{{labels}}} 1.0" in (await http.get("/metrics")).text
    finally:
        assert (await waiting).status_code == 503
