"""A pooling model's requests through the queue, on real engines: what ``client.embed``
answers is what vLLM's offline ``LLM.embed`` answers, requests reach the worker of their
kind, and a pooling request is cancelled, timed out, taken over and reported as a
generation request is.

The module runs one embedding worker (the tiny model with ``--runner pooling --convert
embed``, its own served name and queue) beside the session's generation worker, and starts
a second one only for the take-over test. The reference vectors come from vLLM's offline
``LLM(runner="pooling", convert="embed")`` in a subprocess, once, over every input the
tests compare.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import msgspec
import numpy
import psutil
import pytest
import redis.asyncio as aioredis

from devkit.worker_process import SIZED_LINE, WorkerProcess, tiny_engine_flags, worker_env
from producer.client import StreamqClient
from producer.errors import RequestError
from producer.sync import StreamqClient as BlockingClient
from streamq.env_vars import CALLBACK_SECRET_ENV
from streamq.protocol import (
    JOB_KEY_PREFIX,
    MAX_POOLING_INPUTS,
    WAKEUP_CHANNEL,
    ErrorEvent,
    Event,
    FinalEvent,
    InvalidRequest,
    PooledEvent,
    Pooling,
)
from streamq.protocol.callbacks import CallbackBody
from tests.support.callback_receiver import CALLBACK_SECRET, CallbackReceiver
from tests.support.events import capture_events, job_result
from tests.support.reference_embed import offline_embeddings
from tests.support.worker_faults import paused, pid_of

EMBED_MODEL = "tiny-embed"
"""The embedding workers' served model name (the generation worker's is its directory)."""
EMBED_QUEUE = f"streamq:queue:{EMBED_MODEL}-{uuid.uuid4().hex[:8]}"
EMBED_MAX_MODEL_LEN = 256
EMBEDDING_DIMENSIONS = 128
"""The tiny model's hidden size: its vectors' length."""

TEXTS = [
    "The future of artificial intelligence is",
    "In a galaxy far, far away",
    "Redis streams carry tokens\nacross lines",
    "a",
    "The key to happiness is " * 5,
]
TOKEN_INPUTS = [[1, 45, 254, 31], [2, 3, 4, 5, 6, 7, 8, 9], [17]]
"""Ids of the tiny model's 384-token vocabulary."""
LONG_TEXT = "streams of tokens " * 200
"""Well past the embedding worker's 256-token context."""
TRUNCATE = 10
TOLERANCE = 1e-5


def embedding_flags(model_dir: Path) -> list[str]:
    return [
        *tiny_engine_flags(model_dir, max_model_len=EMBED_MAX_MODEL_LEN),
        *("--runner", "pooling", "--convert", "embed", "--served-model-name", EMBED_MODEL),
        *("--callback-backoff-s", "0.5"),
    ]


def embedding_worker(redis_url: str, model_dir: Path, log_path: Path) -> WorkerProcess:
    env = worker_env(**{CALLBACK_SECRET_ENV: CALLBACK_SECRET})
    return WorkerProcess(redis_url, embedding_flags(model_dir), queue=EMBED_QUEUE, log_path=log_path, env=env)


@pytest.fixture(scope="module")
def embedder(
    worker: WorkerProcess, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[WorkerProcess]:
    """The module's embedding worker, on the session Redis beside the generation worker
    (started after it: two engines do not start at once)."""
    process = embedding_worker(worker.redis_url, tiny_model, tmp_path_factory.mktemp("embedder") / "worker.log")
    process.start().wait_ready()
    yield process
    code = process.stop()
    assert code == 0, f"embedding worker exited with {code}:\n{process.log_tail()}"


@pytest.fixture(scope="module")
def reference(tiny_model: Path, embedder: WorkerProcess) -> dict[str, Any]:
    """vLLM's offline answers: started after the workers, so no two engines start at once."""
    return offline_embeddings(
        tiny_model, EMBED_MAX_MODEL_LEN, [*TEXTS, *TOKEN_INPUTS], tokenize=[LONG_TEXT], dimensions=64
    )


@pytest.fixture
async def client(worker: WorkerProcess, embedder: WorkerProcess, producer_url: str) -> AsyncIterator[StreamqClient]:
    async with await StreamqClient.connect(producer_url, queue=worker.queue) as client:
        yield client


@pytest.fixture(scope="module")
def receiver() -> Iterator[CallbackReceiver]:
    with CallbackReceiver() as receiver:
        yield receiver


def close(vectors: list[Any], expected: list[list[float]]) -> bool:
    return len(vectors) == len(expected) and all(
        numpy.allclose(v, numpy.asarray(e, dtype=numpy.float32), atol=TOLERANCE)
        for v, e in zip(vectors, expected, strict=True)
    )


async def all_events(client: StreamqClient, **request: Any) -> tuple[str, list[Event]]:
    handle = await client.submit(None, model=EMBED_MODEL, **request)
    async with handle:
        return handle.request_id, [event async for event in handle]


async def test_embed_answers_what_vllm_offline_embed_answers(client: StreamqClient, reference: dict[str, Any]) -> None:
    """Texts and token-id lists in one call: each vector and token count as vLLM's own."""
    pooled = await client.embed([*TEXTS, *TOKEN_INPUTS], model=EMBED_MODEL)
    assert len(pooled) == len(TEXTS) + len(TOKEN_INPUTS)
    assert pooled.shapes == [[len(v)] for v in reference["vectors"]]
    assert close(pooled.vectors, reference["vectors"])
    assert close([numpy.asarray(v) for v in pooled.as_lists()], reference["vectors"])
    assert pooled.prompt_tokens == reference["prompt_tokens"]
    assert pooled.prompt_tokens[len(TEXTS) :] == [len(ids) for ids in TOKEN_INPUTS]
    assert pooled.total_prompt_tokens == sum(reference["prompt_tokens"])
    # One text alone and one token-id list alone are one input each.
    alone = await client.embed(TEXTS[0], model=EMBED_MODEL)
    assert close(alone.vectors, reference["vectors"][:1])
    ids = await client.embed(TOKEN_INPUTS[0], model=EMBED_MODEL)
    assert close(ids.vectors, reference["vectors"][len(TEXTS) : len(TEXTS) + 1])


async def test_truncate_prompt_tokens_embeds_the_first_tokens(client: StreamqClient, reference: dict[str, Any]) -> None:
    """A pooling model keeps an input's first tokens (vLLM's pooling tokenizers truncate on
    the right): the vector is that of the first ``TRUNCATE`` token ids, text or ids."""
    (long_ids,) = reference["token_ids"]
    kept = long_ids[:TRUNCATE]
    pooled = await client.embed([LONG_TEXT, long_ids], model=EMBED_MODEL, truncate_prompt_tokens=TRUNCATE)
    assert pooled.prompt_tokens == [TRUNCATE, TRUNCATE]
    expected = await client.embed(kept, model=EMBED_MODEL)
    assert close(pooled.vectors, [expected.as_lists()[0]] * 2)
    # -1: as many as the context holds (a pooling request leaves none for output).
    whole = await client.embed([LONG_TEXT, long_ids], model=EMBED_MODEL, truncate_prompt_tokens=-1)
    assert whole.prompt_tokens == [EMBED_MAX_MODEL_LEN] * 2
    expected = await client.embed(long_ids[:EMBED_MAX_MODEL_LEN], model=EMBED_MODEL)
    assert close(whole.vectors, [expected.as_lists()[0]] * 2)
    with pytest.raises(RequestError, match=f"cannot be greater than max_model_len = {EMBED_MAX_MODEL_LEN}"):
        await client.embed(["short"], model=EMBED_MODEL, truncate_prompt_tokens=EMBED_MAX_MODEL_LEN + 1)


async def test_the_stored_result_keeps_the_request_but_not_its_inputs(
    client: StreamqClient, raw_redis: aioredis.Redis
) -> None:
    """arq's result of a pooling job (kept an hour) names the request without its inputs: a
    corpus is not kept twice."""
    request_id = f"embed-{uuid.uuid4().hex}"
    await client.embed(TEXTS, model=EMBED_MODEL, request_id=request_id)
    result = await job_result(raw_redis, request_id)
    assert result["s"] is True
    (stored,) = result["a"]
    # The task embed is the default, left out of the JSON.
    assert (stored["request_id"], stored["model"], stored["pooling"]) == (request_id, EMBED_MODEL, {})
    assert "inputs" not in stored


@pytest.mark.parametrize("long_input", [LONG_TEXT, list(range(3, 3 + EMBED_MAX_MODEL_LEN + 1))], ids=["text", "ids"])
async def test_a_too_long_input_names_its_index(client: StreamqClient, long_input: str | list[int]) -> None:
    with pytest.raises(RequestError) as error:
        await client.embed(["short", long_input], model=EMBED_MODEL)
    assert error.value.code == "invalid_request"
    assert str(error.value).count("inputs[1]: ") == 1
    assert f"maximum context length is {EMBED_MAX_MODEL_LEN} tokens" in str(error.value)


async def test_dimensions_are_refused_as_vllm_refuses_them(client: StreamqClient, reference: dict[str, Any]) -> None:
    """The tiny model is no Matryoshka model: vLLM refuses ``dimensions``, and its message
    (naming the served model) reaches the caller."""
    offline = reference["dimensions_error"]
    assert offline is not None and "dimensions must be unset" in offline
    with pytest.raises(RequestError) as error:
        await client.embed(["Hello"], model=EMBED_MODEL, dimensions=64)
    assert error.value.code == "invalid_request"
    tail = offline.split("does not support", 1)[1]
    assert f"Model {EMBED_MODEL!r} does not support{tail}" in str(error.value)


async def test_each_model_gets_requests_of_its_kind(client: StreamqClient, model: str) -> None:
    """Generation to the generation worker, pooling to the embedding worker; a request of
    the wrong kind is refused before it is enqueued, with vLLM's message."""
    completion = await client.generate("Hello there", model=model, max_tokens=4, ignore_eos=True)
    assert completion.completion_tokens == 4
    pooled = await client.embed(["Hello there"], model=EMBED_MODEL)
    assert pooled.shapes == [[128]]
    with pytest.raises(InvalidRequest, match="This model does not support generation"):
        await client.generate("Hello there", model=EMBED_MODEL, max_tokens=4)
    with pytest.raises(InvalidRequest, match="This model does not support pooling"):
        await client.embed(["Hello there"], model=model)
    with pytest.raises(InvalidRequest, match="Unsupported task: 'classify'"):
        await client.classify(["Hello there"], model=EMBED_MODEL)


@pytest.mark.parametrize(
    ("inputs", "message"),
    [
        ([], "inputs must not be empty"),
        (["fine", []], "inputs[1] is an empty token-id list"),
        ([{"text": "a dict"}], "inputs[0] must be a text or a list of token ids, got dict"),
        (["fine", 3.5], "inputs[1] must be a text or a list of token ids, got float"),
        ({"text": "a dict"}, "inputs must be a text, a token-id list or a list of them, got dict"),
        (["x"] * (MAX_POOLING_INPUTS + 1), f"the limit is {MAX_POOLING_INPUTS}"),
    ],
    ids=["no inputs", "empty token list", "a dict input", "a float input", "a dict of inputs", "too many"],
)
async def test_bad_inputs_are_refused_at_the_client(client: StreamqClient, inputs: Any, message: str) -> None:
    with pytest.raises((InvalidRequest, ValueError)) as error:
        await client.embed(inputs, model=EMBED_MODEL)
    assert message in str(error.value)


async def enqueue_raw(redis: aioredis.Redis, job_id: str, request: Any) -> None:
    """Enqueue a job payload on the embedding queue by PROTOCOL.md's commands, as
    tests/real_engine/test_bad_input.py does on the default queue."""
    score = int(time.time() * 1000)
    payload = json.dumps({"t": 1, "f": "generate", "a": [request], "k": {}, "et": score})
    await redis.set(JOB_KEY_PREFIX + job_id, payload, px=86_400_000)
    async with redis.pipeline(transaction=True) as index:
        index.zadd(EMBED_QUEUE, {job_id: score})
        index.hset(f"{EMBED_QUEUE}:indexed", job_id, "0 default")
        index.zadd(f"{EMBED_QUEUE}:waiting:0", {job_id: score})
        index.zadd(f"{EMBED_QUEUE}:fifo:0:default", {job_id: score})
        index.zadd(f"{EMBED_QUEUE}:tenants:0", {"default": 0}, nx=True)
        index.zadd(f"{EMBED_QUEUE}:bands", {"0": 0})
        await index.execute()
    await redis.publish(WAKEUP_CHANNEL, EMBED_QUEUE)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"inputs": [], "pooling": {"task": "embed"}}, "inputs must not be empty"),
        ({"inputs": [[]], "pooling": {"task": "embed"}}, "inputs[0] is an empty token-id list"),
        ({"inputs": [{"a": 1}], "pooling": {"task": "embed"}}, "inputs"),
        ({"inputs": ["x"]}, "'inputs' and 'pooling' go together"),
        ({"inputs": ["x"], "pooling": {"task": "embed", "dimensions": 0}}, "dimensions must be positive"),
        ({"inputs": ["x"], "pooling": {"task": "token_embed"}}, "task"),
        ({"inputs": ["x"], "pooling": {"task": "embed"}, "sampling": {"max_tokens": 3}}, "no generation fields"),
        ({"inputs": ["x"], "pooling": {"task": "embed"}, "prompt": "y"}, "exactly one"),
        ({"inputs": [[-1]], "pooling": {"task": "embed"}}, "token ids must be 0 or more"),
    ],
    ids=[
        "empty",
        "empty ids",
        "dict",
        "no pooling",
        "zero dims",
        "token_embed",
        "sampling",
        "and a prompt",
        "negative",
    ],
)
async def test_a_malformed_pooling_job_ends_in_an_error_event(
    client: StreamqClient, raw_redis: aioredis.Redis, redis_url: str, fields: dict[str, Any], message: str
) -> None:
    request_id = f"bad-pool-{uuid.uuid4().hex}"
    job = {"request_id": request_id, **fields}
    events = await capture_events(redis_url, request_id, lambda: enqueue_raw(raw_redis, request_id, job))
    assert [e["type"] for e in events] == ["error"], events
    (error,) = events
    assert error["code"] == "invalid_request" and message in error["message"]
    assert (await job_result(raw_redis, request_id))["s"] is False
    # ... and the worker goes on serving.
    assert (await client.embed(["still there?"], model=EMBED_MODEL)).shapes == [[128]]


@contextmanager
def engine_stopped(worker: WorkerProcess) -> Iterator[None]:
    """SIGSTOP the worker's engine processes (not the worker: it goes on reading cancels),
    so a request it runs is held in the engine until the block ends."""
    assert worker.process is not None
    children = psutil.Process(worker.process.pid).children(recursive=True)
    assert children, "the engine core runs in a process of its own"
    for child in children:
        os.kill(child.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        for child in children:
            with contextlib.suppress(ProcessLookupError):  # killed meanwhile
                os.kill(child.pid, signal.SIGCONT)


async def until_running(client: StreamqClient, request_id: str) -> str:
    """The worker id running ``request_id``, once one does."""
    async with asyncio.timeout(60):
        while (status := await client.status(request_id)).state != "running":
            assert status.state == "queued", status
            await asyncio.sleep(0.005)
    assert status.worker_id is not None
    return status.worker_id


async def test_a_cancelled_pooling_request_ends_cancelled_without_results(
    client: StreamqClient, embedder: WorkerProcess, receiver: CallbackReceiver
) -> None:
    path = f"/cancelled-{uuid.uuid4().hex}"
    request_id = f"cancel-pool-{uuid.uuid4().hex}"
    with engine_stopped(embedder):
        handle = await client.submit(
            None,
            request_id=request_id,
            model=EMBED_MODEL,
            inputs=TEXTS,
            pooling=Pooling(task="embed"),
            callback={"url": receiver.url(path)},
        )
        async with handle:
            await until_running(client, request_id)
            await client.cancel(request_id)
            events = [event async for event in handle]
    assert [type(e) for e in events] == [FinalEvent], events
    assert isinstance(events[0], FinalEvent) and events[0].finish_reasons == ["cancelled"]
    status = await client.status(request_id)
    assert (status.state, status.finish_reasons) == ("finished", ["cancelled"])
    (delivery,) = await asyncio.to_thread(receiver.wait, path)
    body = msgspec.json.decode(delivery.body, type=CallbackBody)
    assert (body.request_id, body.state, body.finish_reasons) == (request_id, "finished", ["cancelled"])


async def test_a_pooling_request_past_its_deadline_times_out(client: StreamqClient) -> None:
    _, events = await all_events(client, inputs=TEXTS, pooling=Pooling(task="embed"), deadline_s=0.001)
    assert [type(e) for e in events] == [FinalEvent], events
    assert isinstance(events[0], FinalEvent) and events[0].finish_reasons == ["timeout"]


async def test_a_finished_pooling_request_has_its_status_and_callback(
    client: StreamqClient, receiver: CallbackReceiver
) -> None:
    path = f"/pooled-{uuid.uuid4().hex}"
    request_id, events = await all_events(
        client, inputs=TEXTS, pooling=Pooling(task="embed"), callback={"url": receiver.url(path)}
    )
    pooled, final = events
    assert isinstance(pooled, PooledEvent) and isinstance(final, FinalEvent)
    assert (final.finish_reasons, final.prompt_tokens, final.completion_tokens) == (
        ["stop"],
        sum(pooled.prompt_tokens),
        0,
    )
    status = await client.status(request_id)
    assert (status.state, status.finish_reasons, status.prompt_tokens) == ("finished", ["stop"], final.prompt_tokens)
    (delivery,) = await asyncio.to_thread(receiver.wait, path)
    body = msgspec.json.decode(delivery.body, type=CallbackBody)
    assert (body.request_id, body.state, body.finish_reasons) == (request_id, "finished", ["stop"])
    assert (body.prompt_tokens, body.completion_tokens) == (final.prompt_tokens, 0)


async def test_a_pooling_request_whose_worker_died_is_run_again(
    client: StreamqClient, embedder: WorkerProcess, tiny_model: Path, tmp_path: Path
) -> None:
    """Many inputs on a second embedding worker, SIGKILLed (engine too) as it runs them;
    the module's worker, paused until then, runs the request again: one pooled event with
    every vector, one final, the answer of an undisturbed run."""
    inputs = [f"{i} {TEXTS[i % len(TEXTS)]}" for i in range(256)]
    doomed = embedding_worker(embedder.redis_url, tiny_model, tmp_path / "doomed.log").start()
    try:
        async with asyncio.timeout(300):
            while SIZED_LINE not in doomed.log_tail(200):
                assert doomed.process is not None and doomed.process.poll() is None, doomed.log_tail()
                await asyncio.sleep(0.2)
        request_id = f"take-over-pool-{uuid.uuid4().hex}"
        with paused(embedder):
            handle = await client.submit(
                None, request_id=request_id, model=EMBED_MODEL, inputs=inputs, pooling=Pooling()
            )
            with engine_stopped(doomed):  # held mid-request until it dies
                running_on = await until_running(client, request_id)
                assert doomed.process is not None and pid_of(running_on) == doomed.process.pid
                doomed.kill()
        async with handle:
            events = [event async for event in handle]
    finally:
        doomed.kill()
    pooled = [e for e in events if isinstance(e, PooledEvent)]
    finals = [e for e in events if isinstance(e, (FinalEvent, ErrorEvent))]
    assert len(pooled) == 1 and len(finals) == 1 and events[-1] is finals[0], events
    assert isinstance(finals[0], FinalEvent) and finals[0].attempt == 2 and finals[0].finish_reasons == ["stop"]
    assert pooled[0].attempt == 2 and len(pooled[0].shapes) == len(inputs)
    calm = await client.embed(inputs, model=EMBED_MODEL)
    assert pooled[0].prompt_tokens == calm.prompt_tokens
    assert pooled[0].shapes == calm.shapes
    assert numpy.allclose(
        numpy.frombuffer(pooled[0].data, dtype="<f4"), numpy.frombuffer(calm.data, dtype="<f4"), atol=TOLERANCE
    )


def test_the_docs_client_example_finds_the_closest_document(embedder: WorkerProcess, producer_url: str) -> None:
    """docs/features/pooling-models.md's example, run as a reader runs it, finds the document
    the blocking client's vectors say is closest to its query."""
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(root), "REDIS_URL": producer_url, "STREAMQ_EMBED_MODEL": EMBED_MODEL}
    run = subprocess.run(
        [sys.executable, str(root / "docs" / "examples" / "client_embed.py")],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=root,
    )
    assert run.returncode == 0, run.stderr
    documents = ["Redis keeps the queue.", "vLLM runs the model.", "Workers pull jobs."]
    with BlockingClient.connect(producer_url) as client:
        embedded = client.embed(documents, model=EMBED_MODEL)
        query = client.embed("Where do jobs wait?", model=EMBED_MODEL).vectors[0]
    closest = documents[int(numpy.argmax([vector @ query for vector in embedded.vectors]))]
    assert run.stdout.splitlines() == [
        closest,
        f"{EMBEDDING_DIMENSIONS} dimensions; {embedded.prompt_tokens} tokens per document",
    ]
