"""The worker's CPU weight: nice values as the kernel weighs them, and where they come from."""

from __future__ import annotations

import pytest

from streamq.env_vars import CPU_NICE_ENV
from worker.scheduling import DEFAULT_CPU_NICE, cfs_weight, cpu_nice_from_env, lower_cpu_weight


def test_cfs_weights_follow_the_kernels_table() -> None:
    # sched_prio_to_weight in the kernel: 1024 at nice 0, 110 at nice 10.
    assert (cfs_weight(0), cfs_weight(10)) == (1024, 110)


def test_each_nice_step_weighs_less_and_never_nothing() -> None:
    weights = [cfs_weight(nice) for nice in range(0, 40)]
    assert all(a > b for a, b in zip(weights, weights[1:], strict=False) if b > 2)
    assert min(weights) == 2


def test_the_nice_value_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(CPU_NICE_ENV, raising=False)
    assert cpu_nice_from_env() == DEFAULT_CPU_NICE
    monkeypatch.setenv(CPU_NICE_ENV, "0")
    assert cpu_nice_from_env() == 0
    monkeypatch.setenv(CPU_NICE_ENV, "not a number")
    with pytest.raises(ValueError):
        cpu_nice_from_env()


def test_a_nice_value_of_zero_leaves_the_weight_alone() -> None:
    assert lower_cpu_weight(0) == []
