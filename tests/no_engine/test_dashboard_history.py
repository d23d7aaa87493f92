"""What the dashboard keeps between readings: rates over the last seconds, window totals
from the oldest report inside the window, chart points every 2 s."""

from __future__ import annotations

import pytest

from gateway.dashboard.history import ModelPoints, Point, WorkerHistory
from streamq.protocol.worker_stats import WorkerStats

T0 = 1_800_000_000_000


def report(at_ms: int, *, started_ms: int = T0 - 3_600_000, **fields: object) -> WorkerStats:
    stats = WorkerStats(worker_id="w", model="m", queue="q", host="h", pid=1, started_ms=started_ms, **fields)  # type: ignore[arg-type]
    stats.reported_ms = at_ms
    return stats


def test_tokens_per_second_come_from_reports_about_five_seconds_apart() -> None:
    history = WorkerHistory()
    history.add(report(T0, generated_tokens=0), T0)
    assert history.tokens_per_s(T0) == 0  # one report: no rate
    for second in range(1, 11):
        history.add(report(T0 + second * 1000, generated_tokens=second * second * 10), T0 + second * 1000)
    # from 5 s back: (1000 - 250) tokens in 5 s, not the whole history's average (100/s)
    assert history.tokens_per_s(T0 + 10_000) == pytest.approx(150)
    assert history.tokens_per_s(T0 + 20_000) == 0  # silent since: nothing known to flow


def test_the_same_report_read_twice_is_kept_once_and_counters_that_restart_count_from_zero() -> None:
    history = WorkerHistory()
    history.add(report(T0, generated_tokens=500), T0)
    history.add(report(T0, generated_tokens=500), T0 + 900)
    history.add(report(T0 + 2000, generated_tokens=40), T0 + 2000)
    assert len(history.reports) == 2
    assert history.tokens_per_s(T0 + 2000) == pytest.approx(20)


def test_window_totals_start_at_the_oldest_report_inside_the_window() -> None:
    history = WorkerHistory()
    for minute in range(8):  # a report a minute, 7 finished a minute, an error every other
        at = T0 + minute * 60_000
        history.add(report(at, requests_finished=7 * minute, errors={"timeout": minute // 2}), at)
    now = T0 + 7 * 60_000
    totals = history.window_totals(now, window_s=300)
    assert (totals.finished, totals.errors) == (7 * 5, {"timeout": 3 - 1})  # minutes 2..7
    assert [r.reported_ms - T0 for r in history.reports] == [m * 60_000 for m in range(2, 8)]  # older ones forgotten


def test_a_worker_that_started_inside_the_window_counts_from_zero() -> None:
    history = WorkerHistory()
    history.add(report(T0, started_ms=T0 - 10_000, requests_finished=3, errors={"internal": 1}), T0)
    totals = history.window_totals(T0, window_s=300)
    assert (totals.finished, totals.errors) == (3, {"internal": 1})
    assert history.window_totals(T0 + 301_000, window_s=300).finished == 0  # its report has left the window


def test_chart_points_come_every_two_seconds_oldest_first_within_the_window() -> None:
    points = ModelPoints(window_s=10)
    for i, offset in enumerate([0, 1000, 1990, 3000, 4100, 6000]):
        points.add("m", Point(T0 + offset, i, 0, 0.0))
    assert [p.t_ms - T0 for p in points.of("m")] == [0, 1990, 4100, 6000]
    points.prune(T0 + 14_000)
    assert [p.t_ms - T0 for p in points.of("m")] == [4100, 6000]
    points.prune(T0 + 60_000)
    assert points.of("m") == []
