"""API keys at the gateway, as an operator sets them up and a client meets them: real
gateway processes, a real Redis of their own, a real worker on the scripted engine, keys
made with the ``streamq keys`` command line. The real engine behind a keyed gateway, with
the ``openai`` SDK and ``vllm bench serve`` giving the key: tests/real_engine/test_gateway.py.

The scripted engine counts 4 prompt tokens for any prompt and makes one token per step
at 100 steps/s, so token budgets and stream lengths below are exact.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import redis.asyncio as aioredis
from prometheus_client.parser import text_string_to_metric_families

from devkit.gateway_process import GatewayProcess
from devkit.redis_server import RedisServer
from devkit.worker_process import SCRIPTED_MODEL, WorkerProcess, scripted_worker
from tests.support.key_commands import create_key, streamq_keys

MODEL = SCRIPTED_MODEL
PROMPT = "The key to happiness is"
STATIC_KEY = "sq-static-" + uuid.uuid4().hex
SCRIPTED_PROMPT_TOKENS = 4


@pytest.fixture(scope="module")
def keys_redis() -> Iterator[RedisServer]:
    with RedisServer(user="streamq", password=uuid.uuid4().hex) as server:
        yield server


@pytest.fixture(scope="module")
def keys_worker(keys_redis: RedisServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[WorkerProcess]:
    worker = scripted_worker(keys_redis.url, tmp_path_factory.mktemp("worker") / "worker.log", tokens_per_s=100)
    worker.start().wait_ready(timeout_s=120)
    yield worker
    assert worker.stop() == 0, worker.log_tail()


@pytest.fixture(scope="module")
def gateway(keys_worker: WorkerProcess, tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayProcess]:
    log = tmp_path_factory.mktemp("gateway") / "gateway.log"
    process = GatewayProcess(keys_worker.redis_url, log, "--api-key", STATIC_KEY).wait_ready()
    yield process
    assert process.stop() == 0, process.log_tail()


@pytest.fixture(scope="module")
def second_gateway(keys_worker: WorkerProcess, tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayProcess]:
    """Another replica on the same Redis, with no key of its own on the command line: the
    keys in Redis close it (created first: an open gateway notices the first one within 5 s)."""
    create_key(keys_worker.redis_url)
    log = tmp_path_factory.mktemp("gateway") / "gateway.log"
    process = GatewayProcess(keys_worker.redis_url, log).wait_ready()
    yield process
    assert process.stop() == 0, process.log_tail()


@pytest.fixture
async def keys_raw_redis(keys_redis: RedisServer) -> AsyncIterator[aioredis.Redis]:
    client = aioredis.Redis.from_url(keys_redis.url)
    yield client
    await client.aclose()


def sdk(gateway: GatewayProcess, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=gateway.url + "/v1", api_key=key, max_retries=0, timeout=60)


def completion(gateway: GatewayProcess, key: str | None, **body: Any) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key is not None else {}
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 2, **body}
    return httpx.post(gateway.url + "/v1/completions", json=body, headers=headers, timeout=60)


async def wait_for_a_fresh_minute(redis: aioredis.Redis, needed_s: float = 15) -> None:
    """The rate windows are minutes of Redis's clock: start a budget test early in one."""
    seconds, _ = await redis.time()
    left = 60 - seconds % 60
    if left < needed_s:
        await asyncio.sleep(left + 0.2)


def test_v1_routes_refuse_a_missing_or_wrong_key_with_401(gateway: GatewayProcess) -> None:
    for key in (None, "sq-wrong", STATIC_KEY + "x", STATIC_KEY[:-1]):
        reply = completion(gateway, key)
        assert reply.status_code == 401, (key, reply.text)
        error = reply.json()["error"]
        assert error["code"] == "invalid_api_key" and error["type"] == "invalid_request_error"
        assert STATIC_KEY not in reply.text
    models = httpx.get(gateway.url + "/v1/models", timeout=10)
    assert models.status_code == 401
    with pytest.raises(openai.AuthenticationError):
        sdk(gateway, "sq-wrong").completions.create(model=MODEL, prompt=PROMPT, max_tokens=2)


def test_health_and_metrics_stay_open(gateway: GatewayProcess) -> None:
    assert httpx.get(gateway.url + "/health", timeout=10).status_code == 200
    assert httpx.get(gateway.url + "/metrics", timeout=10).status_code == 200


def test_the_right_key_serves_the_openai_sdk(gateway: GatewayProcess) -> None:
    client = sdk(gateway, STATIC_KEY)
    assert MODEL in [m.id for m in client.models.list().data]
    whole = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5)
    assert whole.choices[0].text == " tok" * 5 and whole.usage is not None and whole.usage.completion_tokens == 5
    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Hi"}], stream=True, max_tokens=3
        )
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == " tok" * 3


def test_protect_metrics_needs_a_key_on_metrics(keys_worker: WorkerProcess, tmp_path: Path) -> None:
    args = ("--api-key", STATIC_KEY, "--protect-metrics")
    process = GatewayProcess(keys_worker.redis_url, tmp_path / "gateway.log", *args).wait_ready()
    try:
        assert httpx.get(process.url + "/metrics", timeout=10).status_code == 401
        authorized = {"Authorization": f"Bearer {STATIC_KEY}"}
        assert httpx.get(process.url + "/metrics", headers=authorized, timeout=10).status_code == 200
        assert httpx.get(process.url + "/health", timeout=10).status_code == 200
    finally:
        assert process.stop() == 0, process.log_tail()


def test_keys_from_a_file_and_the_environment(keys_worker: WorkerProcess, tmp_path: Path) -> None:
    keys_file = tmp_path / "keys"
    keys_file.write_text("# team keys\nsq-from-file\n\n")
    env = {"STREAMQ_API_KEYS": "sq-env-1, sq-env-2"}
    process = GatewayProcess(keys_worker.redis_url, tmp_path / "gateway.log", "--api-key-file", str(keys_file), env=env)
    process.wait_ready()
    try:
        for key in ("sq-from-file", "sq-env-1", "sq-env-2"):
            assert completion(process, key).status_code == 200, key
        assert completion(process, "# team keys").status_code == 401
    finally:
        assert process.stop() == 0, process.log_tail()


def test_a_gateway_without_keys_is_open_and_says_so(tmp_path: Path) -> None:
    with RedisServer() as empty:
        process = GatewayProcess(empty.url, tmp_path / "gateway.log").wait_ready()
        try:
            assert httpx.get(process.url + "/v1/models", timeout=10).status_code == 200
            assert "serves anyone who can reach it" in process.log_tail()
        finally:
            assert process.stop() == 0, process.log_tail()


def test_a_stored_key_works_on_every_gateway_until_revoked(
    gateway: GatewayProcess, second_gateway: GatewayProcess, keys_redis: RedisServer
) -> None:
    name, secret = create_key(keys_redis.url, "--rpm", "1000")
    assert secret.startswith("sq-")
    for replica in (gateway, second_gateway):
        assert sdk(replica, secret).completions.create(model=MODEL, prompt=PROMPT, max_tokens=2).usage is not None
    listed = streamq_keys(keys_redis.url, "list")
    assert listed.returncode == 0 and name in listed.stdout and "rpm=1000" in listed.stdout
    assert secret not in listed.stdout and secret[3:] not in listed.stdout
    assert streamq_keys(keys_redis.url, "revoke", name).returncode == 0
    for replica in (gateway, second_gateway):
        assert completion(replica, secret).status_code == 401  # at once, cache or not
    assert streamq_keys(keys_redis.url, "revoke", name).returncode == 1


async def test_two_gateways_share_one_keys_requests_per_minute(
    gateway: GatewayProcess, second_gateway: GatewayProcess, keys_redis: RedisServer, keys_raw_redis: aioredis.Redis
) -> None:
    _, secret = create_key(keys_redis.url, "--rpm", "4")
    await wait_for_a_fresh_minute(keys_raw_redis)
    replies = [await asyncio.to_thread(completion, (gateway, second_gateway)[i % 2], secret) for i in range(6)]
    assert [r.status_code for r in replies] == [200, 200, 200, 200, 429, 429]
    refused = replies[4]
    assert "rpm" in refused.json()["error"]["message"] and refused.json()["error"]["type"] == "rate_limit_error"
    assert 1 <= int(refused.headers["Retry-After"]) <= 60


async def test_tokens_per_minute_refuse_once_spent(
    gateway: GatewayProcess, keys_redis: RedisServer, keys_raw_redis: aioredis.Redis
) -> None:
    _, secret = create_key(keys_redis.url, "--tpm", str(SCRIPTED_PROMPT_TOKENS + 16))
    await wait_for_a_fresh_minute(keys_raw_redis)
    first = await asyncio.to_thread(completion, gateway, secret, max_tokens=16, stream=True)
    assert first.status_code == 200 and first.text.endswith("data: [DONE]\n\n")
    await asyncio.sleep(0.5)  # the stream's tokens are charged as the server closes it
    refused = await asyncio.to_thread(completion, gateway, secret)
    assert refused.status_code == 429, refused.text
    assert "tpm" in refused.json()["error"]["message"]
    assert 1 <= int(refused.headers["Retry-After"]) <= 60
    with pytest.raises(openai.RateLimitError):
        sdk(gateway, secret).completions.create(model=MODEL, prompt=PROMPT, max_tokens=2)


async def test_concurrent_streams_are_limited_and_released_on_every_exit(
    gateway: GatewayProcess, second_gateway: GatewayProcess, keys_redis: RedisServer
) -> None:
    _, secret = create_key(keys_redis.url, "--max-streams", "1")
    headers = {"Authorization": f"Bearer {secret}"}
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 1000, "stream": True}
    async with httpx.AsyncClient(timeout=60) as http:
        async with http.stream("POST", gateway.url + "/v1/completions", json=body, headers=headers) as running:
            assert running.status_code == 200
            lines = running.aiter_lines()  # held: a dropped line iterator would close the response
            async for line in lines:
                if line.startswith("data:"):
                    break
            # the other replica sees the open stream too
            refused = await http.post(
                second_gateway.url + "/v1/completions", json={**body, "max_tokens": 2}, headers=headers
            )
            assert refused.status_code == 429 and "max_streams" in refused.json()["error"]["message"]
        # the client hung up: its stream is released
        deadline = time.monotonic() + 10
        while (
            reply := await http.post(gateway.url + "/v1/completions", json={**body, "max_tokens": 2}, headers=headers)
        ).status_code == 429:
            assert time.monotonic() < deadline, reply.text
            await asyncio.sleep(0.1)
        assert reply.status_code == 200
        # a request that fails (unknown model) releases its stream as well
        assert (
            await http.post(gateway.url + "/v1/completions", json={**body, "model": "nope"}, headers=headers)
        ).status_code == 404
        assert (
            await http.post(
                gateway.url + "/v1/completions", json={**body, "max_tokens": 2, "stream": False}, headers=headers
            )
        ).status_code == 200


def test_a_key_uses_only_the_models_it_is_allowed(gateway: GatewayProcess, keys_redis: RedisServer) -> None:
    name, secret = create_key(keys_redis.url, "--models", "some-other-model")
    client = sdk(gateway, secret)
    with pytest.raises(openai.NotFoundError) as caught:
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2)
    assert caught.value.body is not None and caught.value.body["code"] == "model_not_found"  # type: ignore[index]
    assert MODEL not in [m.id for m in client.models.list().data]
    assert streamq_keys(keys_redis.url, "set", name, "--models", f"{MODEL},some-other-model").returncode == 0
    assert client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2).usage is not None


def test_usage_per_key_on_metrics(
    gateway: GatewayProcess, second_gateway: GatewayProcess, keys_redis: RedisServer
) -> None:
    name, secret = create_key(keys_redis.url)
    sdk(gateway, secret).completions.create(model=MODEL, prompt=PROMPT, max_tokens=3)
    list(sdk(second_gateway, secret).completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, stream=True))
    time.sleep(0.5)
    text = httpx.get(gateway.url + "/metrics", timeout=10).text
    assert secret not in text
    samples = {
        (sample.name, sample.labels.get("key"), sample.labels.get("model")): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }
    assert samples[("streamq_key_requests_total", name, MODEL)] == 2
    assert samples[("streamq_key_prompt_tokens_total", name, MODEL)] == 2 * SCRIPTED_PROMPT_TOKENS
    assert samples[("streamq_key_completion_tokens_total", name, MODEL)] == 8


async def test_only_the_creating_key_resumes_a_named_request(gateway: GatewayProcess, keys_redis: RedisServer) -> None:
    _, owner = create_key(keys_redis.url)
    _, other = create_key(keys_redis.url)
    request_id = f"owned-{uuid.uuid4().hex}"
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 50, "stream": True}
    async with httpx.AsyncClient(base_url=gateway.url, timeout=60) as http:
        named = {"x-streamq-request-id": request_id}
        async with http.stream(
            "POST", "/v1/completions", json=body, headers={**named, "Authorization": f"Bearer {owner}"}
        ) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():
                if line.startswith("data:"):
                    break
        resume = {**named, "Last-Event-ID": "-1"}
        stolen = await http.post("/v1/completions", json=body, headers={**resume, "Authorization": f"Bearer {other}"})
        static = await http.post(
            "/v1/completions", json=body, headers={**resume, "Authorization": f"Bearer {STATIC_KEY}"}
        )
        mine = await http.post("/v1/completions", json=body, headers={**resume, "Authorization": f"Bearer {owner}"})
    for refused in (stolen, static):
        assert refused.status_code == 404 and refused.json()["error"]["code"] == "request_not_found"
    assert mine.status_code == 200 and mine.text.count(" tok") == 50
