"""Every way arq can end a job without the job function still ends its request with
exactly one terminal event (the code each maps to: tests/no_engine/test_job_failure_codes.py)."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import redis.asyncio as aioredis

from devkit.worker_process import WorkerProcess, scripted_worker
from producer.client import StreamqClient
from streamq.protocol import (
    DEFAULT_QUEUE,
    JOB_KEY_PREFIX,
    RETRY_KEY_PREFIX,
    WAKEUP_CHANNEL,
    ChunkEvent,
    ErrorEvent,
    serialize_job,
)
from tests.support.events import assert_well_formed, capture_events


@pytest.fixture
async def redis(redis_url: str) -> AsyncIterator[aioredis.Redis]:
    client = aioredis.Redis.from_url(redis_url)
    yield client
    await client.aclose()


async def _enqueue_raw_id(redis: aioredis.Redis, job_id: str, *, payload: bytes | None) -> None:
    if payload is not None:
        await redis.set(JOB_KEY_PREFIX + job_id, payload, px=60_000)
    await redis.zadd(DEFAULT_QUEUE, {job_id: int(time.time() * 1000)})
    await redis.publish(WAKEUP_CHANNEL, DEFAULT_QUEUE)


async def _until_dequeued(redis: aioredis.Redis, job_id: str) -> None:
    """arq takes the job off the queue right after its error event goes out."""
    async with asyncio.timeout(10):
        while await redis.zscore(DEFAULT_QUEUE, job_id) is not None:
            await asyncio.sleep(0.02)


def _job(job_id: str) -> bytes:
    request = {"request_id": job_id, "prompt": "Hello", "sampling": {"max_tokens": 4}}
    return serialize_job({"t": 1, "f": "generate", "a": [request], "k": {}, "et": int(time.time() * 1000)})


async def test_a_job_whose_tries_ran_out_ends_with_retries_exhausted(
    worker: WorkerProcess, redis: aioredis.Redis, redis_url: str
) -> None:
    job_id = f"tries-{uuid.uuid4().hex}"

    async def enqueue_after_five_tries() -> None:
        await redis.set(RETRY_KEY_PREFIX + job_id, 5, ex=600)  # as after five hand-backs
        await _enqueue_raw_id(redis, job_id, payload=_job(job_id))

    [event] = await capture_events(redis_url, job_id, enqueue_after_five_tries)
    assert_well_formed([event], job_id)
    assert event["type"] == "error" and event["code"] == "retries_exhausted"
    await _until_dequeued(redis, job_id)


async def test_a_job_whose_payload_expired_ends_with_expired(
    worker: WorkerProcess, redis: aioredis.Redis, redis_url: str
) -> None:
    job_id = f"expired-{uuid.uuid4().hex}"
    [event] = await capture_events(redis_url, job_id, lambda: _enqueue_raw_id(redis, job_id, payload=None))
    assert_well_formed([event], job_id)
    assert event["type"] == "error" and event["code"] == "expired"
    await _until_dequeued(redis, job_id)


async def test_deadlines_run_on_redis_clock_not_the_producers(
    worker: WorkerProcess, redis: aioredis.Redis, redis_url: str
) -> None:
    """A producer whose clock is an hour behind writes an old ``et``; the queue score
    comes from Redis's clock (as the enqueue script writes it), and the worker measures
    waits on Redis's clock, so a 30 s queue-wait limit does not fire."""
    job_id = f"skewed-{uuid.uuid4().hex}"
    request = {"request_id": job_id, "prompt": "Hello", "sampling": {"max_tokens": 4}, "queue_timeout_s": 30}
    hour_ago_ms = int(time.time() * 1000) - 3_600_000
    payload = serialize_job({"t": 1, "f": "generate", "a": [request], "k": {}, "et": hour_ago_ms})

    async def enqueue_with_redis_score() -> None:
        seconds, micros = await redis.time()
        await redis.set(JOB_KEY_PREFIX + job_id, payload, px=60_000)
        await redis.zadd(DEFAULT_QUEUE, {job_id: seconds * 1000 + micros // 1000})
        await redis.publish(WAKEUP_CHANNEL, DEFAULT_QUEUE)

    events = await capture_events(redis_url, job_id, enqueue_with_redis_score)
    assert_well_formed(events, job_id)
    assert events[-1]["type"] == "final" and events[-1]["finish_reasons"] == ["length"]


async def test_a_job_past_the_workers_hard_limit_ends_with_timeout(
    worker_url: str, producer_url: str, tmp_path: Path
) -> None:
    """arq cancels a job that outruns ``job_timeout``; its request still ends, with an
    error event (code ``timeout``) after the tokens already sent (scripted engine)."""
    queue = f"streamq:queue:limited-{uuid.uuid4().hex[:8]}"
    worker = scripted_worker(worker_url, tmp_path / "worker.log", "--job-timeout", "1", queue=queue)
    worker.start().wait_ready(timeout_s=120)
    try:
        async with await StreamqClient.connect(producer_url, queue=queue) as client:
            handle = await client.submit("Take your time", max_tokens=1000)  # 10 s at 100 tokens/s
            events = [event async for event in handle]
    finally:
        assert worker.stop() == 0, worker.log_tail()
    *chunks, error = events
    assert [e.seq for e in events] == list(range(len(events)))
    assert chunks and all(isinstance(e, ChunkEvent) for e in chunks)
    assert isinstance(error, ErrorEvent) and error.code == "timeout"
