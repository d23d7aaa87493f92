"""Bounds at the gateway's edge, against a real gateway process and real Redis: bodies
over the limit get 413 before they are read whole, ``n`` and ``stop`` over their caps get
400, and none of them queues anything. No engine: the models here are registered by
'workers' that never take a job."""

from __future__ import annotations

import json
import socket
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import openai
import pytest
import redis.asyncio as aioredis

from devkit.gateway_process import GatewayProcess
from gateway.__main__ import DEFAULT_MAX_QUEUE_DEPTH
from gateway.body_limit import DEFAULT_MAX_BODY_BYTES
from gateway.routes.completions import REQUEST_ID_HEADER
from producer.client import StreamqClient
from producer.openai_api.limits import DEFAULT_MAX_N
from streamq.broker.registry import WorkerRegistry
from streamq.protocol import MAX_PROMPT_CHARS, WorkerRegistration

CONTEXT = 64


@pytest.fixture(scope="module")
def gateway(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayProcess]:
    process = GatewayProcess(redis_url, tmp_path_factory.mktemp("gateway") / "gateway.log").wait_ready()
    yield process
    assert process.stop() == 0, process.log_tail()


@pytest.fixture
async def sized_model(raw_redis: aioredis.Redis) -> AsyncIterator[WorkerRegistration]:
    """A model whose one live 'worker' (never taking jobs) has a context of ``CONTEXT`` tokens."""
    name = f"sized-{uuid.uuid4().hex[:8]}"
    registration = WorkerRegistration(worker_id=name, model=name, queue=f"streamq:queue:{name}", max_model_len=CONTEXT)
    registry = WorkerRegistry(raw_redis)
    await registry.register(registration, ttl_ms=600_000)
    yield registration
    await registry.unregister(registration)
    await raw_redis.delete(registration.queue)


def raw_post(gateway: GatewayProcess, head: dict[str, str], chunks: Iterator[bytes]) -> tuple[int, dict[str, object]]:
    """POST /v1/completions over a bare socket, sending ``chunks`` until the gateway stops
    reading; its status and JSON body. httpx would insist on sending the whole body first."""
    lines = ["POST /v1/completions HTTP/1.1", f"Host: 127.0.0.1:{gateway.port}", "Content-Type: application/json"]
    request_head = "\r\n".join([*lines, *(f"{name}: {value}" for name, value in head.items()), "", ""])
    with socket.create_connection(("127.0.0.1", gateway.port), timeout=30) as connection:
        connection.sendall(request_head.encode())
        for chunk in chunks:
            try:
                connection.sendall(chunk)
            except (BrokenPipeError, ConnectionResetError):
                break
        received = b""
        while b"\r\n\r\n" not in received or len(received.split(b"\r\n\r\n", 1)[1]) < _length(received):
            data = connection.recv(65536)
            if not data:
                break
            received += data
    status_line, _, rest = received.partition(b"\r\n")
    return int(status_line.split()[1]), json.loads(rest.split(b"\r\n\r\n", 1)[1])


def _length(received: bytes) -> int:
    for line in received.split(b"\r\n\r\n", 1)[0].split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return int(value)
    return 1 << 62


def test_a_body_declared_over_the_limit_is_refused_before_a_byte_of_it_is_read(gateway: GatewayProcess) -> None:
    status, body = raw_post(gateway, {"Content-Length": str(100 * DEFAULT_MAX_BODY_BYTES)}, iter(()))
    assert status == 413
    error = body["error"]
    assert isinstance(error, dict) and error["code"] == "request_too_large"
    assert (
        error["type"] == "invalid_request_error" and f"the limit is {DEFAULT_MAX_BODY_BYTES} bytes" in error["message"]
    )


def test_a_chunked_body_is_refused_once_it_passes_the_limit(gateway: GatewayProcess) -> None:
    piece = b"x" * 65536

    def chunks() -> Iterator[bytes]:
        """Chunked encoding, a little over the limit, never finished (no last chunk)."""
        for _ in range(DEFAULT_MAX_BODY_BYTES // len(piece) + 1):
            yield f"{len(piece):x}\r\n".encode() + piece + b"\r\n"

    status, body = raw_post(gateway, {"Transfer-Encoding": "chunked"}, chunks())
    assert status == 413
    error = body["error"]
    assert isinstance(error, dict) and error["code"] == "request_too_large"
    assert f"larger than {DEFAULT_MAX_BODY_BYTES} bytes" in error["message"]


def test_a_body_under_the_limit_is_read_and_parsed(gateway: GatewayProcess) -> None:
    prompt = "x" * (DEFAULT_MAX_BODY_BYTES - 1000)  # a body under the limit, a prompt over the protocol's
    response = httpx.post(gateway.url + "/v1/completions", json={"model": "m", "prompt": prompt}, timeout=30)
    assert response.status_code == 400
    assert response.json()["error"]["message"] == f"prompt is {len(prompt)} characters; the limit is {MAX_PROMPT_CHARS}"


async def test_n_and_stop_over_their_caps_are_400_and_queue_nothing(
    gateway: GatewayProcess, sized_model: WorkerRegistration, raw_redis: aioredis.Redis
) -> None:
    sdk = openai.AsyncOpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0)
    try:
        with pytest.raises(openai.BadRequestError) as caught:
            await sdk.completions.create(model=sized_model.model, prompt="Hi", max_tokens=4, n=DEFAULT_MAX_N + 1)
        assert caught.value.param == "n" and f"limit of {DEFAULT_MAX_N} " in caught.value.message
        with pytest.raises(openai.BadRequestError) as caught:
            await sdk.completions.create(model=sized_model.model, prompt="Hi", stop=["s"] * 65)
        assert caught.value.param == "stop"
        assert await raw_redis.zcard(sized_model.queue) == 0
    finally:
        await sdk.close()


def test_the_cap_on_n_is_the_gateways_option(redis_url: str, tmp_path: Path) -> None:
    gateway = GatewayProcess(redis_url, tmp_path / "gateway.log", "--max-n", "2", "--max-body-bytes", "1000")
    try:
        gateway.wait_ready()
        response = httpx.post(gateway.url + "/v1/completions", json={"model": "m", "prompt": "Hi", "n": 3})
        assert response.status_code == 400
        assert response.json()["error"]["message"] == "n=3 is over the limit of 2 completions per request"
        response = httpx.post(gateway.url + "/v1/completions", json={"model": "m", "prompt": "x" * 1000})
        assert response.status_code == 413
    finally:
        assert gateway.stop() == 0, gateway.log_tail()


async def test_the_queue_is_bounded_by_default_and_0_lifts_the_bound(
    gateway: GatewayProcess, parked_model: WorkerRegistration, raw_redis: aioredis.Redis, redis_url: str, tmp_path: Path
) -> None:
    await raw_redis.zadd(parked_model.queue, {f"waiting-{i}": 0 for i in range(DEFAULT_MAX_QUEUE_DEPTH)})
    body = {"model": parked_model.model, "prompt": "Hi", "max_tokens": 4}
    response = httpx.post(gateway.url + "/v1/completions", json=body)
    assert response.status_code == 429 and response.headers["retry-after"] == "1"
    assert f"holds {DEFAULT_MAX_QUEUE_DEPTH} jobs" in response.json()["error"]["message"]
    unbounded = GatewayProcess(redis_url, tmp_path / "gateway.log", "--max-queue-depth", "0")
    request_id = f"over-{uuid.uuid4().hex}"
    try:
        unbounded.wait_ready()
        with pytest.raises(httpx.ReadTimeout):  # queued behind the others, waiting: no 429
            httpx.post(unbounded.url + "/v1/completions", json=body, headers={REQUEST_ID_HEADER: request_id}, timeout=2)
        assert await raw_redis.zcard(parked_model.queue) == DEFAULT_MAX_QUEUE_DEPTH + 1
    finally:
        assert unbounded.stop() == 0, unbounded.log_tail()
        async with await StreamqClient.connect(redis_url) as client:
            await client.cancel(request_id, queue=parked_model.queue)
