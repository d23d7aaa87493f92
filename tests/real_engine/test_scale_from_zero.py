"""Scale to zero and back with real processes: Redis, the gateway and workers each a service
of its own, the tiny model on vLLM's engine.

A worker serves its model, then stops: nothing serves it. Streaming requests for it are
accepted and wait, their streams kept open by keep-alive comments; the gauges and the key
KEDA's redis scaler reads count them; the worker that starts next serves every one with the
bare engine's text, and the signal falls back to zero. Then, with a second worker, the
first is stopped (SIGTERM, as Kubernetes scales it down) under load while the other runs:
each request ends once, with the text of an undisturbed run.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis.asyncio as aioredis

from devkit.gateway_process import GatewayProcess
from devkit.keda import LIST_LENGTH_SCRIPT
from devkit.redis_server import free_port
from devkit.worker_process import WorkerProcess, tiny_engine_flags
from producer.client import StreamqClient
from streamq.protocol.names import queue_waiting_key
from tests.support.events import assert_well_formed
from tests.support.reference_generate import MAX_TOKENS, PROMPTS
from tests.support.session import MAX_MODEL_LEN

MODEL = "tiny-zero"
QUEUE = "streamq:queue:tiny-zero"
KEEPALIVE_S = 1.0
LONG_TOKENS = 700
"""Each request of the scale-down: long enough that a worker stopped once they all stream
is stopped mid-stream."""
MAX_JOBS = 4
"""Requests each of the next workers runs at once."""


def start_worker(worker_url: str, tiny_model: Path, log_path: Path, *extra: str) -> WorkerProcess:
    flags = [*tiny_engine_flags(tiny_model, max_model_len=MAX_MODEL_LEN), "--served-model-name", MODEL, *extra]
    return WorkerProcess(worker_url, flags, queue=QUEUE, log_path=log_path, metrics_port=free_port()).start()


@pytest.fixture(scope="module")
def zero_gateway(gateway_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayProcess]:
    log_path = tmp_path_factory.mktemp("zero-gateway") / "gateway.log"
    process = GatewayProcess(gateway_url, log_path, "--sse-keepalive-s", str(KEEPALIVE_S)).wait_ready()
    yield process
    assert process.stop() == 0, process.log_tail()


@pytest.fixture(scope="module")
def served_then_stopped(worker_url: str, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> str:
    """A worker served ``MODEL``, then stopped (its log)."""
    worker = start_worker(worker_url, tiny_model, tmp_path_factory.mktemp("first") / "worker.log").wait_ready()
    assert worker.stop() == 0, worker.log_tail()
    return worker.log_tail()


class NextWorkers:
    """The workers that start once requests wait, one after the other (an engine's start
    takes both cores here): the first stops at once on SIGTERM (no drain), as a
    scale-down under load does to a pod. Each runs at most ``MAX_JOBS`` requests (and holds
    none waiting in its engine), so twice that many are split between two of them: one
    worker's claim takes a whole free batch's worth in one pass."""

    def __init__(self, worker_url: str, tiny_model: Path, folder: Path) -> None:
        self._worker_url, self._tiny_model, self._folder = worker_url, tiny_model, folder
        self.started: list[WorkerProcess] = []

    def start(self, count: int) -> list[WorkerProcess]:
        """The first ``count`` of them, started (and ready: its own /ready) as needed."""
        while len(self.started) < count:
            extra = ["--max-jobs", str(MAX_JOBS), *(["--drain-seconds", "0"] if not self.started else [])]
            log_path = self._folder / f"worker-{len(self.started)}.log"
            self.started.append(start_worker(self._worker_url, self._tiny_model, log_path, *extra).wait_ready())
        return self.started


@pytest.fixture(scope="module")
def next_workers(worker_url: str, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[NextWorkers]:
    workers = NextWorkers(worker_url, tiny_model, tmp_path_factory.mktemp("next"))
    yield workers
    for worker in workers.started:
        assert worker.stop() == 0, worker.log_tail()


async def stream(http: httpx.AsyncClient, prompt: str) -> dict[str, Any]:
    """One streamed completion as its client reads it: the keep-alives, and the text."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True}
    keepalives, texts, finish = 0, [], None
    async with http.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200, await response.aread()
        async for line in response.aiter_lines():
            if line == ": keep-alive":
                keepalives += 1
            elif line.startswith("data: {"):
                choice = json.loads(line.removeprefix("data: "))["choices"][0]
                texts.append(choice["text"])
                finish = choice["finish_reason"] or finish
    return {"keepalives": keepalives, "text": "".join(texts), "finish_reason": finish}


def gauge(metrics: str, name: str) -> float:
    (value,) = re.findall(rf'^{name}\{{model="{MODEL}",queue="{QUEUE}"\}} (\S+)$', metrics, re.M)
    return float(value)


async def test_requests_wait_with_no_worker_and_the_next_worker_serves_them_with_the_bare_engines_text(
    served_then_stopped: str,
    zero_gateway: GatewayProcess,
    next_workers: NextWorkers,
    reference_outputs: dict[str, dict],
    raw_redis: aioredis.Redis,
) -> None:
    prompts = [*PROMPTS, PROMPTS[0]]
    async with httpx.AsyncClient(base_url=zero_gateway.url, timeout=300) as http:
        assert MODEL in {m["id"]: m for m in (await http.get("/v1/models")).json()["data"]}  # 0 workers, listed
        streams = [asyncio.ensure_future(stream(http, prompt)) for prompt in prompts]
        async with asyncio.timeout(30):
            while gauge(metrics := (await http.get("/metrics")).text, "streamq_requests_waiting") < len(prompts):
                await asyncio.sleep(0.1)
        await asyncio.sleep(2 * KEEPALIVE_S)
        metrics = (await http.get("/metrics")).text
        assert gauge(metrics, "streamq_requests_waiting") == len(prompts)
        assert gauge(metrics, "streamq_oldest_waiting_seconds") >= 2 * KEEPALIVE_S
        keda = raw_redis.register_script(LIST_LENGTH_SCRIPT)
        assert await keda(keys=[queue_waiting_key(QUEUE)]) == len(prompts)
        assert not any(task.done() for task in streams)

        started_at = time.monotonic()
        await asyncio.to_thread(next_workers.start, 1)
        results = await asyncio.gather(*streams)
        served_s = time.monotonic() - started_at
        for prompt, result in zip(prompts, results, strict=True):
            assert result["keepalives"] >= 2, result  # the stream stayed open while it waited
            assert result["text"] == reference_outputs[prompt]["text"]
        metrics = (await http.get("/metrics")).text
    assert gauge(metrics, "streamq_requests_waiting") == 0
    assert gauge(metrics, "streamq_oldest_waiting_seconds") == 0
    assert await raw_redis.zcard(queue_waiting_key(QUEUE)) == 0
    assert served_s < 300


async def test_a_worker_stopped_under_load_while_another_runs_hands_each_request_over_exactly(
    next_workers: NextWorkers, producer_url: str, redis_url: str
) -> None:
    stopping, staying = await asyncio.to_thread(next_workers.start, 2)
    async with await StreamqClient.connect(producer_url) as client:
        request = {"model": MODEL, "max_tokens": LONG_TOKENS, "ignore_eos": True, "temperature": 0}
        count = 2 * MAX_JOBS
        ids = [f"down-{i}-{uuid.uuid4().hex[:6]}" for i in range(count)]
        handles = [await client.submit(prompt=PROMPTS[i % 3], request_id=ids[i], **request) for i in range(count)]
        events: dict[str, list[Any]] = {request_id: [] for request_id in ids}

        async def read(handle: Any) -> None:
            async for event in handle:
                events[handle.request_id].append(event)

        readers = [asyncio.ensure_future(read(handle)) for handle in handles]
        async with asyncio.timeout(60):  # every request streams: each worker holds MAX_JOBS
            while not all(events.values()):
                await asyncio.sleep(0.02)
        assert await asyncio.to_thread(stopping.stop) == 0, stopping.log_tail()
        async with asyncio.timeout(180):
            await asyncio.gather(*readers)
        handed = [request_id for request_id in ids if request_id in Path(stopping.log_path).read_text()]
        assert len(handed) == MAX_JOBS, f"the stopped worker ran {handed}"
        calm = {
            prompt: await client.generate(prompt=prompt, request_id=f"calm-{uuid.uuid4().hex}", **request)
            for prompt in PROMPTS
        }
    raw = aioredis.Redis.from_url(redis_url)
    try:
        for i, request_id in enumerate(ids):
            logged = [json.loads(entry[b"event"]) for _, entry in await raw.xrange(f"streamq:events:{request_id}")]
            assert_well_formed(logged, request_id)  # contiguous, one end
            text = "".join(event.get("text", "") for event in logged if event["type"] == "chunk")
            assert text == calm[PROMPTS[i % 3]].text
            assert logged[-1]["type"] == "final" and logged[-1]["completion_tokens"] == LONG_TOKENS
    finally:
        await raw.aclose()
    assert staying.process is not None and staying.process.poll() is None
