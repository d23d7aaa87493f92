"""Percentiles from cumulative histogram buckets, read as Prometheus's
``histogram_quantile`` reads them: find the bucket holding the rank, interpolate
linearly inside it (from 0 for the first bucket), and answer the largest finite bound
for ranks in the ``+Inf`` bucket.

Workers report their histograms' totals since they started; the dashboard takes the
increase between two reports, so percentiles describe a window, not a worker's life.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

Buckets = Sequence[tuple[float, int]]
"""Cumulative ``(upper bound, count)`` pairs of the finite buckets, in any order."""


@dataclass
class Histogram:
    """Cumulative finite buckets by upper bound, and the count of every observation
    (the ``+Inf`` bucket)."""

    buckets: dict[float, int] = field(default_factory=dict)
    count: int = 0

    @classmethod
    def of(cls, buckets: Buckets, count: int) -> Histogram:
        return cls(dict(buckets), count)

    def increase_since(self, earlier: Histogram | None) -> Histogram:
        """What was observed after ``earlier`` (``None``: since the start). A count that
        went down means the counters restarted, as ``rate()`` treats it: all of this one
        is new."""
        if earlier is None or self.count < earlier.count:
            return Histogram(dict(self.buckets), self.count)
        if any(n < earlier.buckets.get(bound, 0) for bound, n in self.buckets.items()):
            return Histogram(dict(self.buckets), self.count)
        return Histogram(
            {b: n - earlier.buckets.get(b, 0) for b, n in self.buckets.items()}, self.count - earlier.count
        )

    def add(self, other: Histogram) -> None:
        """Sum ``other`` into this one. Workers of one model share their bucket bounds
        (the same code defines them); a bound only one side has reads, on the other
        side, the count of that side's next lower bound (what is known to lie below it)."""
        bounds = sorted({*self.buckets, *other.buckets})
        mine, theirs = _at_bounds(self.buckets, bounds), _at_bounds(other.buckets, bounds)
        self.buckets = {bound: mine[i] + theirs[i] for i, bound in enumerate(bounds)}
        self.count += other.count


def _at_bounds(buckets: dict[float, int], bounds: list[float]) -> list[int]:
    """Cumulative counts at each of ``bounds`` (sorted), from ``buckets``' own bounds."""
    counts, last = [], 0
    for bound in bounds:
        last = buckets.get(bound, last)
        counts.append(last)
    return counts


def histogram_quantile(q: float, buckets: Buckets, count: int) -> float | None:
    """The ``q``-quantile (0 < q <= 1) of cumulative ``buckets`` with ``count``
    observations in all; ``None`` when there are none."""
    if not 0 <= q <= 1:
        raise ValueError(f"a quantile lies in [0, 1], got {q}")
    finite = sorted(buckets)
    # Prometheus makes the counts monotonic before reading them (a scrape can see a
    # bucket before the one below it is updated).
    monotonic: list[tuple[float, int]] = []
    highest = 0
    for bound, n in finite:
        highest = max(highest, n)
        monotonic.append((bound, highest))
    total = max(count, highest)
    if total <= 0 or not monotonic:
        return None
    rank = q * total
    for i, (upper, n) in enumerate(monotonic):
        if n >= rank:
            if i == 0 and upper <= 0:
                return upper
            lower, below = monotonic[i - 1] if i > 0 else (0.0, 0)
            if n == below:
                return upper
            return lower + (upper - lower) * (rank - below) / (n - below)
    return monotonic[-1][0]  # the rank lies in the +Inf bucket


def summary_ms(histogram: Histogram, quantiles: Iterable[float] = (0.5, 0.9, 0.99)) -> dict[str, float] | None:
    """``{"p50": ms, "p90": ms, "p99": ms}`` of a histogram in seconds; ``None`` when it
    observed nothing."""
    if histogram.count <= 0 and not any(histogram.buckets.values()):
        return None
    found: dict[str, float] = {}
    for q in quantiles:
        value = histogram_quantile(q, list(histogram.buckets.items()), histogram.count)
        if value is None:
            return None
        found[f"p{round(q * 100):d}"] = round(value * 1000, 3)
    return found
