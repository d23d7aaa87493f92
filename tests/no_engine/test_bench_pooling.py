"""The pooling benchmark's pure parts (``bench/pooling.py``): its arguments, how it splits the
inputs into calls and drives them, and the figures it prints from known results."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from bench.pooling import (
    PARTS,
    beyond_bare_us,
    build_parser,
    calls_of,
    chosen_parts,
    drive,
    report,
)

CONFIG = {"inputs": 320, "input_len": 64, "per_call": 16, "in_flight": 4, "flags": ["--model", "m", "--dtype", "f"]}


def test_the_defaults_are_the_issues_sizes_and_every_part_runs() -> None:
    args = build_parser().parse_args([])
    assert (args.inputs, args.input_len, args.per_call, args.redis_requests) == (20_000, 64, 16, 200)
    assert chosen_parts(args.parts, no_http=args.no_http) == list(PARTS)


def test_no_http_skips_the_gateway_part_and_an_unknown_part_is_refused() -> None:
    assert chosen_parts("redis, queue,http", no_http=True) == ["queue", "redis"]
    with pytest.raises(SystemExit, match="unknown parts: speed"):
        chosen_parts("queue,speed")


def test_calls_keep_every_input_in_order_the_last_one_shorter() -> None:
    inputs = [f"text {i}" for i in range(35)]
    calls = calls_of(inputs, 16)
    assert [len(c) for c in calls] == [16, 16, 3]
    assert [text for call in calls for text in call] == inputs


def test_drive_counts_every_answer_with_many_callers_at_once() -> None:
    """Callers that finish out of order must not lose each other's counts."""
    seen: list[list[str]] = []

    async def send(call: list[str]) -> int:
        await asyncio.sleep(0.001 * (len(seen) % 3))
        seen.append(call)
        return len(call)

    calls = calls_of([str(i) for i in range(100)], 7)
    _, answered = asyncio.run(drive(calls, 5, send))
    assert answered == 100
    assert sorted(seen) == sorted(calls)


def _path(inputs: int, wall_s: float, **cpu_s: float) -> dict[str, Any]:
    return {"inputs": inputs, "wall_s": wall_s, "cpu_s": cpu_s}


def test_the_worker_cost_is_its_process_less_the_bare_front_end_engine_cores_left_out() -> None:
    worker = _path(1000, 2.0, worker=0.5, engine_core=9.0)
    bare = _path(2000, 2.0, front_end=0.8, engine_core=1.0)
    assert beyond_bare_us(worker, bare) == pytest.approx(500 - 400)


def test_the_report_sets_each_figure_beside_its_goal_and_says_what_was_not_run() -> None:
    results = {
        "offline": _path(320, 1.0, front_end=0.1, engine_core=0.5),
        "bare": _path(320, 1.0, front_end=0.032, engine_core=0.5),
        "queue": _path(320, 1.25, worker=0.064, engine_core=0.5, redis=0.01),
        "gateway_missing": True,
        "redis": {"requests": 10, "vectors": 160, "used_memory_delta": 160 * 4200, "families": {"a:<id>": 4100.0}},
    }
    text = report(CONFIG, results)
    assert "| queue ÷ offline `LLM.embed`, inputs/s | ≥ 0.9 | 0.80 (256 ÷ 320) |" in text
    assert "| ≤ 100 µs | 100 µs (200 − 100) |" in text
    assert "not run: the gateway has no /v1/embeddings" in text
    assert "| ≤ 4.5 KB | 4,200 B (raw float32: 4,096 B) |" in text
    assert "- `a:<id>`: 4,100" in text


def test_the_report_gives_the_gateway_ratio_when_both_servers_ran() -> None:
    results = {"gateway": _path(320, 2.0, gateway=0.1), "serve": _path(320, 1.6, serve=0.1)}
    assert "| ≥ 1.0 | 0.80 (160 ÷ 200) |" in report(CONFIG, results)
