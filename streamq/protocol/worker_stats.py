"""What a worker reports about itself for the dashboard (``WORKER_STATS_KEY``), and the
record of a request that ended (``RECENT_ENDS_KEY``).

Counters are the worker's totals since it started, read from its own Prometheus metrics;
a reader takes rates and percentiles from the difference between two reports, as
Prometheus's ``rate()`` and ``histogram_quantile()`` do. Unknown fields are ignored, so
later versions may add some.
"""

from __future__ import annotations

import msgspec

from streamq.protocol.messages import ErrorEvent, FinalEvent, decode_event


class InFlightRequest(msgspec.Struct, forbid_unknown_fields=False, omit_defaults=True):
    """One request a worker is running now."""

    request_id: str
    started_ms: int
    """Unix ms (the worker's clock) when this attempt started generating."""
    attempt: int = 1
    completion_tokens: int = 0
    """Tokens generated so far, all completions, as of the report."""
    tenant: str | None = None
    priority: int | None = None
    model: str | None = None
    """The model the request named, when it named one: the worker's base model, or one of
    its LoRA adapters."""


class WorkerStats(msgspec.Struct, forbid_unknown_fields=False, omit_defaults=True):
    """One worker's report: who it is, what it runs now, and its counters so far."""

    worker_id: str
    model: str
    queue: str
    host: str
    pid: int
    started_ms: int
    """Unix ms when the worker process started serving (its engine up)."""
    in_flight: list[InFlightRequest] = []
    generated_tokens: int = 0
    requests_finished: int = 0
    """Requests that ended with a final event on this worker (cancelled and timed out too)."""
    errors: dict[str, int] = {}
    """Requests that ended with an error event, by error code."""
    ttft_buckets: list[tuple[float, int]] = []
    """Time to first token: cumulative ``(upper bound in s, count)`` pairs of the finite
    buckets (JSON has no infinity); ``ttft_count`` counts every observation."""
    ttft_count: int = 0
    itl_buckets: list[tuple[float, int]] = []
    """Inter-token latency, the same shape."""
    itl_count: int = 0
    affinity_hits: int = 0
    """Jobs this worker claimed that enqueue had held for it, as it served their prefix
    (``streamq_affinity_hits``): with ``affinity_misses``, how often prefix-aware pickup
    sent a request where its prefix is likely cached (docs/features/prefix-aware-pickup.md)."""
    affinity_misses: int = 0
    """Jobs with prefix keys this worker claimed from the shared index
    (``streamq_affinity_misses``): nobody held them for it, so its cache may not help."""
    affinity_expired: int = 0
    """Held jobs whose window passed before their worker claimed them; this worker's claim
    put them back (``streamq_affinity_expired``): requests that waited for a worker that
    stayed busy past their window."""
    prefix_cache_queries: int = 0
    """Prompt tokens vLLM looked up in its prefix cache (``vllm:prefix_cache_queries``, all
    engines of this process); 0 when the engine keeps no such metric (a scripted engine,
    ``--disable-log-stats``). What a hit of pickup is worth shows here, in tokens."""
    prefix_cache_hits: int = 0
    """Of those, tokens found cached (``vllm:prefix_cache_hits``)."""
    stopped_ms: int | None = None
    """Set by the worker's last report when it shuts down."""
    stop_reason: str | None = None
    """Why it stopped, when it knows (``shutdown``, ``engine died``)."""
    reported_ms: int = 0
    """Unix ms (Redis's clock) of this report: its score in ``WORKER_STATS_SEEN_KEY``,
    filled in by the reader (the stored JSON is the worker's own bytes)."""


_stats_decoder = msgspec.json.Decoder(WorkerStats)


def encode_worker_stats(stats: WorkerStats) -> bytes:
    return msgspec.json.encode(stats)


def decode_worker_stats(data: bytes | str) -> WorkerStats:
    return _stats_decoder.decode(data)


class RecentEnd(msgspec.Struct, frozen=True):
    """A request that ended: its id, when (Unix ms, Redis's clock) and its terminal event."""

    request_id: str
    ended_ms: int
    event: FinalEvent | ErrorEvent


def decode_recent_end(entry: bytes | str) -> RecentEnd:
    """Parse one ``RECENT_ENDS_KEY`` entry: ``<request_id> <ended_ms> <event JSON>``."""
    text = entry.decode() if isinstance(entry, bytes) else entry
    request_id, ended_ms, payload = text.split(" ", 2)
    event = decode_event(payload)
    if not isinstance(event, FinalEvent | ErrorEvent):
        raise ValueError(f"not a terminal event: {payload[:80]!r}")
    return RecentEnd(request_id, int(ended_ms), event)
