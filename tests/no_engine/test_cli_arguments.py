"""The command line's parsing: subcommands, submit as the default, prompts spelled like subcommands."""

from __future__ import annotations

import subprocess
import sys

import pytest

from producer.cli import build_parser, with_default_subcommand


def parse(*argv: str) -> dict[str, object]:
    return vars(build_parser().parse_args(with_default_subcommand(argv)))


def test_prompts_without_a_subcommand_are_submitted() -> None:
    args = parse("--max-tokens", "8", "The key to happiness is", "Hello")
    assert args["prompts"] == ["The key to happiness is", "Hello"]
    assert args["max_tokens"] == 8


@pytest.mark.parametrize("name", ["tail", "cancel", "batch", "submit"])
@pytest.mark.parametrize("spelling", [("submit",), ("--",), ("submit", "--")])
def test_a_prompt_spelled_like_a_subcommand_can_be_submitted(name: str, spelling: tuple[str, ...]) -> None:
    assert parse(*spelling, name)["prompts"] == [name]


def test_subcommands_take_their_own_arguments() -> None:
    tail = parse("tail", "req-1", "--from-seq", "3")
    assert (tail["request_id"], tail["from_seq"]) == ("req-1", 3)
    assert parse("cancel", "req-2")["request_id"] == "req-2"
    batch = parse("batch", "in.jsonl", "out.jsonl", "--concurrency", "4")
    assert (str(batch["input"]), str(batch["output"]), batch["concurrency"]) == ("in.jsonl", "out.jsonl", 4)


def run_cli(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "producer", *argv], capture_output=True, text=True, timeout=60)


def test_help_names_every_subcommand_and_exits_zero() -> None:
    result = run_cli("--help")
    assert result.returncode == 0, result.stderr
    for name in ("submit", "tail", "cancel", "batch"):
        assert name in result.stdout
    assert "-- tail" in result.stdout


@pytest.mark.parametrize(
    "argv",
    [
        (),
        ("tail",),
        ("--max-tokens", "many", "Hello"),
        ("batch", "in.jsonl"),
        ("tail", "bad id!"),
        ("cancel", "a/b"),
        ("status", "x" * 200),
    ],
)
def test_bad_arguments_exit_2_before_reaching_redis(argv: tuple[str, ...]) -> None:
    result = run_cli(*argv, "--redis-url", "redis://127.0.0.1:1") if argv else run_cli()
    assert result.returncode == 2, result.stdout + result.stderr
    assert "usage:" in result.stderr
