"""CPU time of each benchmark process over a measured window, per delivered token.

Linux's ``/proc/<pid>/stat`` counts every thread's user and system time; two samples, at
the start and the end of a window, give what each process spent on it. Divided by the
tokens delivered in the window, that is a cost that holds across noisy runs, where
tokens/s does not: a slower run delivers fewer tokens and spends proportionally less.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int, proc: Path = Path("/proc")) -> float:
    """User plus system CPU time of ``pid`` (all its threads) so far."""
    return _stat_fields(pid, proc).cpu_ticks / CLOCK_TICKS


def descendants(pid: int, proc: Path = Path("/proc")) -> list[int]:
    """Every living process below ``pid``: a worker's or ``vllm serve``'s engine core
    (and its own children, multiprocessing's resource tracker among them)."""
    parents: dict[int, list[int]] = {}
    for entry in proc.iterdir():
        if entry.name.isdigit():
            try:
                parents.setdefault(_stat_fields(int(entry.name), proc).ppid, []).append(int(entry.name))
            except (OSError, ValueError):
                continue  # exited while we looked
    found, todo = [], [pid]
    while todo:
        for child in parents.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return sorted(found)


@dataclass(frozen=True)
class _Stat:
    ppid: int
    cpu_ticks: int


def _stat_fields(pid: int, proc: Path) -> _Stat:
    # The command name (field 2) may hold spaces and parentheses: split after its last ")".
    fields = (proc / str(pid) / "stat").read_text().rpartition(")")[2].split()
    return _Stat(ppid=int(fields[1]), cpu_ticks=int(fields[11]) + int(fields[12]))


class CpuWindow:
    """CPU seconds of named groups of processes between ``start()`` and ``stop()``.

    ``roles`` maps a role ("redis", "engine_core", ...) to its processes; a role's time is
    their sum. A process that exits inside the window counts for nothing (its last
    sample is gone), so roles name processes that live through it.
    """

    def __init__(self, roles: Mapping[str, list[int]], proc: Path = Path("/proc")) -> None:
        self.roles = {role: list(pids) for role, pids in roles.items() if pids}
        self.proc = proc
        self._before: dict[str, float] = {}
        self._started = 0.0

    def _sample(self) -> dict[str, float]:
        return {role: sum(cpu_seconds(pid, self.proc) for pid in pids) for role, pids in self.roles.items()}

    def start(self) -> None:
        self._before = self._sample()
        self._started = time.monotonic()

    def stop(self) -> WindowCpu:
        after = self._sample()
        return WindowCpu(
            seconds={role: after[role] - self._before[role] for role in self.roles},
            wall_s=time.monotonic() - self._started,
        )


@dataclass(frozen=True)
class WindowCpu:
    """What each role spent over one window of ``wall_s`` seconds."""

    seconds: dict[str, float]
    wall_s: float

    def us_per_token(self, tokens: int) -> dict[str, float]:
        """CPU microseconds each role spent per token delivered in the window."""
        return {role: round(1e6 * s / tokens, 2) if tokens else 0.0 for role, s in self.seconds.items()}

    def percent(self) -> dict[str, float]:
        """Each role's share of one core over the window (100 = one core busy throughout)."""
        return {role: round(100 * s / self.wall_s, 1) if self.wall_s else 0.0 for role, s in self.seconds.items()}
