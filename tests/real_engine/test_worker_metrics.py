"""A worker's Prometheus endpoint: the numbers move by what the requests did.

Scrapes the session worker before and after a few requests and checks the
differences against what the subscriber itself saw (tokens, chunks, events).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections import Counter
from collections.abc import Callable

import redis.asyncio as aioredis

from devkit.worker_process import WorkerProcess
from producer.client import StreamqClient
from streamq.protocol import ChunkEvent, ErrorEvent, FinalEvent
from tests.support.metrics import scrape, value


async def wait_for(check: Callable[[], bool], timeout_s: float = 15.0) -> None:
    """Poll ``check`` until it holds (a worker updates some numbers just after the
    subscriber's last event); the caller asserts the values themselves afterwards."""
    deadline = time.monotonic() + timeout_s
    while not check() and time.monotonic() < deadline:
        await asyncio.sleep(0.1)


async def test_request_metrics_move_by_what_the_requests_did(
    client: StreamqClient, worker: WorkerProcess, model: str
) -> None:
    before = scrape(worker)
    handles = [
        await client.submit("The key to happiness is", max_tokens=5, temperature=0, ignore_eos=True),
        await client.submit("Once upon a time", n=2, max_tokens=3, ignore_eos=True),
        await client.submit("Too cold", temperature=-1.0),  # vLLM refuses it on the worker
    ]
    chunks: Counter[tuple[str, int]] = Counter()
    tokens = events = 0
    kinds: list[str] = []
    for handle in handles:
        async for event in handle:
            events += 1
            if isinstance(event, ChunkEvent):
                chunks[handle.request_id, event.index] += 1
                tokens += len(event.token_ids)
            elif isinstance(event, (FinalEvent, ErrorEvent)):
                kinds.append("final" if isinstance(event, FinalEvent) else f"error:{event.code}")
    assert kinds == ["final", "final", "error:invalid_request"]
    assert tokens == 5 + 2 * 3

    def delta(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    after = scrape(worker)

    def settled() -> bool:
        nonlocal after
        after = scrape(worker)
        return value(after, "streamq_requests_in_flight") == 0 and delta("streamq_publish_batch_events_sum") == events

    await wait_for(settled)
    assert value(after, "streamq_requests_in_flight") == 0
    assert delta("streamq_generated_tokens_total") == tokens
    assert delta("streamq_chunks_total") == sum(chunks.values())
    assert delta("streamq_completions_finished_total", finish_reason="length") == 3
    assert delta("streamq_completions_finished_total", finish_reason="stop") == 0
    assert delta("streamq_request_errors_total", code="invalid_request") == 1
    assert delta("streamq_requests_finished_total") == 2  # per request, not per completion
    assert delta("streamq_model_requests_finished_total", model=model) == 2  # the served model's name
    assert delta("streamq_model_completion_tokens_total", model=model) == tokens
    assert delta("streamq_queue_wait_seconds_count") == 3
    assert delta("streamq_time_to_first_token_seconds_count") == 2  # the two requests that made tokens
    assert delta("streamq_time_to_first_token_seconds_sum") > 0
    # Latencies are per engine DELTA; a chunk event holds one DELTA, or several merged.
    deltas = delta("streamq_deltas_total")
    assert sum(chunks.values()) <= deltas <= tokens
    assert delta("streamq_inter_token_latency_seconds_count") == deltas - len(chunks)
    # Every event the subscriber got went out in some publisher round trip, each timed.
    assert delta("streamq_publish_batch_events_sum") == events
    batches = delta("streamq_publish_batch_events_count")
    assert 1 <= batches <= events
    assert delta("streamq_publish_seconds_count") == batches
    assert delta("streamq_publish_seconds_sum") > 0


async def test_queue_depth_gauge_follows_the_queue(worker: WorkerProcess, raw_redis: aioredis.Redis) -> None:
    # A job scheduled a day ahead waits in the queue; no worker takes it before then.
    parked = f"test-parked-{uuid.uuid4().hex}"
    gauge = ("streamq_queue_depth", frozenset({("queue", worker.queue)}))
    await raw_redis.zadd(worker.queue, {parked: (time.time() + 86_400) * 1000})
    try:
        expected = await raw_redis.zcard(worker.queue)
        assert expected >= 1
        await wait_for(lambda: scrape(worker).get(gauge) == expected)
        assert scrape(worker).get(gauge) == expected
    finally:
        await raw_redis.zrem(worker.queue, parked)
    expected = await raw_redis.zcard(worker.queue)
    await wait_for(lambda: scrape(worker).get(gauge) == expected)
    assert scrape(worker).get(gauge) == expected
