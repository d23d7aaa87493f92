"""Prometheus metrics of the gateway, served on its own ``/metrics``.

The workers measure generation (``worker/metrics.py``); the gateway measures what
its HTTP clients get: how many completion requests it answered with which status,
how many it is serving now, and how long a streaming client waits for its first
event, which adds the queue, Redis and the gateway to the worker's own figure.
"""

from __future__ import annotations

from typing import Final

from prometheus_client import CONTENT_TYPE_LATEST, Counter, Gauge, Histogram, generate_latest

REQUESTS = Counter(
    "streamq_gateway_requests_total",
    "Completion requests answered, by endpoint and HTTP status",
    ["endpoint", "status"],
)
IN_PROGRESS = Gauge("streamq_gateway_requests_in_progress", "Completion requests being answered or streamed now")
TIME_TO_FIRST_EVENT = Histogram(
    "streamq_gateway_time_to_first_event_seconds",
    "From a streaming request's arrival to its first event from the queue (a token, or an error)",
    buckets=(0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 30.0, 60.0),
)

CONTENT_TYPE: Final = CONTENT_TYPE_LATEST


def exposition() -> bytes:
    """Every metric of this process in Prometheus's text format."""
    return generate_latest()
