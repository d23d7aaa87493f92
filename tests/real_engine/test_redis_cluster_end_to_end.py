"""A deployment whose data plane is a local 3-shard Redis Cluster, every component told so
by ``$STREAMQ_EVENTS_REDIS_URL`` alone: a worker on the tiny model, the library and the
gateway stream exactly what a bare AsyncLLM generates, with each request's events on its
shard and nothing of them on the control plane's Redis."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
import redis.asyncio as aioredis

from devkit.gateway_process import GatewayProcess
from devkit.redis_cluster import RedisCluster
from devkit.redis_server import RedisServer
from devkit.worker_process import WorkerProcess, tiny_engine_flags, worker_env
from producer.client import StreamqClient
from streamq.broker.data_plane import CLUSTER
from streamq.env_vars import EVENTS_REDIS_URL_ENV
from streamq.protocol import events_channel
from tests.support.reference_generate import MAX_TOKENS, PROMPTS
from tests.support.session import MAX_MODEL_LEN


@pytest.fixture(scope="module")
def cluster() -> Iterator[RedisCluster]:
    with RedisCluster(primaries=3) as started:
        yield started


@pytest.fixture(scope="module")
def control() -> Iterator[RedisServer]:
    with RedisServer() as server:
        yield server


@pytest.fixture(scope="module")
def cluster_env(cluster: RedisCluster) -> dict[str, str]:
    return {EVENTS_REDIS_URL_ENV: cluster.url}


@pytest.fixture(scope="module")
def cluster_worker(
    control: RedisServer, cluster_env: dict[str, str], tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[WorkerProcess]:
    log_path = tmp_path_factory.mktemp("cluster-worker") / "worker.log"
    flags = tiny_engine_flags(tiny_model, max_model_len=MAX_MODEL_LEN)
    process = WorkerProcess(control.url, flags, log_path=log_path, env=worker_env(**cluster_env))
    process.start().wait_ready()
    yield process
    assert process.stop() == 0, process.log_tail()


@pytest.fixture(scope="module")
def cluster_gateway(
    cluster_worker: WorkerProcess,
    control: RedisServer,
    cluster_env: dict[str, str],
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[GatewayProcess]:
    log_path = tmp_path_factory.mktemp("cluster-gateway") / "gateway.log"
    process = GatewayProcess(control.url, log_path, env=cluster_env).wait_ready()
    yield process
    assert process.stop() == 0, process.log_tail()


async def test_the_library_streams_what_a_bare_engine_generates_with_events_on_the_cluster(
    cluster_worker: WorkerProcess,
    control: RedisServer,
    cluster: RedisCluster,
    cluster_env: dict[str, str],
    monkeypatch: pytest.MonkeyPatch,
    reference_outputs: dict[str, dict[str, Any]],
) -> None:
    monkeypatch.setenv(EVENTS_REDIS_URL_ENV, cluster.url)  # as every component reads it
    async with await StreamqClient.connect(control.url) as client:
        handles = [await client.submit(prompt, max_tokens=MAX_TOKENS, temperature=0.0) for prompt in PROMPTS]
        completions = await asyncio.wait_for(asyncio.gather(*(h.result() for h in handles)), timeout=120)
    async with aioredis.Redis.from_url(control.url) as plain:
        for prompt, handle, completion in zip(PROMPTS, handles, completions, strict=True):
            assert completion.token_ids[0] == reference_outputs[prompt]["token_ids"]
            assert completion.text == reference_outputs[prompt]["text"]
            shard = cluster.primary_of(CLUSTER.events(handle.request_id))
            async with aioredis.Redis(port=shard.port) as node:
                assert await node.xlen(CLUSTER.events(handle.request_id)) >= 2
            assert not await plain.exists(events_channel(handle.request_id))


def test_the_gateway_streams_what_a_bare_engine_generates_with_events_on_the_cluster(
    cluster_gateway: GatewayProcess, tiny_model: Path, reference_outputs: dict[str, dict[str, Any]]
) -> None:
    with openai.OpenAI(base_url=cluster_gateway.url + "/v1", api_key="unused", max_retries=0, timeout=120) as sdk:
        for prompt in PROMPTS:
            stream = sdk.completions.create(
                model=str(tiny_model), prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, stream=True
            )
            text = "".join(chunk.choices[0].text for chunk in stream if chunk.choices)
            assert text == reference_outputs[prompt]["text"]
