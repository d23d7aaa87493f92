"""The Batch API benchmark's pure parts (``bench/batch_api.py``): its arguments, the files it
writes for the scripted engine, and the figures and ratios it prints from known results."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from bench.batch_api import (
    GOALS,
    PARTS,
    RssSampler,
    build_parser,
    chosen_parts,
    completion_lines,
    filler_lines,
    make_config,
    report,
    rss_kib,
)
from devkit.worker_process import SCRIPTED_MODEL


def config_of(*argv: str) -> Any:
    return make_config(build_parser().parse_args(list(argv)), "batch-api-test")


def test_the_defaults_are_the_issues_sizes_and_every_part_runs() -> None:
    args = build_parser().parse_args([])
    assert (args.num_prompts, args.output_len, args.max_num_seqs, args.poll_s) == (384, 256, 128, 0.5)
    assert (args.ttft_requests, args.memory_lines, args.memory_tokens, args.rounds) == (20, "5000,50000", 4, 1)
    assert chosen_parts(args.parts) == list(PARTS)


def test_a_quick_run_takes_smaller_sizes_and_a_choice_of_parts() -> None:
    args = build_parser().parse_args(
        ["--num-prompts", "64", "--output-len", "64", "--parts", "throughput, ttft", "--memory-lines", "100"]
    )
    config = make_config(args, "x")
    assert (config.num_prompts, config.output_len) == (64, 64)
    assert chosen_parts(args.parts) == ["throughput", "ttft"]


def test_an_unknown_part_is_refused_with_the_known_ones_named() -> None:
    with pytest.raises(SystemExit, match="unknown parts: speed .*throughput, ttft, memory, takeover"):
        chosen_parts("ttft,speed")


def test_scripted_lines_are_valid_batch_lines_of_the_size_asked_with_unique_ids() -> None:
    lines = list(completion_lines(50, 4, 1000, prefix="m"))
    rows = [json.loads(line) for line in lines]
    assert {len(line) + 1 for line in lines} == {1000}  # with its newline
    assert len({row["custom_id"] for row in rows}) == 50
    for row in rows:
        assert row["method"] == "POST" and row["url"] == "/v1/completions"
        assert row["body"]["model"] == SCRIPTED_MODEL and row["body"]["max_tokens"] == 4


def test_the_rss_sampler_reads_this_process() -> None:
    assert rss_kib(os.getpid()) > 0
    sampler = RssSampler(os.getpid()).start()
    peak = sampler.stop()
    assert peak > 0 and sampler.samples >= 1
    assert rss_kib(2**22 + 12345) == 0  # no such process


def _path(tokens: int, wall_s: float, texts: dict[str, str]) -> dict[str, Any]:
    return {"tokens": tokens, "wall_s": wall_s, "texts": texts}


def test_the_report_gives_each_figure_and_its_ratio_beside_the_goal(tmp_path: Path) -> None:
    config = config_of("--results-dir", str(tmp_path))
    texts = {"request-0": "a", "request-1": "b"}
    results = {
        "offline": _path(10_000, 1.0, texts),
        "rounds": [
            {
                "streamq_batch": _path(10_000, 1.25, texts),  # 8,000 tok/s
                "api": _path(10_000, 1.3, {"request-0": "a", "request-1": "other"})
                | {"stages": {"validating_s": 1, "in_progress_s": 30, "finalizing_s": 0}},
            },
            {
                "api": _path(10_000, 1.0, texts)
                | {"stages": {"validating_s": 0, "in_progress_s": 1, "finalizing_s": 1}},
                "streamq_batch": _path(10_000, 2.0, texts),
            },
        ],
        "ttft": {
            "idle_s": [0.010, 0.020, 0.030],
            "busy_s": [0.030, 0.040, 0.050],
            "in_flight_at_start": 128.0,
            "batch_status_after": "in_progress",
            "batch_done_after": 200,
            "batch_lines": 1536,
        },
        "memory": [
            {
                "lines": 50_000,
                "file_bytes": 50 * 2**20,
                "before_kib": 100 * 1024,
                "peak_kib": 140 * 1024,
                "after_kib": 110 * 1024,
                "answered": 50_000,
                "failed": 0,
                "wall_s": 90.0,
            }
        ],
        "takeover": {
            "lines": 3000,
            "done_at_kill": 700,
            "lease_taken_s": 3.4,
            "resumed_s": 3.61,
            "final_status": "completed",
            "answered": 3000,
            "answered_twice": 0,
            "missing": 0,
        },
    }
    text = report(config, results)
    assert "| - | offline `LLM.chat` | 10,000 | 1.00 | 1.000 | 2/2 |" in text
    assert "| 1 | `streamq batch` | 8,000 | 1.25 | 0.800 | 2/2 |" in text
    assert "| 1 | `/v1/batches` | 7,692 | 1.30 | 0.769 | 1/2 |" in text
    assert "| 2 | `/v1/batches` | 10,000 | 1.00 | 1.000 | 2/2 |" in text
    assert "| 2 | `streamq batch` | 5,000 | 2.00 | 0.500 | 2/2 |" in text
    assert (
        "each round: validating 1 s, in_progress 30 s, finalizing 0 s; validating 0 s, in_progress 1 s, finalizing 1 s"
        in text
    )
    assert f"| `/v1/batches` tok/s ÷ `streamq batch` | {GOALS['api_vs_streamq_batch']} | 0.962; 2.000 |" in text
    assert f"| `/v1/batches` tok/s ÷ offline `LLM.chat` | {GOALS['api_vs_offline']} | 0.769; 1.000 |" in text
    assert "20 ms with no batch, 40 ms while a batch of 1536 lines ran" in text
    assert f"| online chat TTFT p50, batch running ÷ none | {GOALS['ttft_ratio']} | 2.00 |" in text
    assert "| 50,000 | 50 | 100 | 140 | 110 | 50,000 | 0 | 90.0 |" in text
    assert "| 40 MiB at 50,000 lines |" in text
    assert "the lease taken after 3.40 s, the counts moved after 3.61 s" in text
    assert "3000 custom_ids answered, 0 twice, 0 missing" in text
    assert f"| a gateway SIGKILLed mid-batch: until the batch moves again | {GOALS['takeover_s']} | 3.61 s |" in text


def test_a_report_of_some_parts_shows_only_theirs_and_a_takeover_that_never_resumed_says_so() -> None:
    config = config_of()
    takeover = {
        "lines": 10,
        "done_at_kill": 3,
        "lease_taken_s": None,
        "resumed_s": None,
        "final_status": "in_progress",
        "answered": 3,
        "answered_twice": 0,
        "missing": 7,
    }
    text = report(config, {"takeover": takeover})
    assert "tok/s" not in text and "TTFT" not in text and "RSS" not in text
    assert "| a gateway SIGKILLed mid-batch: until the batch moves again | ≤ 5 s | never (within 120 s) |" in text


def test_a_ttft_figure_taken_after_the_batch_ended_is_marked_not_valid() -> None:
    ttft = {
        "idle_s": [0.02],
        "busy_s": [0.02],
        "in_flight_at_start": 128.0,
        "batch_status_after": "completed",
        "batch_done_after": 256,
        "batch_lines": 256,
    }
    text = report(config_of(), {"ttft": ttft})
    assert "| 1.5 | 1.00 (not valid: the batch ended before the last online request" in text.replace("≤ ", "")


def test_the_batch_filling_the_worker_outlasts_the_online_requests_at_any_size() -> None:
    assert filler_lines(config_of()) == 5120  # 40 x 128 slots, above 4 x 384 lines
    assert filler_lines(config_of("--num-prompts", "4000")) == 16000
