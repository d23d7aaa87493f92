"""Prometheus metrics of a worker, and the HTTP endpoint that serves them.

They share prometheus_client's default registry with vLLM's own (``vllm:*``), so one
scrape returns both. Latencies are measured inside the worker (a subscriber also sees
Redis and the network). The queue depth is a sampled ``ZCARD``: waiting plus running jobs,
the same on every worker of a queue (dashboards take the max).
"""

from __future__ import annotations

import asyncio
import logging
import os
from typing import Any, Final

from prometheus_client import Counter, Gauge, Histogram, start_http_server

from streamq.protocol import ErrorCode, FinishReason

logger = logging.getLogger("streamq.worker")

METRICS_PORT_ENV: Final = "STREAMQ_METRICS_PORT"
DEFAULT_METRICS_PORT: Final = 9400

# Buckets span a GPU's milliseconds to an overloaded CPU's seconds.
_LATENCY_BUCKETS: Final = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24)
_QUEUE_WAIT_BUCKETS: Final = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)
_BATCH_BUCKETS: Final = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096)

QUEUE_DEPTH = Gauge("streamq_queue_depth", "Jobs waiting or running in the queue (ZCARD), sampled", ["queue"])
REQUESTS_IN_FLIGHT = Gauge("streamq_requests_in_flight", "Jobs this worker is running now")
QUEUE_WAIT = Histogram(
    "streamq_queue_wait_seconds", "From enqueue to the start of the job on this worker", buckets=_QUEUE_WAIT_BUCKETS
)
TIME_TO_FIRST_TOKEN = Histogram(
    "streamq_time_to_first_token_seconds",
    "From the start of the job to its first DELTA handed to the publisher",
    buckets=_LATENCY_BUCKETS,
)
INTER_TOKEN_LATENCY = Histogram(
    "streamq_inter_token_latency_seconds",
    "Between successive engine DELTAs of one completion (a DELTA usually holds one token)",
    buckets=_LATENCY_BUCKETS,
)
GENERATED_TOKENS = Counter("streamq_generated_tokens", "Tokens generated and published, all completions")
DELTAS = Counter("streamq_deltas", "Engine DELTAs published, each alone or merged with others into one chunk event")
CHUNKS = Counter(
    "streamq_chunks",
    "Chunk events published; below streamq_deltas when DELTAs waiting behind a batch in flight were merged",
)
COMPLETIONS_FINISHED = Counter(
    "streamq_completions_finished",
    "Completions ended, by finish reason (a request with n=2 counts twice, as in vLLM)",
    ["finish_reason"],
)
REQUESTS_FINISHED = Counter(
    "streamq_requests_finished",
    "Requests this worker ended with a final event (cancelled and timed out too)",
)
MODEL_REQUESTS_FINISHED = Counter(
    "streamq_model_requests_finished",
    "Requests this worker ended with a final event, by the model they named: the base model or a LoRA adapter",
    ["model"],
)
MODEL_COMPLETION_TOKENS = Counter(
    "streamq_model_completion_tokens",
    "Completion tokens of the requests this worker ended with a final event (a taken-over request's "
    "earlier attempts' tokens included, as its usage counts them), by the model they named",
    ["model"],
)
REQUEST_EVENTS = Histogram(
    "streamq_request_events",
    "Events one attempt of a request published (chunks and its end), by whether it was streamed: "
    "a request that is not streamed writes a checkpoint every --checkpoint-tokens tokens",
    ["streamed"],
    buckets=_BATCH_BUCKETS,
)
REQUEST_ERRORS = Counter("streamq_request_errors", "Requests that ended with an error event, by error code", ["code"])
PUBLISH_SECONDS = Histogram(
    "streamq_publish_seconds",
    "From a batch's flush to its arrival in Redis (replay log + pub/sub): one round trip, more if Redis is retried",
    buckets=_LATENCY_BUCKETS,
)
PUBLISH_BATCH_EVENTS = Histogram(
    "streamq_publish_batch_events", "Events carried by one publisher round trip", buckets=_BATCH_BUCKETS
)
PUBLISH_FAILURES = Counter(
    "streamq_publish_failed_events",
    "Events Redis refused for good or could not take within the retry budget; their requests fail",
)
AFFINITY_HITS = Counter(
    "streamq_affinity_hits",
    "Jobs this worker claimed that enqueue had held for it, as it served their prefix "
    "(docs/features/prefix-aware-pickup.md)",
)
AFFINITY_MISSES = Counter(
    "streamq_affinity_misses",
    "Jobs with prefix keys this worker claimed from the shared index: no worker known for their prefix, "
    "that worker busy or gone, or its window passed",
)
AFFINITY_EXPIRED = Counter(
    "streamq_affinity_expired",
    "Jobs held for a worker whose window passed before it claimed them; this worker's claim put them back",
)
LEASES_LOST = Counter(
    "streamq_leases_lost", "Running jobs whose lease another worker holds now: this worker's attempt stops"
)

for _code in ErrorCode:
    REQUEST_ERRORS.labels(code=_code)  # present at 0 from the start, so rate() sees the first one
COMPLETIONS_BY_REASON: Final = {
    str(reason): COMPLETIONS_FINISHED.labels(finish_reason=reason) for reason in FinishReason
}
"""``COMPLETIONS_FINISHED``'s child of each finish reason, present at 0 from the start (and
looked up once: ``labels()`` costs more than the increment, once per request)."""
EVENTS_BY_STREAMED: Final = {
    streamed: REQUEST_EVENTS.labels(streamed=str(streamed).lower()) for streamed in (True, False)
}
"""``REQUEST_EVENTS``'s child for streamed requests (``True``) and the others."""


def metrics_port_from_env() -> int:
    """``$STREAMQ_METRICS_PORT`` or the default; 0 turns the endpoint off."""
    return int(os.environ.get(METRICS_PORT_ENV, DEFAULT_METRICS_PORT))


def serve_metrics(port: int, addr: str = "0.0.0.0") -> Any | None:
    """Serve ``/metrics`` on ``port`` from a background thread; returns the server
    (``shutdown()`` stops it), or ``None`` when ``port`` is 0 or taken.

    A taken port only costs the metrics: the worker still serves tokens, which
    matters more than its numbers (and says so in its log).
    """
    if port == 0:
        return None
    try:
        server, _thread = start_http_server(port, addr=addr)
    except OSError as exc:
        logger.warning("metrics endpoint not started: port %d: %s", port, exc)
        return None
    logger.info("metrics on http://%s:%d/metrics", addr, port)
    return server


async def sample_queue_depth(redis: Any, queue: str, *, sample_interval_s: float = 1.0) -> None:
    """Keep ``streamq_queue_depth`` current until cancelled; a Redis outage only
    pauses it (the worker's poll loop reports that)."""
    gauge = QUEUE_DEPTH.labels(queue=queue)
    while True:
        try:
            gauge.set(await redis.zcard(queue))
        except Exception as exc:  # Redis restarting: try again next time
            logger.debug("queue depth sample failed: %s", exc)
        await asyncio.sleep(sample_interval_s)
