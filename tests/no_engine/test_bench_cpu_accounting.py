"""The benchmark's CPU accounting: which processes a role covers, and what it spent per token.

A fake ``/proc`` gives exact tick counts; the last test reads the real one.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import bench.cpu
from bench.cpu import CLOCK_TICKS, CpuWindow, cpu_seconds, descendants


def write_stat(proc: Path, pid: int, ppid: int, utime: int, stime: int, comm: str = "python") -> None:
    """One ``/proc/<pid>/stat`` line as Linux writes it (fields 14 and 15: user and system ticks)."""
    fields = ["S", str(ppid), *["0"] * 9, str(utime), str(stime), *["0"] * 10]
    (proc / str(pid)).mkdir(exist_ok=True)
    (proc / str(pid) / "stat").write_text(f"{pid} ({comm}) {' '.join(fields)}\n")


def test_cpu_time_is_user_plus_system_even_when_the_command_name_has_spaces_and_parentheses(tmp_path: Path) -> None:
    write_stat(tmp_path, 7, 1, utime=3 * CLOCK_TICKS, stime=CLOCK_TICKS, comm="VLLM::EngineCore (0) x")
    assert cpu_seconds(7, tmp_path) == 4.0


def test_a_front_end_covers_its_engine_core_and_that_core_s_children_but_not_its_siblings(tmp_path: Path) -> None:
    write_stat(tmp_path, 10, 1, 0, 0)  # the worker
    write_stat(tmp_path, 11, 10, 0, 0)  # its engine core
    write_stat(tmp_path, 12, 11, 0, 0)  # a process the engine core spawned
    write_stat(tmp_path, 20, 1, 0, 0)  # Redis, started by the same parent as the worker
    (tmp_path / "self").mkdir()  # not a process
    assert descendants(10, tmp_path) == [11, 12]
    assert descendants(20, tmp_path) == []


def test_a_window_charges_each_role_what_its_processes_spent_inside_it(tmp_path: Path) -> None:
    write_stat(tmp_path, 10, 1, utime=100, stime=50)
    write_stat(tmp_path, 11, 10, utime=1000, stime=0)
    write_stat(tmp_path, 20, 1, utime=7, stime=0)
    window = CpuWindow({"front_end": [10], "engine_core": [11], "redis": [20], "gateway": []}, tmp_path)
    window.start()
    write_stat(tmp_path, 10, 1, utime=100 + CLOCK_TICKS, stime=50 + CLOCK_TICKS)  # 2 s
    write_stat(tmp_path, 11, 10, utime=1000 + 4 * CLOCK_TICKS, stime=0)  # 4 s
    cpu = window.stop()
    assert cpu.seconds == {"front_end": 2.0, "engine_core": 4.0, "redis": 0.0}  # a role with no process is left out
    assert cpu.us_per_token(4000) == {"front_end": 500.0, "engine_core": 1000.0, "redis": 0.0}
    assert cpu.us_per_token(0) == {"front_end": 0.0, "engine_core": 0.0, "redis": 0.0}


def test_share_of_a_core_is_cpu_seconds_over_the_wall_time_of_the_window(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    clock = iter([100.0, 104.0])  # a 4 s window
    monkeypatch.setattr(bench.cpu.time, "monotonic", lambda: next(clock))
    write_stat(tmp_path, 10, 1, utime=0, stime=0)
    window = CpuWindow({"worker": [10]}, tmp_path)
    window.start()
    write_stat(tmp_path, 10, 1, utime=2 * CLOCK_TICKS, stime=CLOCK_TICKS)  # 3 s of CPU
    assert window.stop().percent() == {"worker": 75.0}


def test_the_real_proc_shows_this_process_spending_cpu() -> None:
    before = cpu_seconds(os.getpid())
    sum(i * i for i in range(2_000_000))  # ~0.1 s of CPU, ten clock ticks
    assert cpu_seconds(os.getpid()) > before
