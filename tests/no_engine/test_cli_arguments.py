"""The command line's parsing: subcommands, submit as the default, prompts spelled like
subcommands, and the affinity options of the commands that submit requests."""

from __future__ import annotations

import argparse
import subprocess
import sys
from typing import Any

import pytest

from producer import cli
from producer.affinity_args import affinity_kwargs
from producer.cli import build_parser, with_default_subcommand
from producer.errors import InvalidParameter
from streamq.protocol.messages import Sampling


def parse(*argv: str) -> dict[str, object]:
    return vars(build_parser().parse_args(with_default_subcommand(argv)))


def test_prompts_without_a_subcommand_are_submitted() -> None:
    args = parse("--max-tokens", "8", "The key to happiness is", "Hello")
    assert args["prompts"] == ["The key to happiness is", "Hello"]
    assert args["max_tokens"] == 8


def test_max_tokens_defaults_to_the_engines_own_as_the_library_and_vllm_serve() -> None:
    """Not given, it is not sent: the worker's vLLM applies its default (16), as it does for
    ``StreamqClient.generate`` and ``vllm serve``."""
    assert parse("Hello")["max_tokens"] is None
    assert Sampling().max_tokens is None  # nothing sent: the engine's default


@pytest.mark.parametrize("name", ["follow", "cancel", "batch", "submit"])
@pytest.mark.parametrize("spelling", [("submit",), ("--",), ("submit", "--")])
def test_a_prompt_spelled_like_a_subcommand_can_be_submitted(name: str, spelling: tuple[str, ...]) -> None:
    assert parse(*spelling, name)["prompts"] == [name]


def test_a_renamed_subcommand_runs_its_successor_and_says_its_new_name(capsys: pytest.CaptureFixture[str]) -> None:
    assert parse("tail", "req-1")["run"] is cli.follow_command
    assert "'tail' is now 'follow'" in capsys.readouterr().err


def test_subcommands_take_their_own_arguments() -> None:
    follow = parse("follow", "req-1", "--from-seq", "3")
    assert (follow["request_id"], follow["from_seq"]) == ("req-1", 3)
    assert parse("cancel", "req-2")["request_id"] == "req-2"
    batch = parse("batch", "in.jsonl", "out.jsonl", "--max-in-flight", "4")
    assert (str(batch["input"]), str(batch["output"]), batch["max_in_flight"]) == ("in.jsonl", "out.jsonl", 4)


def run_cli(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "producer", *argv], capture_output=True, text=True, timeout=60)


def test_help_names_every_subcommand_and_exits_zero() -> None:
    result = run_cli("--help")
    assert result.returncode == 0, result.stderr
    for name in ("submit", "follow", "cancel", "batch"):
        assert name in result.stdout
    assert "-- follow" in result.stdout


@pytest.mark.parametrize(
    "argv",
    [
        (),
        ("follow",),
        ("--max-tokens", "many", "Hello"),
        ("batch", "in.jsonl"),
        ("follow", "bad id!"),
        ("cancel", "a/b"),
        ("status", "x" * 200),
        ("--affinity-key", "", "Hello"),
        ("--affinity-key", "k" * 257, "Hello"),
        ("--affinity-key", "chat-1", "--no-affinity", "Hello"),
        ("batch", "in.jsonl", "out.jsonl", "--affinity-key", ""),
        ("batch", "in.jsonl", "out.jsonl", "--affinity-key", "k", "--no-affinity"),
    ],
)
def test_bad_arguments_exit_2_before_reaching_redis(argv: tuple[str, ...]) -> None:
    result = run_cli(*argv, "--redis-url", "redis://127.0.0.1:1") if argv else run_cli()
    assert result.returncode == 2, result.stdout + result.stderr
    assert "usage:" in result.stderr


@pytest.mark.parametrize("command", [("Hello",), ("batch", "in.jsonl", "out.jsonl")])
def test_submitting_commands_take_an_affinity_key_or_opt_out(command: tuple[str, ...]) -> None:
    keyed = parse("--affinity-key", "chat-42", *command)
    assert (keyed["affinity_key"], keyed["affinity"]) == ("chat-42", True)
    assert parse("--affinity-key", "k" * 256, *command)["affinity_key"] == "k" * 256
    off = parse("--no-affinity", *command)
    assert (off["affinity_key"], off["affinity"]) == (None, False)
    default = parse(*command)
    assert (default["affinity_key"], default["affinity"]) == (None, True)


def test_only_the_affinity_options_given_reach_submit() -> None:
    def kwargs(*argv: str) -> dict[str, Any]:
        return affinity_kwargs(build_parser().parse_args(with_default_subcommand(argv)))

    assert kwargs("Hello") == {}  # the library's default: pickup by the prompt's prefix
    assert kwargs("--affinity-key", "doc-7", "Hello") == {"affinity_key": "doc-7"}
    assert kwargs("--no-affinity", "Hello") == {"affinity": False}


def test_a_bad_affinity_key_is_refused_with_its_reason() -> None:
    result = run_cli("--affinity-key", "k" * 300, "Hello", "--redis-url", "redis://127.0.0.1:1")
    assert result.returncode == 2
    assert "argument --affinity-key: affinity_key is 300 characters; the limit is 256" in result.stderr
    result = run_cli("--affinity-key", "k", "--no-affinity", "Hello", "--redis-url", "redis://127.0.0.1:1")
    assert "not allowed with argument --affinity-key" in result.stderr


async def test_submit_passes_the_affinity_options_to_the_library(monkeypatch: pytest.MonkeyPatch) -> None:
    submitted: list[dict[str, Any]] = []

    class Client:
        async def __aenter__(self) -> Client:
            return self

        async def __aexit__(self, *exc: object) -> None:
            return None

        async def submit(self, prompt: str, **kwargs: Any) -> None:
            submitted.append(kwargs)
            raise InvalidParameter("stop here", param="x")  # nothing is sent: no Redis needed

    def connect_from_args(args: argparse.Namespace, **kwargs: Any) -> Client:
        return Client()

    monkeypatch.setattr(cli, "connect_from_args", connect_from_args)
    args = build_parser().parse_args(["submit", "--affinity-key", "chat-9", "Hello"])
    assert await cli.run_submit(args) == 2
    assert submitted[-1]["affinity_key"] == "chat-9" and "affinity" not in submitted[-1]
    assert await cli.run_submit(build_parser().parse_args(["submit", "--no-affinity", "Hello"])) == 2
    assert submitted[-1]["affinity"] is False and "affinity_key" not in submitted[-1]
