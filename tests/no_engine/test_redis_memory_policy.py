"""What a worker makes of Redis's memory settings at start-up (``streamq/broker/memory_policy.py``)."""

from __future__ import annotations

import pytest

from streamq.broker.memory_policy import EvictingRedis, MemoryPolicy, allow_evicting_from_env, check_memory_policy


def policy(name: str) -> MemoryPolicy:
    return MemoryPolicy(name, 1 << 30, 2_000_000)


def test_noeviction_is_said_and_not_warned_of() -> None:
    assert check_memory_policy(policy("noeviction"), allow_evicting=False) is None
    assert (
        policy("noeviction").describe()
        == "maxmemory-policy noeviction, maxmemory 1,073,741,824 bytes, 2,000,000 bytes used"
    )


@pytest.mark.parametrize("name", ["volatile-lru", "volatile-lfu", "volatile-random", "volatile-ttl"])
def test_a_volatile_policy_is_warned_of_with_what_it_loses_and_the_fix(name: str) -> None:
    warning = check_memory_policy(policy(name), allow_evicting=False)
    assert warning is not None and name in warning and "keys with an expiry" in warning
    assert "queued jobs" in warning and "Set maxmemory-policy noeviction" in warning


@pytest.mark.parametrize("name", ["allkeys-lru", "allkeys-lfu", "allkeys-random"])
def test_a_policy_that_evicts_any_key_refuses_the_start_unless_allowed(name: str) -> None:
    with pytest.raises(EvictingRedis, match="--allow-evicting-redis"):
        check_memory_policy(policy(name), allow_evicting=False)
    warning = check_memory_policy(policy(name), allow_evicting=True)
    assert warning is not None and "any key" in warning


def test_info_without_the_fields_reads_as_unknown() -> None:
    assert MemoryPolicy.of_info({"used_memory": 5}) is None
    assert MemoryPolicy.of_info({"maxmemory_policy": "noeviction", "maxmemory": 0, "used_memory": 5}) == MemoryPolicy(
        "noeviction", 0, 5
    )


@pytest.mark.parametrize(("value", "allowed"), [("1", True), ("YES", True), ("", False), ("0", False)])
def test_the_environment_allows_eviction_only_when_it_says_so(value: str, allowed: bool) -> None:
    assert allow_evicting_from_env({"STREAMQ_ALLOW_EVICTING_REDIS": value}) is allowed


def test_a_word_that_is_neither_yes_nor_no_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match=r"\$STREAMQ_ALLOW_EVICTING_REDIS='sure'"):
        allow_evicting_from_env({"STREAMQ_ALLOW_EVICTING_REDIS": "sure"})
