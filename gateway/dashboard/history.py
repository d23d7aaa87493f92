"""What the dashboard remembers between samples, in the gateway's memory: each worker's
recent reports (rates and window totals come from differences between two of them) and
each model's points for the charts.

Workers report totals since they started; a window's ``finished``, ``errors``, affinity
and prefix-cache counts and histograms are the increase from the oldest report inside the window (from zero for a
worker that started inside it) to the newest.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import msgspec

from gateway.dashboard.percentiles import Histogram
from streamq.protocol.worker_stats import WorkerStats

WINDOW_S = 300
"""The window of ``finished``, ``errors``, the percentiles and the chart points."""
RATE_S = 5.0
"""``tokens_per_s`` is the rate over about this many seconds."""
STALE_S = 5.0
"""A worker whose newest report is older than this generates nothing now, as far as a
rate can tell."""
POINT_EVERY_MS = 2000
"""One chart point per model every this many ms."""
POINT_SLACK_MS = 500
"""A reading this much early still makes the next point: readings come about once a
second, and a little late or early."""


@dataclass
class WindowTotals:
    """A worker's (or a model's) increases over the window."""

    finished: int = 0
    errors: dict[str, int] = field(default_factory=dict)
    ttft: Histogram = field(default_factory=Histogram)
    itl: Histogram = field(default_factory=Histogram)
    affinity_hits: int = 0
    affinity_misses: int = 0
    affinity_expired: int = 0
    prefix_cache_queries: int = 0
    """Tokens, as vLLM counts them."""
    prefix_cache_hits: int = 0

    def add(self, other: WindowTotals) -> None:
        self.finished += other.finished
        self.affinity_hits += other.affinity_hits
        self.affinity_misses += other.affinity_misses
        self.affinity_expired += other.affinity_expired
        self.prefix_cache_queries += other.prefix_cache_queries
        self.prefix_cache_hits += other.prefix_cache_hits
        for code, n in other.errors.items():
            self.errors[code] = self.errors.get(code, 0) + n
        self.ttft.add(other.ttft)
        self.itl.add(other.itl)


def _increase(new: int, old: int) -> int:
    """A counter's increase; a counter that went down restarted (all of it is new)."""
    return new - old if new >= old else new


class WorkerHistory:
    """One worker's reports over the window (distinct by ``reported_ms``), oldest first."""

    def __init__(self) -> None:
        self.reports: deque[WorkerStats] = deque()

    @property
    def latest(self) -> WorkerStats:
        return self.reports[-1]

    def add(self, report: WorkerStats, now_ms: int, window_s: float = WINDOW_S) -> None:
        """Keep ``report`` if it is new, without its in-flight list (only totals are
        compared; a busy worker's list runs to tens of kB a report, 300 reports a
        window), and forget reports older than the window (the newest report stays,
        whatever its age: the worker's state)."""
        if not self.reports or report.reported_ms > self.latest.reported_ms:
            self.reports.append(msgspec.structs.replace(report, in_flight=[]))
        start = now_ms - window_s * 1000
        while len(self.reports) > 1 and self.reports[0].reported_ms < start:
            self.reports.popleft()

    def tokens_per_s(self, now_ms: int) -> float:
        """Tokens a second over the last ``RATE_S`` or so (two reports needed)."""
        latest = self.latest
        if now_ms - latest.reported_ms > STALE_S * 1000 or len(self.reports) < 2:
            return 0.0
        since = latest.reported_ms - RATE_S * 1000
        earlier = [r for r in list(self.reports)[:-1] if r.reported_ms >= since]
        base = earlier[0] if earlier else self.reports[-2]
        elapsed_s = (latest.reported_ms - base.reported_ms) / 1000
        if elapsed_s <= 0:
            return 0.0
        return _increase(latest.generated_tokens, base.generated_tokens) / elapsed_s

    def window_totals(self, now_ms: int, window_s: float = WINDOW_S) -> WindowTotals:
        """Increases over the window, from the oldest report inside it, or from zero
        when the worker started inside it."""
        latest = self.latest
        start = now_ms - window_s * 1000
        if latest.reported_ms < start:
            return WindowTotals()
        inside = (r for r in self.reports if r.reported_ms >= start)
        base = None if latest.started_ms >= start else next(inside, latest)
        errors = {
            code: n
            for code, total in latest.errors.items()
            if (n := _increase(total, base.errors.get(code, 0) if base else 0))
        }
        return WindowTotals(
            finished=_increase(latest.requests_finished, base.requests_finished if base else 0),
            affinity_hits=_increase(latest.affinity_hits, base.affinity_hits if base else 0),
            affinity_misses=_increase(latest.affinity_misses, base.affinity_misses if base else 0),
            affinity_expired=_increase(latest.affinity_expired, base.affinity_expired if base else 0),
            prefix_cache_queries=_increase(latest.prefix_cache_queries, base.prefix_cache_queries if base else 0),
            prefix_cache_hits=_increase(latest.prefix_cache_hits, base.prefix_cache_hits if base else 0),
            errors=errors,
            ttft=Histogram.of(latest.ttft_buckets, latest.ttft_count).increase_since(
                Histogram.of(base.ttft_buckets, base.ttft_count) if base else None
            ),
            itl=Histogram.of(latest.itl_buckets, latest.itl_count).increase_since(
                Histogram.of(base.itl_buckets, base.itl_count) if base else None
            ),
        )


@dataclass(frozen=True)
class Point:
    """One chart point of a model."""

    t_ms: int
    waiting: int
    running: int
    tokens_per_s: float


class ModelPoints:
    """Each model's chart points, one every ``POINT_EVERY_MS``, over the window."""

    def __init__(self, window_s: float = WINDOW_S) -> None:
        self.window_s = window_s
        self._points: dict[str, deque[Point]] = {}

    def add(self, model: str, point: Point) -> None:
        points = self._points.setdefault(model, deque())
        if points and point.t_ms - points[-1].t_ms < POINT_EVERY_MS - POINT_SLACK_MS:
            return  # too soon after the last one
        points.append(point)

    def prune(self, now_ms: int) -> None:
        start = now_ms - self.window_s * 1000
        for model in list(self._points):
            points = self._points[model]
            while points and points[0].t_ms < start:
                points.popleft()
            if not points:
                del self._points[model]

    def of(self, model: str) -> list[Point]:
        """The model's points, oldest first."""
        return list(self._points.get(model, ()))
