"""Percentiles from histogram buckets as Prometheus's ``histogram_quantile`` reads them,
on buckets whose answers are worked out by hand."""

from __future__ import annotations

import pytest

from gateway.dashboard.percentiles import Histogram, histogram_quantile, summary_ms

# cumulative: 2 observations <= 10 ms, 6 <= 50 ms, 9 <= 100 ms, 10 <= 500 ms; 10 in all
BUCKETS = [(0.01, 2), (0.05, 6), (0.1, 9), (0.5, 10)]


def test_the_rank_is_interpolated_linearly_inside_its_bucket() -> None:
    # p50: rank 5 lies in (10 ms, 50 ms], 3 of that bucket's 4 observations in
    assert histogram_quantile(0.5, BUCKETS, 10) == pytest.approx(0.04)
    # p90: rank 9 is exactly the top of (50 ms, 100 ms]
    assert histogram_quantile(0.9, BUCKETS, 10) == pytest.approx(0.1)
    # p99: rank 9.9 lies in (100 ms, 500 ms], which holds one observation
    assert histogram_quantile(0.99, BUCKETS, 10) == pytest.approx(0.46)


def test_the_first_bucket_is_interpolated_from_zero() -> None:
    assert histogram_quantile(0.5, [(0.2, 4), (1.0, 4)], 4) == pytest.approx(0.1)


def test_a_rank_in_the_inf_bucket_answers_the_largest_finite_bound() -> None:
    # 10 observations in the finite buckets, 20 in all: p90 is past 500 ms
    assert histogram_quantile(0.9, BUCKETS, 20) == pytest.approx(0.5)


def test_bucket_order_does_not_matter_and_counts_are_made_monotonic() -> None:
    assert histogram_quantile(0.5, list(reversed(BUCKETS)), 10) == pytest.approx(0.04)
    # a bucket read before the one below it was updated counts as that one
    assert histogram_quantile(0.5, [(0.01, 2), (0.05, 1), (0.1, 4)], 4) == pytest.approx(0.01)


def test_nothing_observed_has_no_percentiles() -> None:
    assert histogram_quantile(0.5, [(0.1, 0), (1.0, 0)], 0) is None
    assert histogram_quantile(0.5, [], 0) is None
    assert summary_ms(Histogram.of([(0.1, 0)], 0)) is None
    with pytest.raises(ValueError):
        histogram_quantile(1.5, BUCKETS, 10)


def test_percentiles_of_a_window_come_from_the_difference_of_two_reports() -> None:
    earlier = Histogram.of([(0.01, 5), (0.05, 5), (0.1, 5), (0.5, 5)], 5)
    later = Histogram.of([(0.01, 7), (0.05, 11), (0.1, 14), (0.5, 15)], 15)
    window = later.increase_since(earlier)
    assert window == Histogram.of(BUCKETS, 10)
    assert summary_ms(window) == {"p50": 40.0, "p90": 100.0, "p99": 460.0}


def test_counters_that_went_down_restarted() -> None:
    earlier = Histogram.of([(0.01, 50), (0.05, 90)], 100)
    restarted = Histogram.of(BUCKETS, 10)
    assert restarted.increase_since(earlier) == restarted
    assert restarted.increase_since(None) == restarted


def test_workers_histograms_add_up_bucket_by_bucket() -> None:
    total = Histogram.of([(0.01, 1), (0.05, 3)], 3)
    total.add(Histogram.of([(0.01, 1), (0.05, 3), (0.1, 4)], 4))
    assert total == Histogram({0.01: 2, 0.05: 6, 0.1: 7}, 7)  # the first one's 3 lie below 0.1 too
