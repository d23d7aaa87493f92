"""Bad input gets a clear error event and a failed job; the worker keeps serving."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from functools import partial
from typing import Any

import pytest
import redis.asyncio as aioredis

from devkit.worker_process import WorkerProcess
from producer.client import StreamqClient
from producer.errors import RequestError
from streamq.protocol import (
    BAD_PAYLOAD_MARKER,
    DEFAULT_QUEUE,
    IN_PROGRESS_PREFIX,
    JOB_KEY_PREFIX,
    WAKEUP_CHANNEL,
    InvalidRequest,
)
from tests.support.events import assert_well_formed, capture_events, job_result
from tests.support.session import MAX_MODEL_LEN


def arq_job(request: Any, **overrides: Any) -> bytes:
    """A job payload as arq stores it; an override of ``...`` leaves that field out."""
    job = {"t": 1, "f": "generate", "a": [request], "k": {}, "et": now_ms(), **overrides}
    return json.dumps({name: value for name, value in job.items() if value is not ...}).encode()


def now_ms() -> int:
    return int(time.time() * 1000)


def deeply_nested_args(depth: int) -> bytes:
    return f'{{"t":1,"f":"generate","a":{"[" * depth}{"]" * depth},"k":{{}},"et":{now_ms()}}}'.encode()


def good_request(request_id: str, **fields: Any) -> dict[str, Any]:
    return {"request_id": request_id, "prompt": "Hello there", "sampling": {"max_tokens": 4}, **fields}


# (case, job payload as stored in Redis, text the error message must contain)
BAD_JOBS = [
    ("negative temperature", lambda rid: arq_job(good_request(rid, sampling={"temperature": -1.0})), "temperature"),
    ("top_p above 1", lambda rid: arq_job(good_request(rid, sampling={"top_p": 1.5})), "top_p"),
    ("zero max_tokens", lambda rid: arq_job(good_request(rid, sampling={"max_tokens": 0})), "max_tokens"),
    ("zero n", lambda rid: arq_job(good_request(rid, sampling={"n": 0})), "n"),
    ("empty prompt", lambda rid: arq_job(good_request(rid, prompt="")), "prompt must not be empty"),
    (
        "prompt longer than max_model_len",
        lambda rid: arq_job(good_request(rid, prompt="hello " * (MAX_MODEL_LEN + 10))),
        "maximum context length",
    ),
    ("unknown top-level field", lambda rid: arq_job(good_request(rid, priorty=3)), "priorty"),
    ("unknown sampling field", lambda rid: arq_job(good_request(rid, sampling={"temprature": 0.5})), "temprature"),
    ("wrong type", lambda rid: arq_job(good_request(rid, sampling={"max_tokens": "many"})), "max_tokens"),
    (
        "prompt and messages",
        lambda rid: arq_job(good_request(rid, messages=[{"role": "user", "content": "x"}])),
        "exactly one",
    ),
    ("neither prompt nor messages", lambda rid: arq_job({"request_id": rid}), "exactly one"),
    ("empty messages", lambda rid: arq_job({"request_id": rid, "messages": []}), "messages must not be empty"),
    ("not JSON", lambda rid: b"\x80\x04\x95 definitely not json", "not valid JSON"),
    ("JSON but not an object", lambda rid: b"[1, 2, 3]", "JSON object"),
    ("missing request id", lambda rid: arq_job({"prompt": "Hello"}), "request_id"),
    ("request id differs from job id", lambda rid: arq_job(good_request(rid + "-other")), "job id"),
    ("request is not an object", lambda rid: arq_job("Hello"), "Expected `object`"),
    ("unknown job function", lambda rid: arq_job(good_request(rid), f="os.system"), "unknown job function"),
    ("keyword arguments", lambda rid: arq_job(good_request(rid), k={"extra": 1}), "no keywords"),
    (
        "two positional arguments",
        lambda rid: arq_job(good_request(rid), a=[good_request(rid), 1]),
        "exactly one positional",
    ),
    ("no arguments", lambda rid: arq_job(good_request(rid), a=[]), "exactly one positional"),
    ("arguments not a list", lambda rid: arq_job(good_request(rid), a={"x": 1}), "`$.a`"),
    ("missing enqueue time", lambda rid: arq_job(good_request(rid), et=...), "`et`"),
    ("request id of another request's keys", lambda rid: arq_job(good_request("../" + rid)), "request_id must match"),
    ("request id too long", lambda rid: arq_job(good_request("x" * 200)), "request_id must match"),
    ("request id not a string", lambda rid: arq_job(good_request(12345)), "request_id"),
    ("prompt not a string", lambda rid: arq_job(good_request(rid, prompt=["a", "b"])), "prompt"),
    ("message without content", lambda rid: arq_job({"request_id": rid, "messages": [{"role": "user"}]}), "content"),
    (
        "message with unknown field",
        lambda rid: arq_job({"request_id": rid, "messages": [{"role": "user", "content": "x", "mood": "glad"}]}),
        "mood",
    ),
    ("sampling not an object", lambda rid: arq_job(good_request(rid, sampling=[1, 2])), "sampling"),
    ("stop not a list of strings", lambda rid: arq_job(good_request(rid, sampling={"stop": [1, 2]})), "stop"),
    ("negative deadline", lambda rid: arq_job(good_request(rid, deadline_s=-1)), "deadline_s must be positive"),
    ("prompt over the size limit", lambda rid: arq_job(good_request(rid, prompt="x" * 1_000_001)), "limit"),
    ("payload over the size limit", lambda rid: b"{" + b" " * 8_000_001 + b"}", "bytes; the limit"),
    ("top_k below -1", lambda rid: arq_job(good_request(rid, sampling={"top_k": -5})), "top_k"),
    ("empty UTF-8-invalid bytes", lambda rid: b"\xff\xfe", "not valid JSON"),
    # The arq envelope: values arq would otherwise use outside its own error handling.
    ("try number a string", lambda rid: arq_job(good_request(rid), t="1"), "`$.t`"),
    ("try number missing", lambda rid: arq_job(good_request(rid), t=...), "`t`"),
    ("try number zero", lambda rid: arq_job(good_request(rid), t=0), "try number"),
    ("try number negative", lambda rid: arq_job(good_request(rid), t=-3), "try number"),
    ("try number 10**30", lambda rid: arq_job(good_request(rid), t=10**30), "try number"),
    ("try number past the bound", lambda rid: arq_job(good_request(rid), t=1001), "try number"),
    ("try number a bool", lambda rid: arq_job(good_request(rid), t=True), "`$.t`"),
    ("try number a float", lambda rid: arq_job(good_request(rid), t=1.0), "`$.t`"),
    ("enqueue time in microseconds", lambda rid: arq_job(good_request(rid), et=now_ms() * 1000), "enqueue time"),
    ("enqueue time in seconds", lambda rid: arq_job(good_request(rid), et=now_ms() // 1000), "enqueue time"),
    ("enqueue time a string", lambda rid: arq_job(good_request(rid), et=str(now_ms())), "`$.et`"),
    ("enqueue time negative", lambda rid: arq_job(good_request(rid), et=-1), "enqueue time"),
    ("enqueue time 10**30", lambda rid: arq_job(good_request(rid), et=10**30), "enqueue time"),
    ("enqueue time a float", lambda rid: arq_job(good_request(rid), et=now_ms() + 0.5), "`$.et`"),
    ("enqueue time null", lambda rid: arq_job(good_request(rid), et=None), "`$.et`"),
    ("enqueue time NaN", lambda rid: arq_job(good_request(rid), et=float("nan")), "not valid JSON"),
    ("enqueue time two days ahead", lambda rid: arq_job(good_request(rid), et=now_ms() + 2 * 86_400_000), "enqueue"),
    ("keywords a list", lambda rid: arq_job(good_request(rid), k=[]), "`$.k`"),
    ("keyword named ctx", lambda rid: arq_job(good_request(rid), k={"ctx": 1}), "no keywords"),
    ("smuggled bad-payload marker", lambda rid: arq_job(good_request(rid), k={BAD_PAYLOAD_MARKER: 1}), "no keywords"),
    ("function not a string", lambda rid: arq_job(good_request(rid), f=7), "`$.f`"),
    ("function missing", lambda rid: arq_job(good_request(rid), f=...), "`f`"),
    ("arguments missing", lambda rid: arq_job(good_request(rid), a=...), "`a`"),
    ("arguments nested 40 deep", lambda rid: deeply_nested_args(40), "nests deeper"),
    ("arguments nested past the recursion limit", lambda rid: deeply_nested_args(990), "nests too deeply"),
    ("JSON null", lambda rid: b"null", "JSON object"),
    ("keywords null", lambda rid: arq_job(good_request(rid), k=None), "`$.k`"),
]


async def enqueue_raw(redis: aioredis.Redis, job_id: str, payload: bytes) -> None:
    """Enqueue as a service in another language would, by PROTOCOL.md's commands: SET the
    job, queue and index it (priority 0, the default tenant), wake the workers. (A job
    queued without the index waits for the claim's scan, up to a second: tests of the claim
    cover that, in tests/no_engine/test_claim_order.py.)"""
    score, queue = int(time.time() * 1000), DEFAULT_QUEUE
    await redis.set(JOB_KEY_PREFIX + job_id, payload, px=86_400_000)
    async with redis.pipeline(transaction=True) as index:
        index.zadd(queue, {job_id: score})
        index.hset(f"{queue}:indexed", job_id, "0 default")
        index.zadd(f"{queue}:waiting:0", {job_id: score})
        index.zadd(f"{queue}:fifo:0:default", {job_id: score})
        index.zadd(f"{queue}:tenants:0", {"default": 0}, nx=True)
        index.zadd(f"{queue}:bands", {"0": 0})
        await index.execute()
    await redis.publish(WAKEUP_CHANNEL, queue)


@pytest.mark.parametrize(("case", "payload", "message"), BAD_JOBS, ids=[c[0] for c in BAD_JOBS])
async def test_bad_job_gets_error_event_and_failed_result(
    worker: WorkerProcess, raw_redis: aioredis.Redis, redis_url: str, case: str, payload: Any, message: str
) -> None:
    job_id = f"bad-{uuid.uuid4().hex}"
    events = await capture_events(redis_url, job_id, lambda: enqueue_raw(raw_redis, job_id, payload(job_id)))

    assert_well_formed(events, job_id)
    [error] = events
    assert error["type"] == "error" and error["code"] == "invalid_request"
    assert message in error["message"]
    result = await job_result(raw_redis, job_id)
    assert result["s"] is False  # arq recorded a failed job
    assert result["t"] == 1  # tried once...
    assert await raw_redis.zscore(DEFAULT_QUEUE, job_id) is None  # ...and not queued again


async def test_worker_keeps_serving_after_bad_jobs(
    worker: WorkerProcess, raw_redis: aioredis.Redis, client: StreamqClient, redis_url: str
) -> None:
    job_ids = [f"bad-{uuid.uuid4().hex}" for _ in BAD_JOBS]
    ends = await asyncio.gather(  # every bad job at once: a burst, not one after another
        *(
            capture_events(redis_url, job_id, partial(enqueue_raw, raw_redis, job_id, payload(job_id)))
            for job_id, (_, payload, _) in zip(job_ids, BAD_JOBS, strict=True)
        )
    )
    assert [events[-1]["type"] for events in ends] == ["error"] * len(BAD_JOBS)
    completion = await (await client.submit("Still there?", max_tokens=4, ignore_eos=True)).result()
    assert completion.completion_tokens == 4
    assert worker.process is not None and worker.process.poll() is None
    # None of them is left running, queued, or waiting for a retry.
    for job_id in job_ids:
        assert await raw_redis.exists(IN_PROGRESS_PREFIX + job_id, JOB_KEY_PREFIX + job_id) == 0
        assert await raw_redis.zscore(DEFAULT_QUEUE, job_id) is None


async def test_library_rejects_malformed_requests_before_sending(
    client: StreamqClient, raw_redis: aioredis.Redis
) -> None:
    queued_before = await raw_redis.zcard(DEFAULT_QUEUE)
    for kwargs in (
        {"prompt": ""},
        {"prompt": "x", "temprature": 0.5},
        {"prompt": "x", "max_tokens": "many"},
        {"prompt": "x", "request_id": "has spaces and / slashes"},
        {"prompt": "x", "messages": [{"role": "user", "content": "y"}]},
        {},
    ):
        with pytest.raises(InvalidRequest):
            await client.submit(**kwargs)
    assert await raw_redis.zcard(DEFAULT_QUEUE) == queued_before


async def test_library_reports_engine_validation_errors(client: StreamqClient) -> None:
    handle = await client.submit("Hello", temperature=-0.5)
    with pytest.raises(RequestError) as raised:
        await handle.result()
    assert raised.value.code == "invalid_request"
    assert "temperature" in raised.value.message
