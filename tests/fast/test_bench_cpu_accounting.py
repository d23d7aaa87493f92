"""The benchmark's CPU accounting: which processes a role covers, and what it spent per token.

A fake ``/proc`` gives exact tick counts; the last test reads the real one.
"""

from __future__ import annotations

import os
from pathlib import Path

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


def test_a_busy_process_holds_at_most_one_core_of_share_over_its_window() -> None:
    window = CpuWindow({"self": [os.getpid()]})
    window.start()
    spin_until = cpu_seconds(os.getpid()) + 0.3
    while cpu_seconds(os.getpid()) < spin_until:
        pass
    share = window.stop().percent()["self"]
    assert 0 < share <= 101, share  # one thread cannot hold more than one core; less while others hold it
