"""The worker's view of Redis's clock, and the typed state its jobs read."""

from __future__ import annotations

import pytest

from worker import state
from worker.state import STATE_KEY, RedisClock, state_of


def test_redis_time_is_read_at_the_middle_of_the_round_trip(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = RedisClock()
    clock.observe(redis_ms=105_000, asked_at_ms=99_000, answered_at_ms=101_000)  # Redis 5 s ahead
    monkeypatch.setattr(state.time, "time", lambda: 102.0)  # this machine: 102 000 ms
    assert clock.now_ms() == 107_000
    assert clock.seconds_since(104_000) == 3.0  # a queue score 3 s ago on Redis's clock


def test_an_unobserved_clock_is_the_local_one(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(state.time, "time", lambda: 50.0)
    assert RedisClock().seconds_since(48_500) == 1.5


def test_the_state_of_a_ctx_the_hooks_did_not_fill_is_a_clear_error() -> None:
    with pytest.raises(RuntimeError, match="on_startup"):
        state_of({"redis": None, STATE_KEY: "not a state"})
    with pytest.raises(RuntimeError, match=STATE_KEY):
        state_of({})
