"""Many models: workers register their served model and queue, producers route by
model name; and the bounded queue. Real workers (a second one serves the same tiny
model under another name, on its own queue), real Redis."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
import redis.asyncio as aioredis

from devkit.gateway_process import GatewayProcess
from devkit.worker_process import WorkerProcess, tiny_engine_flags
from producer.client import StreamqClient
from producer.errors import NoLiveWorker, QueueFull, RequestError, UnknownModel
from producer.internal_client import InternalClient
from streamq.broker.registry import WorkerRegistry
from streamq.protocol import DEFAULT_QUEUE, JOB_KEY_PREFIX, MODELS_KEY, WorkerRegistration
from tests.support.session import MAX_MODEL_LEN

MODEL_B = "tiny-b"
QUEUE_B = "streamq:queue:tiny-b"


@pytest.fixture(scope="module")
def worker_b(
    worker: WorkerProcess, worker_url: str, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[WorkerProcess]:
    """A second worker: the same weights served as ``tiny-b``, on a queue of its own."""
    flags = [*tiny_engine_flags(tiny_model, max_model_len=MAX_MODEL_LEN), "--served-model-name", MODEL_B]
    log_path = tmp_path_factory.mktemp("worker-b") / "worker.log"
    process = WorkerProcess(worker_url, flags, queue=QUEUE_B, log_path=log_path)
    process.start().wait_ready()
    yield process
    assert process.stop() == 0, process.log_tail()


@pytest.fixture(scope="module")
def gateway(
    worker: WorkerProcess, gateway_url: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[GatewayProcess]:
    process = GatewayProcess(gateway_url, tmp_path_factory.mktemp("gateway") / "gateway.log").wait_ready()
    yield process
    assert process.stop() == 0, process.log_tail()


def run_producer(redis_url: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "REDIS_URL": redis_url}
    return subprocess.run(
        [sys.executable, "-m", "producer", *args], capture_output=True, text=True, env=env, timeout=120
    )


async def test_each_live_model_is_listed_with_its_queue(
    worker_b: WorkerProcess, client: InternalClient, tiny_model: Path, gateway: GatewayProcess
) -> None:
    live = await client.live_models()
    assert live[str(tiny_model)] == DEFAULT_QUEUE
    assert live[MODEL_B] == QUEUE_B
    sdk = openai.AsyncOpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0)
    assert {str(tiny_model), MODEL_B} <= {m.id for m in (await sdk.models.list()).data}
    await sdk.close()


async def logged(worker: WorkerProcess, request_id: str) -> None:
    """Wait until ``worker`` logs ``request_id`` (its line as the request ends, written once
    its end is settled: after its client has it)."""
    async with asyncio.timeout(10):
        while request_id not in worker.log_path.read_text():
            await asyncio.sleep(0.05)


async def test_requests_reach_the_worker_of_their_model(
    worker: WorkerProcess, worker_b: WorkerProcess, client: InternalClient, tiny_model: Path, gateway: GatewayProcess
) -> None:
    for_a, for_b = f"route-a-{uuid.uuid4().hex}", f"route-b-{uuid.uuid4().hex}"
    sdk = openai.AsyncOpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0)
    through_gateway = await sdk.completions.create(
        model=MODEL_B, prompt="Hello", max_tokens=4, extra_headers={"x-streamq-request-id": for_b}
    )
    await sdk.close()
    direct = await (
        await client.submit("Hello", model=str(tiny_model), request_id=for_a, max_tokens=4, ignore_eos=True)
    ).result()
    assert through_gateway.model == MODEL_B and through_gateway.usage is not None
    assert direct.completion_tokens == 4
    await logged(worker_b, for_b)
    await logged(worker, for_a)
    assert for_b not in worker.log_path.read_text() and for_a not in worker_b.log_path.read_text()


def test_cli_routes_by_model(worker_b: WorkerProcess, producer_url: str) -> None:
    request_id = f"cli-model-{uuid.uuid4().hex}"
    result = run_producer(
        producer_url, "--model", MODEL_B, "--max-tokens", "4", "--request-id", request_id, "--json", "Hello"
    )
    assert result.returncode == 0, result.stderr
    asyncio.run(logged(worker_b, request_id))


def test_cli_names_an_unknown_model(worker: WorkerProcess, producer_url: str) -> None:
    result = run_producer(producer_url, "--model", "no-such-model", "Hello")
    assert result.returncode == 1
    assert "no worker serves model 'no-such-model'" in result.stderr


async def test_a_worker_refuses_a_request_for_a_model_it_does_not_serve(
    worker_b: WorkerProcess, client: InternalClient, raw_redis: aioredis.Redis, gateway: GatewayProcess
) -> None:
    """Two models on one queue (a misconfiguration): the request names its model, and
    the worker of the other model refuses it rather than answer with the wrong one."""
    imposter = f"imposter-{uuid.uuid4().hex[:8]}"
    registration = WorkerRegistration(worker_id=imposter, model=imposter, queue=QUEUE_B)
    registry = WorkerRegistry(raw_redis)
    await registry.register(registration, ttl_ms=600_000)
    sdk = openai.AsyncOpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0)
    try:
        with pytest.raises(RequestError) as caught:
            await (await client.submit("Hello", model=imposter, max_tokens=4)).result()
        with pytest.raises(openai.BadRequestError) as through_gateway:
            await sdk.completions.create(model=imposter, prompt="Hello", max_tokens=4)
    finally:
        await sdk.close()
        await registry.unregister(registration)
        await raw_redis.hdel(MODELS_KEY, imposter)
    expected = f"request for model {imposter!r} reached a worker serving model {MODEL_B!r}"
    assert caught.value.code == "invalid_request" and expected in caught.value.message
    assert expected in through_gateway.value.message


async def test_batch_routes_each_line_by_its_model(
    worker: WorkerProcess, worker_b: WorkerProcess, tiny_model: Path, tmp_path: Path, producer_url: str
) -> None:
    lines = [
        {"custom_id": "a", "model": str(tiny_model)},
        {"custom_id": "b", "model": MODEL_B},
        {"custom_id": "nobody", "model": "no-such-model"},
    ]
    in_path, out_path = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    in_path.write_text(
        "".join(
            json.dumps(
                {
                    "custom_id": line["custom_id"],
                    "method": "POST",
                    "url": "/v1/completions",
                    "body": {"model": line["model"], "prompt": "Hello", "max_tokens": 3},
                }
            )
            + "\n"
            for line in lines
        )
    )
    result = await asyncio.to_thread(run_producer, producer_url, "batch", str(in_path), str(out_path), "--no-progress")
    assert result.returncode == 1, result.stderr  # the unknown model's line failed
    out = {line["custom_id"]: line for line in map(json.loads, out_path.read_text().splitlines())}
    a, b = out["a"]["response"], out["b"]["response"]
    assert a["status_code"] == b["status_code"] == 200
    assert a["body"]["model"] == str(tiny_model) and b["body"]["model"] == MODEL_B
    await logged(worker, a["request_id"])
    await logged(worker_b, b["request_id"])
    assert a["request_id"] not in worker_b.log_path.read_text() and b["request_id"] not in worker.log_path.read_text()
    assert out["nobody"]["response"]["status_code"] == 404
    assert "no worker serves model 'no-such-model'" in out["nobody"]["error"]


async def test_a_stopped_worker_leaves_the_registry_and_its_model_waits_for_the_next_within_its_memory(
    worker_b: WorkerProcess, client: InternalClient, producer_url: str
) -> None:
    assert MODEL_B in await client.live_models()
    assert worker_b.stop() == 0
    assert MODEL_B not in await client.live_models()
    async with await client.submit("Hello", model=MODEL_B) as waiting:  # queued for tiny-b's next worker
        assert waiting.job_queue == QUEUE_B
        assert (await client.status(waiting.request_id)).state == "queued"
        assert await waiting.cancel() == "queued"
    async with await StreamqClient.connect(producer_url, model_memory_s=0) as forgetful:
        with pytest.raises(NoLiveWorker, match="no live worker serves model 'tiny-b'"):
            await forgetful.submit("Hello", model=MODEL_B)


async def test_submit_to_a_model_nobody_ever_served_is_refused(client: InternalClient) -> None:
    with pytest.raises(UnknownModel, match="no-such-model"):
        await client.submit("Hello", model="no-such-model")


async def test_a_full_queue_refuses_at_once_and_stores_nothing(
    worker: WorkerProcess, parked_model: WorkerRegistration, producer_url: str
) -> None:
    async with await InternalClient.connect(producer_url, max_queue_depth=2) as client:
        handles = [await client.submit("Hello", model=parked_model.model) for _ in range(2)]
        refused_id = f"refused-{uuid.uuid4().hex}"
        with pytest.raises(QueueFull, match="limit"):
            await client.submit("Hello", model=parked_model.model, request_id=refused_id)
        assert await client.redis.zcard(parked_model.queue) == 2
        assert not await client.redis.exists(JOB_KEY_PREFIX + refused_id)
        assert await handles[0].cancel() == "queued"  # room again for one
        await client.submit("Hello", model=parked_model.model)
        assert await client.redis.zcard(parked_model.queue) == 2


def test_cli_max_queue_depth(
    worker: WorkerProcess, parked_model: WorkerRegistration, producer_url: str, redis_url: str
) -> None:
    result = run_producer(producer_url, "--queue", parked_model.queue, "--max-queue-depth", "0", "Hello")
    assert result.returncode == 1
    assert f"queue {parked_model.queue} already holds 0 jobs" in result.stderr
    assert asyncio.run(_zcard(redis_url, parked_model.queue)) == 0


async def _zcard(redis_url: str, key: str) -> int:
    client = aioredis.Redis.from_url(redis_url)
    try:
        return int(await client.zcard(key))
    finally:
        await client.aclose()


def test_the_worker_logs_the_scheduler_limits_it_runs_with(worker: WorkerProcess) -> None:
    lines = [line for line in worker.log_path.read_text().splitlines() if "scheduler limits:" in line]
    assert len(lines) == 1, worker.log_tail()
    limits = dict(pair.split("=", 1) for pair in lines[0].split("scheduler limits:", 1)[1].split())
    assert limits["max_model_len"] == str(MAX_MODEL_LEN)
    assert {"max_num_seqs", "max_num_batched_tokens", "enable_chunked_prefill", "async_scheduling"} <= limits.keys()
