"""Prometheus metrics of a worker, and the HTTP endpoint that serves them with the
worker's probes (``/ready``, ``/health``).

They share prometheus_client's default registry with vLLM's own (``vllm:*``), so one
scrape returns both. Latencies are measured inside the worker (a subscriber also sees
Redis and the network). The queue depth is a sampled ``ZCARD``: waiting plus running jobs,
the same on every worker of a queue (dashboards take the max).
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from collections.abc import Callable, Iterable, Mapping, MutableMapping
from typing import Any, Final
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import Counter, Gauge, Histogram, make_wsgi_app
from prometheus_client.exposition import ThreadingWSGIServer

from streamq.env_vars import METRICS_PORT_ENV
from streamq.protocol import ErrorCode, FinishReason

logger = logging.getLogger("streamq.worker")

DEFAULT_METRICS_PORT: Final = 9400

# Buckets span a GPU's milliseconds to an overloaded CPU's seconds.
_LATENCY_BUCKETS: Final = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24)
_QUEUE_WAIT_BUCKETS: Final = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)
_BATCH_BUCKETS: Final = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096)

QUEUE_DEPTH = Gauge("streamq_queue_depth", "Jobs waiting or running in the queue (ZCARD), sampled", ["queue"])
REQUESTS_IN_FLIGHT = Gauge("streamq_requests_in_flight", "Jobs this worker is running now")
REDIS_REFUSING_WRITES = Gauge(
    "streamq_redis_refusing_writes",
    "1 while Redis refuses the worker's claims with an error reply (OOM: full at its maxmemory; "
    "loading; read-only): it claims nothing meanwhile",
)
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
ROUND_TRIP_PURPOSES: Final = ("claim", "publish", "confirm", "acknowledge", "lease")
"""What a worker's round trips on the request path carry, each shared by every request of it:
a claim (the jobs with their payloads), a flush of events, a confirmation of ends that wait
for their replicas, the ends of the jobs of one pass, a renewal of every lease."""
REDIS_ROUND_TRIPS = Counter(
    "streamq_redis_round_trips",
    "Round trips to Redis on the request path, by what they carried (claim, publish, confirm, acknowledge, "
    "lease); each serves every request that was ready for it, so a loaded worker makes fewer per request",
    ["purpose"],
)
ROUND_TRIPS: Final = {purpose: REDIS_ROUND_TRIPS.labels(purpose=purpose) for purpose in ROUND_TRIP_PURPOSES}
DURABLE_END_WAITS: Final = ("end", "end_request", "callback")
"""What waits for its replicas (``--durable-ends``): an end the publisher confirms (a job's
own, or one a take-over found logged), an end written outside a running attempt (a job arq
gave up on), a callback delivery's claim or record."""
DURABLE_END_WAIT = Histogram(
    "streamq_durable_end_wait_seconds",
    "An end's write and its wait for its replicas (WAIT, WAITAOF: --durable-ends), one round trip, by what waited",
    ["what"],
    buckets=_LATENCY_BUCKETS,
)
DURABLE_END_SHORTFALLS = Counter(
    "streamq_durable_end_shortfalls",
    "Ends told before as many replicas as asked acknowledged them (--durable-ends-timeout-s passed), by what waited",
    ["what"],
)

for _code in ErrorCode:
    REQUEST_ERRORS.labels(code=_code)  # present at 0 from the start, so rate() sees the first one
for _what in DURABLE_END_WAITS:
    DURABLE_END_SHORTFALLS.labels(what=_what)
COMPLETIONS_BY_REASON: Final = {
    str(reason): COMPLETIONS_FINISHED.labels(finish_reason=reason) for reason in FinishReason
}
"""``COMPLETIONS_FINISHED``'s child of each finish reason, present at 0 from the start (and
looked up once: ``labels()`` costs more than the increment, once per request)."""
EVENTS_BY_STREAMED: Final = {
    streamed: REQUEST_EVENTS.labels(streamed=str(streamed).lower()) for streamed in (True, False)
}
"""``REQUEST_EVENTS``'s child for streamed requests (``True``) and the others."""


def durable_end_waited(what: str, seconds: float, short: bool) -> None:
    """A ``streamq.broker.durability.WaitHook``: one end's wait, counted."""
    DURABLE_END_WAIT.labels(what=what).observe(seconds)
    if short:
        DURABLE_END_SHORTFALLS.labels(what=what).inc()


def metrics_port_from_env(environ: Mapping[str, str] = os.environ) -> int:
    """``$STREAMQ_METRICS_PORT`` or the default; 0 turns the endpoint off."""
    return int(environ.get(METRICS_PORT_ENV, DEFAULT_METRICS_PORT))


PROBES_KEY: Final = "streamq_probes"
"""The key of ``Probes`` in arq's ``ctx``."""


class Probes:
    """What ``/ready`` and ``/health`` answer, asked from the HTTP server's thread: the
    start-up hook and the arq worker set the parts each knows."""

    def __init__(self) -> None:
        self.registered = False
        """The worker's registration is in Redis (``Presence.start`` is done): producers route here."""
        self.claiming: Callable[[], bool] = lambda: True
        """The worker still takes jobs: false once it drains to stop (arq's ``allow_pick_jobs``)."""
        self.engine_alive: Callable[[], bool] = lambda: True
        """False once the engine died (``WorkerState.engine_dead``)."""
        self.redis_refusal: Callable[[], str | None] = lambda: None
        """Redis's reply while it refuses the worker's claims (full at its maxmemory), else ``None``."""

    def unready_reason(self) -> str | None:
        """Why ``/ready`` answers 503; ``None`` when it answers 200."""
        if not self.engine_alive():
            return "the engine died"
        if not self.claiming():
            return "stopping: takes no more jobs"
        if (refusal := self.redis_refusal()) is not None:
            return f"Redis refuses writes ({refusal}): claims no job until it takes them again"
        if not self.registered:
            return "not registered yet"
        return None


def probes_of(ctx: MutableMapping[str, Any]) -> Probes:
    """The ``Probes`` in arq's ``ctx``, put there on first use."""
    probes = ctx.get(PROBES_KEY)
    if not isinstance(probes, Probes):
        probes = ctx[PROBES_KEY] = Probes()
    return probes


WsgiApp = Callable[[dict[str, Any], Callable[..., Any]], Iterable[bytes]]


def endpoint_app(probes: Probes, metrics_app: WsgiApp | None = None) -> WsgiApp:
    """``/ready`` and ``/health`` from ``probes``; every other path the metrics exposition."""
    metrics_app = metrics_app or make_wsgi_app()

    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        path = environ.get("PATH_INFO", "")
        if path == "/ready":
            reason = probes.unready_reason()
            return _answer(start_response, reason is None, "ready" if reason is None else f"not ready: {reason}")
        if path == "/health":
            alive = probes.engine_alive()
            return _answer(start_response, alive, "healthy" if alive else "unhealthy: the engine died")
        return metrics_app(environ, start_response)

    return app


def _answer(start_response: Callable[..., Any], ok: bool, text: str) -> list[bytes]:
    body = (text + "\n").encode()
    status = "200 OK" if ok else "503 Service Unavailable"
    start_response(status, [("Content-Type", "text/plain; charset=utf-8"), ("Content-Length", str(len(body)))])
    return [body]


class _QuietHandler(WSGIRequestHandler):
    """No line on stderr per request (probes come every few seconds)."""

    def log_message(self, format: str, *args: Any) -> None:
        pass


def serve_metrics(port: int, addr: str = "0.0.0.0", probes: Probes | None = None) -> WSGIServer | None:
    """Serve ``/metrics`` and the probes (``/ready``, ``/health``) on ``port`` from a
    background thread, with prometheus_client's threaded WSGI server; returns the server
    (``stop_serving`` stops it), or ``None`` when ``port`` is 0 or taken.

    A taken port only costs the metrics and probes: the worker still serves tokens, which
    matters more than its numbers (and says so in its log).
    """
    if port == 0:
        return None
    app = endpoint_app(probes or Probes())
    try:
        server = make_server(addr, port, app, ThreadingWSGIServer, handler_class=_QuietHandler)
    except OSError as exc:
        logger.warning("metrics endpoint not started: port %d: %s", port, exc)
        return None
    threading.Thread(target=server.serve_forever, name="metrics-endpoint", daemon=True).start()
    logger.info("metrics on http://%s:%d/metrics, probes on /ready and /health", addr, port)
    return server


def stop_serving(server: WSGIServer) -> None:
    """Stop ``serve_metrics``' server and close its port."""
    server.shutdown()
    server.server_close()


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
