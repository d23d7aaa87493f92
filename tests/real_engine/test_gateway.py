"""The OpenAI-compatible gateway, driven by clients nobody here wrote: the official
``openai`` SDK and vLLM's ``vllm bench serve``, against a real gateway process, a real
worker and the real engine, open or with a key. Plus what only raw HTTP shows:
disconnects, resume, ids."""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
import openai
import psutil
import pytest
import redis.asyncio as aioredis
from prometheus_client.parser import text_string_to_metric_families

from devkit.gateway_process import GatewayProcess
from devkit.worker_process import WorkerProcess, worker_env
from producer.internal_client import InternalClient
from streamq.broker.registry import WorkerRegistry
from streamq.protocol import WorkerRegistration
from streamq.protocol.names import DEFAULT_MODEL_MEMORY_S, MODELS_SEEN_KEY
from tests.support import metrics as worker_metrics
from tests.support.session import OPERATOR_KEY

PROMPT = "The key to happiness is"


def sse_events(lines: list[str]) -> list[dict[str, str]]:
    """SSE lines into events: ``{"id": ..., "data": ...}`` (``id`` absent when not sent)."""
    events, current = [], {}
    for line in lines:
        if not line:
            if current:
                events.append(current)
            current = {}
            continue
        name, _, value = line.partition(":")
        current[name] = value.removeprefix(" ")
    return events


async def reference(client: InternalClient, model: str, **kwargs: Any) -> str:
    """The text the queue itself gives for the same request (temperature 0)."""
    return (await (await client.submit(model=model, temperature=0, **kwargs)).result()).text


def test_models_lists_the_model_of_the_live_worker(sdk: openai.OpenAI, model: str) -> None:
    assert model in [m.id for m in sdk.models.list().data]


async def test_completion_through_the_sdk_equals_the_queues_answer(
    sdk: openai.OpenAI, model: str, client: InternalClient
) -> None:
    completion = await asyncio.to_thread(
        sdk.completions.create,
        model=model,
        prompt=PROMPT,
        max_tokens=12,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert completion.choices[0].text == await reference(client, model, prompt=PROMPT, max_tokens=12, ignore_eos=True)
    assert completion.choices[0].finish_reason == "length"
    assert completion.usage is not None and completion.usage.completion_tokens == 12
    assert completion.id.startswith("cmpl-")


async def test_streamed_completion_through_the_sdk(sdk: openai.OpenAI, model: str, client: InternalClient) -> None:
    def run() -> list[Any]:
        stream = sdk.completions.create(
            model=model,
            prompt=PROMPT,
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        return list(stream)

    chunks = await asyncio.to_thread(run)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == await reference(client, model, prompt=PROMPT, max_tokens=12, ignore_eos=True)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 12


async def test_chat_through_the_sdk_streamed_and_not(sdk: openai.OpenAI, model: str, client: InternalClient) -> None:
    messages: list[Any] = [{"role": "user", "content": "Hello there"}]
    whole = await asyncio.to_thread(
        sdk.chat.completions.create, model=model, messages=messages, max_completion_tokens=10, temperature=0
    )

    def run() -> list[Any]:
        stream = sdk.chat.completions.create(model=model, messages=messages, max_tokens=10, temperature=0, stream=True)
        return list(stream)

    chunks = await asyncio.to_thread(run)
    expected = await reference(client, model, messages=messages, max_tokens=10)
    assert whole.choices[0].message.content == expected
    assert whole.choices[0].message.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")


async def test_a_whole_response_is_not_streamed_through_the_queue_and_a_stream_is(
    sdk: openai.OpenAI, model: str, worker: WorkerProcess
) -> None:
    """``stream: false`` asks the worker for no per-token events: 40 tokens are one chunk and
    the final (the worker's events-per-request histogram says); ``stream: true`` streams."""
    request_events = worker_metrics.request_events
    before = worker_metrics.scrape(worker)
    greedy: dict[str, Any] = {"max_tokens": 40, "temperature": 0, "extra_body": {"ignore_eos": True}}
    whole = await asyncio.to_thread(sdk.completions.create, model=model, prompt="Once upon a time", **greedy)
    assert whole.usage is not None and whole.usage.completion_tokens == 40
    middle = worker_metrics.scrape(worker)
    assert request_events(middle, streamed=False) == tuple(
        a + b for a, b in zip(request_events(before, streamed=False), (2, 1), strict=True)
    ), "one request of two events: its chunk and its final"
    assert request_events(middle, streamed=True) == request_events(before, streamed=True)

    def stream() -> list[Any]:
        return list(sdk.completions.create(model=model, prompt="Once upon a time", stream=True, **greedy))

    chunks = await asyncio.to_thread(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    after = worker_metrics.scrape(worker)
    assert request_events(after, streamed=True)[1] == request_events(middle, streamed=True)[1] + 1
    assert request_events(after, streamed=False) == request_events(middle, streamed=False)


@pytest.mark.parametrize(
    ("body", "param_in_message"),
    [
        ({"temperature": -1}, "temperature"),  # refused by vLLM on the worker, still a 400
        ({"use_beam_search": True}, "use_beam_search"),  # a field streamq refuses, by name
        ({"max_tokens": "many"}, "max_tokens"),
    ],
)
@pytest.mark.parametrize("stream", [False, True])
def test_bad_parameters_are_400_and_the_gateway_goes_on(
    sdk: openai.OpenAI, model: str, body: dict[str, Any], param_in_message: str, stream: bool
) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        sdk.completions.create(model=model, prompt=PROMPT, max_tokens=4, stream=stream, extra_body=body)
    assert caught.value.status_code == 400
    assert param_in_message in caught.value.message
    assert sdk.completions.create(model=model, prompt=PROMPT, max_tokens=2).usage is not None


def test_a_field_the_gateway_does_not_know_is_ignored_as_vllm_serve_ignores_it(sdk: openai.OpenAI, model: str) -> None:
    greedy: dict[str, Any] = {"model": model, "prompt": PROMPT, "max_tokens": 4, "temperature": 0}
    plain = sdk.completions.create(**greedy)
    ignored = sdk.completions.create(**greedy, extra_body={"frobnicate": True})
    assert ignored.choices[0].text == plain.choices[0].text


def test_a_request_without_a_model_is_refused_listing_the_models_when_several_serve(
    gateway: GatewayProcess, model: str, parked_model: WorkerRegistration
) -> None:
    """``vllm serve`` answers it with the model it serves; a queue in front of several
    models cannot pick one (``test_gateway_default_model.py`` has the one-model case)."""
    response = httpx.post(gateway.url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 2}, timeout=30)
    assert response.status_code == 400, response.text
    message = response.json()["error"]["message"]
    assert model in message and parked_model.model in message


def test_unknown_model_is_404(sdk: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as caught:
        sdk.completions.create(model="no-such-model", prompt=PROMPT, max_tokens=4)
    assert "no-such-model" in caught.value.message
    assert caught.value.body is not None and caught.value.body["code"] == "model_not_found"  # type: ignore[index]


async def test_model_whose_workers_are_gone_past_its_memory_is_503(
    sdk: openai.OpenAI, raw_redis: aioredis.Redis
) -> None:
    name = f"gone-{uuid.uuid4().hex[:8]}"
    registration = WorkerRegistration(worker_id=name, model=name, queue=f"streamq:queue:{name}")
    registry = WorkerRegistry(raw_redis)
    await registry.register(registration)
    assert name in [m.id for m in (await asyncio.to_thread(sdk.models.list)).data]
    await registry.unregister(registration)  # its last worker shut down, longer ago than the model memory
    now_s, _ = await raw_redis.time()
    await raw_redis.zadd(MODELS_SEEN_KEY, {name: (now_s - DEFAULT_MODEL_MEMORY_S - 60) * 1000})
    with pytest.raises(openai.InternalServerError) as caught:
        await asyncio.to_thread(sdk.completions.create, model=name, prompt=PROMPT, max_tokens=4)
    assert caught.value.status_code == 503
    assert name not in [m.id for m in (await asyncio.to_thread(sdk.models.list)).data]


async def test_full_queue_is_429(
    worker: WorkerProcess, parked_model: WorkerRegistration, client: InternalClient, gateway_url: str, tmp_path: Path
) -> None:
    gateway = GatewayProcess(gateway_url, tmp_path / "gateway.log", "--max-queue-depth", "2").wait_ready()
    try:
        sdk = openai.AsyncOpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0)
        handles = [await client.submit(PROMPT, model=parked_model.model, max_tokens=4) for _ in range(2)]
        with pytest.raises(openai.RateLimitError) as caught:
            await sdk.completions.create(model=parked_model.model, prompt=PROMPT, max_tokens=4)
        assert caught.value.status_code == 429 and "queue" in caught.value.message
        assert await client.redis.zcard(parked_model.queue) == 2
        for handle in handles:
            assert await handle.cancel() == "queued"
            await handle.close()
        await sdk.close()
    finally:
        assert gateway.stop() == 0, gateway.log_tail()


async def test_disconnect_mid_stream_cancels_the_request(
    gateway: GatewayProcess, model: str, client: InternalClient
) -> None:
    body = {"model": model, "prompt": PROMPT, "max_tokens": 1000, "ignore_eos": True, "stream": True}
    async with (
        httpx.AsyncClient(base_url=gateway.url, timeout=60) as http,
        http.stream("POST", "/v1/completions", json=body) as response,
    ):
        assert response.status_code == 200
        request_id = response.headers["x-request-id"]
        async for line in response.aiter_lines():
            if line.startswith("data:"):
                break  # one chunk arrived: now hang up
    completion = await (await client.follow(request_id)).result()
    assert completion.finish_reasons == ["cancelled"]
    assert completion.completion_tokens < 1000


async def test_disconnect_while_queued_removes_the_request(
    gateway: GatewayProcess, parked_model: WorkerRegistration, client: InternalClient, raw_redis: aioredis.Redis
) -> None:
    body = {"model": parked_model.model, "prompt": PROMPT, "max_tokens": 4, "stream": True}
    async with httpx.AsyncClient(base_url=gateway.url, timeout=60) as http:
        waiting = asyncio.create_task(http.post("/v1/completions", json=body))
        async with asyncio.timeout(30):
            while not (queued := await raw_redis.zrange(parked_model.queue, 0, -1)):
                await asyncio.sleep(0.05)
        waiting.cancel()  # the client gives up before any token: the connection closes
        with pytest.raises(asyncio.CancelledError):
            await waiting
    completion = await (await client.follow(queued[0].decode())).result()
    assert completion.finish_reasons == ["cancelled"]
    assert await client.redis.zcard(parked_model.queue) == 0


@pytest.mark.parametrize("named_by", ["header", "body"])
async def test_a_named_stream_resumes_from_last_event_id(
    gateway: GatewayProcess, model: str, client: InternalClient, named_by: str
) -> None:
    """Named by the ``x-streamq-request-id`` header, or by the body's ``request_id`` (vLLM's field)."""
    request_id = f"resume-{uuid.uuid4().hex}"
    body = {"model": model, "prompt": PROMPT, "max_tokens": 200, "temperature": 0, "ignore_eos": True, "stream": True}
    headers = {"x-streamq-request-id": request_id} if named_by == "header" else {}
    if named_by == "body":
        body["request_id"] = request_id
    async with httpx.AsyncClient(base_url=gateway.url, timeout=60) as http:
        lines: list[str] = []
        async with http.stream("POST", "/v1/completions", json=body, headers=headers) as response:
            assert response.headers["x-request-id"] == request_id
            async for line in response.aiter_lines():
                lines.append(line)
                if len(sse_events(lines)) == 3:
                    break  # the connection drops
        before = sse_events(lines)
        last_id = before[-1]["id"]
        resumed = await http.post("/v1/completions", json=body, headers={**headers, "Last-Event-ID": last_id})
        assert resumed.status_code == 200, resumed.text
        after = sse_events(resumed.text.splitlines())
        status = await http.get(f"/v1/requests/{request_id}")
        assert status.status_code == 200 and status.json()["request_id"] == request_id, status.text

    assert after[-1]["data"] == "[DONE]"
    labels = [e["id"].split(".") for e in before + after if "id" in e]  # <seq>.<digest of the event as logged>
    ids = [int(seq) for seq, _ in labels]
    assert ids == sorted(set(ids))  # none repeated: one SSE event per chunk event
    text = "".join(json.loads(e["data"])["choices"][0]["text"] for e in before + after if e["data"] != "[DONE]")
    replayed = await client.follow(request_id)
    whole = await replayed.result()
    assert [digest for _, digest in labels] == [replayed.digest(seq) for seq in ids]
    assert text == whole.text
    assert whole.finish_reasons == ["length"] and whole.completion_tokens == 200  # not cancelled by the drop


async def test_a_request_id_in_use_is_409(
    gateway: GatewayProcess, model: str, client: InternalClient, parked_model: WorkerRegistration
) -> None:
    """A named request whose id exists (finished, or cancelled while queued: its log is
    kept) is refused; the first request's stream is left as it was."""
    finished, cancelled = f"dup-{uuid.uuid4().hex}", f"dup-{uuid.uuid4().hex}"
    await (await client.submit(PROMPT, model=model, request_id=finished, max_tokens=2)).result()
    queued = await client.submit(PROMPT, model=parked_model.model, request_id=cancelled, max_tokens=2)
    assert await queued.cancel() == "queued"
    await queued.close()
    async with httpx.AsyncClient(base_url=gateway.url, timeout=10) as http:
        replies = [
            await http.post(
                "/v1/completions",
                json={"model": name, "prompt": PROMPT, "max_tokens": 2},
                headers={"x-streamq-request-id": request_id},
            )
            for name, request_id in ((model, finished), (parked_model.model, cancelled))
        ]
    for reply, request_id in zip(replies, (finished, cancelled), strict=True):
        assert reply.status_code == 409, reply.text
        assert reply.json()["error"]["code"] == "duplicate_request" and request_id in reply.json()["error"]["message"]
    assert await client.redis.zcard(parked_model.queue) == 0
    events = [event async for event in await client.follow(cancelled)]
    assert [e.seq for e in events] == [0] and events[0].finish_reasons == ["cancelled"]  # type: ignore[union-attr]


async def test_resume_needs_a_known_named_request(gateway: GatewayProcess, model: str) -> None:
    body = {"model": model, "prompt": PROMPT, "max_tokens": 4, "stream": True}
    async with httpx.AsyncClient(base_url=gateway.url, timeout=60) as http:
        unnamed = await http.post("/v1/completions", json=body, headers={"Last-Event-ID": "3"})
        unknown = await http.post(
            "/v1/completions", json=body, headers={"Last-Event-ID": "3", "x-streamq-request-id": "never-submitted"}
        )
    assert unnamed.status_code == 400 and "x-streamq-request-id" in unnamed.json()["error"]["message"]
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "request_not_found"


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # torch's, on importing vLLM's benchmark
def scrape(gateway: GatewayProcess) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """The gateway's /metrics as {(sample name, sorted labels): value}."""
    text = httpx.get(gateway.url + "/metrics", timeout=10).text
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def test_metrics_count_requests_by_status_and_time_the_first_event(
    gateway: GatewayProcess, sdk: openai.OpenAI, model: str
) -> None:
    ok = ("streamq_gateway_requests_total", (("endpoint", "/v1/completions"), ("status", "200")))
    not_found = ("streamq_gateway_requests_total", (("endpoint", "/v1/completions"), ("status", "404")))
    first_events = ("streamq_gateway_time_to_first_event_seconds_count", ())
    before = scrape(gateway)

    sdk.completions.create(model=model, prompt=PROMPT, max_tokens=2)
    list(sdk.completions.create(model=model, prompt=PROMPT, max_tokens=2, stream=True))
    with pytest.raises(openai.NotFoundError):
        sdk.completions.create(model="no-such-model", prompt=PROMPT, max_tokens=2)

    after = scrape(gateway)
    assert after[ok] - before.get(ok, 0) == 2
    assert after[not_found] - before.get(not_found, 0) == 1
    assert after[first_events] - before.get(first_events, 0) == 1  # the streamed one
    in_progress = ("streamq_gateway_requests_in_progress", ())
    deadline = time.monotonic() + 10  # the server closes a stream just after its client read [DONE]
    while scrape(gateway)[in_progress] != 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert scrape(gateway)[in_progress] == 0


async def test_every_stream_of_a_gateway_shares_one_pubsub_connection(
    gateway: GatewayProcess, model: str, raw_redis: aioredis.Redis
) -> None:
    body = {"model": model, "prompt": PROMPT, "max_tokens": 64, "ignore_eos": True, "stream": True}
    redis_port = raw_redis.connection_pool.connection_kwargs["port"]
    async with httpx.AsyncClient(base_url=gateway.url, timeout=60) as http, contextlib.AsyncExitStack() as streams:
        responses = [
            await streams.enter_async_context(http.stream("POST", "/v1/completions", json=body)) for _ in range(8)
        ]
        for response in responses:  # every stream under way: subscribed, its first chunk sent
            assert (await anext(response.aiter_lines())).startswith("data: {")
        sockets = psutil.Process(gateway.process.pid).net_connections(kind="tcp")
        to_redis = {s.laddr.port for s in sockets if s.raddr and s.raddr.port == redis_port}
        subscribed = [
            c for c in await raw_redis.client_list(_type="pubsub") if int(c["addr"].rsplit(":", 1)[1]) in to_redis
        ]
    assert len(subscribed) == 1, subscribed


def keyed_sdk(gateway: GatewayProcess, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=gateway.url + "/v1", api_key=key, max_retries=0, timeout=60)


def test_the_real_engine_behind_a_keyed_gateway(keyed_gateway: GatewayProcess, tiny_model: Path) -> None:
    with pytest.raises(openai.AuthenticationError):
        keyed_sdk(keyed_gateway, "sq-wrong").completions.create(model=str(tiny_model), prompt=PROMPT, max_tokens=4)
    whole = keyed_sdk(keyed_gateway, OPERATOR_KEY).completions.create(
        model=str(tiny_model), prompt=PROMPT, max_tokens=4, extra_body={"ignore_eos": True}
    )
    assert whole.usage is not None and whole.usage.completion_tokens == 4


def test_vllm_bench_serve_runs_against_the_gateway_with_its_api_key(
    keyed_gateway: GatewayProcess, tiny_model: Path, tmp_path: Path
) -> None:
    """``vllm bench serve`` runs unchanged against the gateway, sending ``$OPENAI_API_KEY``
    as its bearer token; in a process of its own, as users run it (importing vLLM's
    benchmark client also loads triton, which floods the end of a test run with leak reports)."""
    script = f"""
from bench.config import BenchConfig
from bench.path_serve import bench_serve
config = BenchConfig(model_dir={str(tiny_model)!r}, input_len=16, output_len=8, concurrencies=(4,), num_prompts=8,
                     seed=0, results_dir={str(tmp_path)!r}, run_id="keyed")
result = bench_serve(config, {keyed_gateway.port}, concurrency=4)
print("RESULT", result.num_prompts, result.output_tokens)
"""
    env = worker_env(OPENAI_API_KEY=OPERATOR_KEY)
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    line = next(line for line in run.stdout.splitlines() if line.startswith("RESULT "))
    assert [int(x) for x in line.split()[1:]] == [8, 8 * 8]  # vLLM counts only requests that streamed whole
