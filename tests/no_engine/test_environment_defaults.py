"""The environment variables both sides read, and their defaults when unset."""

from __future__ import annotations

import argparse

import pytest

from streamq.broker.connection import add_connection_options
from streamq.environment import affinity_window_from_env, drain_seconds_from_env, queue_from_env, redis_url_from_env
from streamq.protocol import DEFAULT_DRAIN_SECONDS, DEFAULT_QUEUE, DEFAULT_REDIS_URL
from streamq.protocol.names import AFFINITY_WINDOW_MS


def test_unset_variables_give_the_defaults() -> None:
    assert queue_from_env({}) == DEFAULT_QUEUE
    assert drain_seconds_from_env({}) == DEFAULT_DRAIN_SECONDS
    assert redis_url_from_env({}) == DEFAULT_REDIS_URL
    assert affinity_window_from_env({}) == AFFINITY_WINDOW_MS / 1000


def test_the_affinity_window_comes_from_the_environment_and_a_bad_one_is_named() -> None:
    assert affinity_window_from_env({"STREAMQ_AFFINITY_WINDOW_S": "0"}) == 0
    assert affinity_window_from_env({"STREAMQ_AFFINITY_WINDOW_S": "0.5"}) == 0.5
    with pytest.raises(ValueError, match="STREAMQ_AFFINITY_WINDOW_S must be a number of seconds"):
        affinity_window_from_env({"STREAMQ_AFFINITY_WINDOW_S": "fast"})


def test_set_variables_win() -> None:
    environ = {"STREAMQ_QUEUE": "q2", "STREAMQ_DRAIN_SECONDS": "5", "REDIS_URL": "redis://other:7000"}
    assert queue_from_env(environ) == "q2"
    assert drain_seconds_from_env(environ) == 5
    assert redis_url_from_env(environ) == "redis://other:7000"


def test_command_line_options_default_to_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STREAMQ_QUEUE", "from-env")
    monkeypatch.setenv("REDIS_URL", "redis://env-host:6390")
    parser = argparse.ArgumentParser()
    add_connection_options(parser)
    args = parser.parse_args([])
    assert (args.queue, args.redis_url) == ("from-env", "redis://env-host:6390")
