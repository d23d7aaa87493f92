"""A worker's Prometheus endpoint as a test reads it: every sample, by name and labels."""

from __future__ import annotations

import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from devkit.worker_process import WorkerProcess

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def scrape(worker: WorkerProcess) -> Samples:
    """Every sample the worker's ``/metrics`` serves now."""
    assert worker.metrics_port, "the worker serves metrics"
    with urllib.request.urlopen(f"http://127.0.0.1:{worker.metrics_port}/metrics", timeout=10) as response:
        text = response.read().decode()
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def value(samples: Samples, name: str, **labels: str) -> float:
    """One sample's value (0 when absent)."""
    return samples.get((name, frozenset(labels.items())), 0.0)


def request_events(samples: Samples, *, streamed: bool) -> tuple[float, float]:
    """``streamq_request_events``: (events, requests) of the streamed requests or the others."""
    label = "true" if streamed else "false"
    return (
        value(samples, "streamq_request_events_sum", streamed=label),
        value(samples, "streamq_request_events_count", streamed=label),
    )
