"""Request status and completion callbacks with the real worker, engine and Redis.

Status in each state through the library, the command line and the gateway (open, with a
command-line key, with keys stored in Redis); callbacks to a local HTTP endpoint: signed,
with the whole text, retried on 500s, recorded in status, sent for a request cancelled
while still queued and for a failed one."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import msgspec
import pytest
import redis.asyncio as aioredis

from devkit.gateway_process import GatewayProcess
from devkit.worker_process import WorkerProcess
from producer.client import StreamqClient
from producer.internal_client import InternalClient
from streamq.broker.api_keys import ApiKeyStore, KeyRecord
from streamq.protocol import ChunkEvent
from streamq.protocol.callbacks import CallbackBody, verify
from streamq.protocol.names import CALLBACK_SIGNATURE_HEADER, CALLBACK_TIMESTAMP_HEADER
from streamq.protocol.status import RequestStatus
from tests.support.callback_receiver import CALLBACK_SECRET, CallbackReceiver

PROMPT = "The key to happiness is"


@pytest.fixture
async def idle_client(producer_url: str) -> AsyncIterator[StreamqClient]:
    """A client of a queue no worker takes jobs from: its requests stay queued."""
    async with await StreamqClient.connect(producer_url, queue=f"streamq:queue:idle-{uuid.uuid4().hex[:8]}") as client:
        yield client


@pytest.fixture(scope="module")
def receiver() -> Iterator[CallbackReceiver]:
    with CallbackReceiver() as receiver:
        yield receiver


async def until(client: InternalClient, request_id: str, done: object, timeout_s: float = 90) -> RequestStatus:
    """Poll the status until ``done(status)``."""
    deadline = time.monotonic() + timeout_s
    while True:
        status = await client.status(request_id)
        if done(status):  # type: ignore[operator]
            return status
        assert time.monotonic() < deadline, status
        await asyncio.sleep(0.05)


async def test_a_queued_request_has_its_position_and_its_cancel_ends_it(idle_client: StreamqClient) -> None:
    first = await idle_client.submit(PROMPT, max_tokens=4)
    second = await idle_client.submit(PROMPT, max_tokens=4)
    status = await idle_client.status(second.request_id)
    assert (status.state, status.queue, status.priority) == ("queued", idle_client.queue, 0)
    assert status.position in (1, 2) and status.waited_s is not None
    positions = {(await idle_client.status(h.request_id)).position for h in (first, second)}
    assert positions == {1, 2}
    await idle_client.cancel(first.request_id)
    assert (await idle_client.status(second.request_id)).position == 1
    status = await idle_client.status(first.request_id)
    assert (status.state, status.finish_reasons) == ("finished", ["cancelled"])
    await idle_client.cancel(second.request_id)


@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "not streamed"])
async def test_a_running_request_names_its_worker_and_counts_its_tokens(client: InternalClient, stream: bool) -> None:
    """Streamed or not: a request that is not streamed counts the tokens of its checkpoints."""
    handle = await client.submit(PROMPT, max_tokens=900, ignore_eos=True, temperature=0, stream=stream)
    live = {w.worker_id for w in (await client.routes()).workers if w.queue == client.queue}
    async for event in handle:
        if isinstance(event, ChunkEvent):
            break
    status = await until(client, handle.request_id, lambda s: s.state != "running" or (s.completion_tokens or 0) > 1)
    assert status.state == "running", status
    assert status.worker_id in live and status.attempt == 1
    assert status.waited_s is not None
    await handle.cancel()
    status = await until(client, handle.request_id, lambda s: s.state == "finished")
    assert status.finish_reasons == ["cancelled"]
    assert status.completion_tokens is not None and status.completion_tokens > 1


async def test_a_finished_request_has_its_reasons_usage_and_time(client: InternalClient) -> None:
    before_ms = time.time() * 1000 - 5000
    handle = await client.submit(PROMPT, max_tokens=8, temperature=0)
    completion = await handle.result()
    status = await until(client, handle.request_id, lambda s: s.ended_ms is not None)
    assert status.state == "finished"
    assert status.finish_reasons == completion.finish_reasons
    assert (status.prompt_tokens, status.completion_tokens) == (completion.prompt_tokens, completion.completion_tokens)
    assert status.started_ms is not None and before_ms < status.started_ms <= status.ended_ms  # type: ignore[operator]


async def test_an_invalid_request_is_failed_with_its_code(client: InternalClient) -> None:
    handle = await client.submit(PROMPT, max_tokens=8, temperature=-1.0)  # vLLM refuses it on the worker
    with pytest.raises(Exception, match="invalid_request"):
        await handle.result()
    status = await client.status(handle.request_id)
    assert (status.state, status.error_code) == ("failed", "invalid_request")
    assert status.error_message and "temperature" in status.error_message


async def test_a_request_nobody_made_is_unknown(client: InternalClient) -> None:
    assert (await client.status(f"never-{uuid.uuid4().hex}")).state == "unknown"


def run_status(redis_url: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "REDIS_URL": redis_url}
    command = [sys.executable, "-m", "producer", "status", *args]
    return subprocess.run(command, capture_output=True, text=True, env=env, timeout=120)


async def test_the_command_line_says_the_status(client: InternalClient, producer_url: str) -> None:
    handle = await client.submit(PROMPT, max_tokens=8, temperature=0)
    await handle.result()
    await until(client, handle.request_id, lambda s: s.ended_ms is not None)  # arq's result stored too
    shown = run_status(producer_url, handle.request_id, "--json")
    assert shown.returncode == 0, shown.stderr
    assert msgspec.json.decode(shown.stdout, type=RequestStatus) == await client.status(handle.request_id)
    text = run_status(producer_url, handle.request_id)
    assert text.returncode == 0 and f"{handle.request_id}: finished" in text.stdout
    unknown = run_status(producer_url, "no-such-request")
    assert unknown.returncode == 1 and "unknown" in unknown.stdout


async def test_the_gateway_route_says_the_status(client: InternalClient, gateway_url: str, tmp_path: Path) -> None:
    handle = await client.submit(PROMPT, max_tokens=8, temperature=0)
    await handle.result()
    expected = msgspec.to_builtins(await until(client, handle.request_id, lambda s: s.ended_ms is not None))
    open_gateway = GatewayProcess(gateway_url, tmp_path / "open.log").wait_ready()
    keyed = GatewayProcess(gateway_url, tmp_path / "keyed.log", "--api-key", "sk-status").wait_ready()
    try:
        response = httpx.get(f"{open_gateway.url}/v1/requests/{handle.request_id}")
        assert (response.status_code, response.json()) == (200, expected)
        assert httpx.get(f"{open_gateway.url}/v1/requests/no-such-request").status_code == 404
        url = f"{keyed.url}/v1/requests/{handle.request_id}"
        assert httpx.get(url).status_code == 401
        response = httpx.get(url, headers={"Authorization": "Bearer sk-status"})
        assert (response.status_code, response.json()) == (200, expected)
    finally:
        assert open_gateway.stop() == 0, open_gateway.log_tail()
        assert keyed.stop() == 0, keyed.log_tail()


async def test_a_key_stored_in_redis_sees_only_its_own_requests(
    worker: WorkerProcess, gateway_url: str, tiny_model: Path, raw_redis: aioredis.Redis, tmp_path: Path
) -> None:
    store = ApiKeyStore(raw_redis)
    mine, theirs = f"status-a-{uuid.uuid4().hex[:6]}", f"status-b-{uuid.uuid4().hex[:6]}"
    secrets = {name: await store.create(KeyRecord(name=name)) for name in (mine, theirs)}
    gateway = GatewayProcess(gateway_url, tmp_path / "gateway.log").wait_ready()
    try:
        body = {"model": str(tiny_model), "prompt": PROMPT, "max_tokens": 4}
        headers = {"Authorization": f"Bearer {secrets[mine]}"}
        created = httpx.post(f"{gateway.url}/v1/completions", json=body, headers=headers, timeout=60)
        assert created.status_code == 200, created.text
        request_id = created.headers["x-request-id"]
        url = f"{gateway.url}/v1/requests/{request_id}"
        response = httpx.get(url, headers=headers)
        assert (response.status_code, response.json()["state"]) == (200, "finished")
        other = httpx.get(url, headers={"Authorization": f"Bearer {secrets[theirs]}"})
        assert (other.status_code, other.json()["error"]["code"]) == (404, "request_not_found")
    finally:
        assert gateway.stop() == 0, gateway.log_tail()
        for name in (mine, theirs):  # later gateways of the session start open again
            await store.revoke(name)


def checked_body(delivery_headers: dict[str, str], body: bytes) -> CallbackBody:
    """The body, once its signature verifies with the workers' secret."""
    headers = {k.lower(): v for k, v in delivery_headers.items()}
    timestamp = headers[CALLBACK_TIMESTAMP_HEADER.lower()]
    assert verify(CALLBACK_SECRET, timestamp, headers[CALLBACK_SIGNATURE_HEADER.lower()], body)
    return msgspec.json.decode(body, type=CallbackBody)


@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "not streamed"])
async def test_a_finished_request_calls_back_signed_with_its_text(
    client: InternalClient, receiver: CallbackReceiver, stream: bool
) -> None:
    path = f"/done-{uuid.uuid4().hex}"
    callback = {"url": receiver.url(path)}
    handle = await client.submit(PROMPT, max_tokens=12, seed=7, n=2, callback=callback, stream=stream)
    completion = await handle.result()
    (delivery,) = await asyncio.to_thread(receiver.wait, path)
    body = checked_body(delivery.headers, delivery.body)
    assert (body.request_id, body.state, body.texts) == (handle.request_id, "finished", completion.texts)
    assert (body.finish_reasons, body.prompt_tokens, body.completion_tokens) == (
        completion.finish_reasons,
        completion.prompt_tokens,
        completion.completion_tokens,
    )
    status = await until(client, handle.request_id, lambda s: s.callback and s.callback.state == "delivered")
    assert status.callback is not None and (status.callback.http_status, status.callback.attempts) == (200, 1)
    assert abs(body.ended_ms - time.time() * 1000) < 60_000


async def test_a_callback_without_text_leaves_the_text_out(client: InternalClient, receiver: CallbackReceiver) -> None:
    path = f"/no-text-{uuid.uuid4().hex}"
    callback = {"url": receiver.url(path), "include_text": False}
    handle = await client.submit(PROMPT, max_tokens=4, ignore_eos=True, callback=callback)
    await handle.result()
    (delivery,) = await asyncio.to_thread(receiver.wait, path)
    body = checked_body(delivery.headers, delivery.body)
    assert body.texts is None and "texts" not in json.loads(delivery.body)
    assert body.completion_tokens == 4


async def test_a_failing_endpoint_is_retried_until_it_answers(
    client: InternalClient, receiver: CallbackReceiver
) -> None:
    path = f"/flaky-{uuid.uuid4().hex}"
    receiver.answer(path, 500, 503)
    handle = await client.submit(PROMPT, max_tokens=4, callback={"url": receiver.url(path)})
    await handle.result()
    deliveries = await asyncio.to_thread(receiver.wait, path, 3)
    assert len({d.body for d in deliveries}) == 1  # the same summary each time
    status = await until(client, handle.request_id, lambda s: s.callback and s.callback.state != "pending")
    assert status.callback is not None
    assert (status.callback.state, status.callback.attempts, status.callback.http_status) == ("delivered", 3, 200)


async def test_an_endpoint_that_always_fails_is_recorded_failed(
    client: InternalClient, receiver: CallbackReceiver
) -> None:
    path = f"/down-{uuid.uuid4().hex}"
    receiver.answer(path, *[500] * 10)
    handle = await client.submit(PROMPT, max_tokens=4, callback={"url": receiver.url(path)})
    await handle.result()
    status = await until(client, handle.request_id, lambda s: s.callback and s.callback.state != "pending", 120)
    assert status.callback is not None
    assert (status.callback.state, status.callback.attempts, status.callback.http_status) == ("failed", 5, 500)
    assert status.callback.last_error == "HTTP 500"
    assert len(receiver.received(path)) == 5


async def test_a_request_cancelled_while_queued_calls_back(
    worker: WorkerProcess, idle_client: StreamqClient, receiver: CallbackReceiver
) -> None:
    path = f"/cancelled-{uuid.uuid4().hex}"
    handle = await idle_client.submit(PROMPT, max_tokens=4, callback={"url": receiver.url(path)})
    assert await idle_client.cancel(handle.request_id) == "queued"
    (delivery,) = await asyncio.to_thread(receiver.wait, path)  # sent by a worker of another queue
    body = checked_body(delivery.headers, delivery.body)
    assert (body.request_id, body.state, body.finish_reasons, body.texts) == (
        handle.request_id,
        "finished",
        ["cancelled"],
        [""],
    )
    status = await until(idle_client, handle.request_id, lambda s: s.callback and s.callback.state == "delivered")
    assert status.state == "finished"


async def test_a_failed_request_calls_back_with_its_error(client: InternalClient, receiver: CallbackReceiver) -> None:
    path = f"/failed-{uuid.uuid4().hex}"
    handle = await client.submit(PROMPT, max_tokens=4, temperature=-1.0, callback={"url": receiver.url(path)})
    with pytest.raises(Exception, match="invalid_request"):
        await handle.result()
    (delivery,) = await asyncio.to_thread(receiver.wait, path)
    body = checked_body(delivery.headers, delivery.body)
    assert body.state == "failed" and body.error is not None and body.error.code == "invalid_request"
    assert body.texts is None


async def test_a_batch_line_calls_back(
    worker: WorkerProcess, producer_url: str, tiny_model: Path, tmp_path: Path, receiver: CallbackReceiver
) -> None:
    path = f"/batch-{uuid.uuid4().hex}"
    body = {"model": str(tiny_model), "prompt": PROMPT, "max_tokens": 4, "callback": {"url": receiver.url(path)}}
    line = {"custom_id": "one", "method": "POST", "url": "/v1/completions", "body": body}
    in_path, out_path = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    in_path.write_text(json.dumps(line) + "\n")
    env = {**os.environ, "REDIS_URL": producer_url}
    command = [sys.executable, "-m", "producer", "batch", str(in_path), str(out_path), "--queue", worker.queue]
    command.append("--no-progress")
    ran = subprocess.run(command, capture_output=True, text=True, env=env, timeout=120)
    assert ran.returncode == 0, ran.stderr
    output = json.loads(out_path.read_text())
    (delivery,) = await asyncio.to_thread(receiver.wait, path)
    body_sent = checked_body(delivery.headers, delivery.body)
    assert body_sent.request_id == output["response"]["request_id"]
    assert body_sent.texts == [output["response"]["body"]["choices"][0]["text"]]
