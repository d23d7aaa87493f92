"""The Batch API on the gateway's ``/metrics``: the unfinished batches by state, read from
Redis at each scrape (so every replica reports the same deployment-wide figures, as
``gateway.queue_metrics`` does: scrape one, or take ``max``, not ``sum``), and the lines
this process's runner has answered (a counter per process: ``sum`` across replicas).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Final

from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from gateway.batch_api.records import BatchStore

BATCH_LINES: Final = Counter(
    "streamq_batch_lines",
    "Batch lines answered by this gateway's runner: completed (in the output file) or failed (in the error file)",
    ["result"],
)
"""``streamq_batch_lines_total{result}``; the runner counts each line once, when it records it."""
for _result in ("completed", "failed"):
    BATCH_LINES.labels(result=_result)  # both shown from the start, at 0


class _BatchStates(Collector):
    def __init__(self, counts: dict[str, int]) -> None:
        self.counts = counts

    def collect(self) -> Iterable[GaugeMetricFamily]:
        gauge = GaugeMetricFamily(
            "streamq_batches",
            "Unfinished batches of every tenant, by state (validating, in_progress, finalizing, cancelling)",
            labels=["state"],
        )
        for state, count in sorted(self.counts.items()):
            gauge.add_metric([state], count)
        return [gauge]


async def batches_exposition(batches: BatchStore) -> bytes:
    """``streamq_batches{state}`` in Prometheus's text format."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_BatchStates(await batches.counts_by_state()))
    return generate_latest(registry)
