"""A command run as a user runs it, in a session of its own, and what it cost: its wall time,
its CPU time (its ``wait4`` resource usage) and its peak resident memory, sampled while it runs
from ``VmHWM`` (the high-water mark, which ``exec`` resets; ``ru_maxrss`` would also count the
memory of the benchmark process it was forked from)."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

SAMPLE_EVERY_S = 0.05


@dataclass(frozen=True)
class CommandRun:
    """What one run of a command did, and cost."""

    returncode: int
    """Negative when the run was stopped (``-9``: killed)."""
    output: str
    """Its standard output and error, together."""
    wall_s: float
    cpu_s: float
    peak_kib: int


def peak_rss_kib(pid: int) -> int:
    """``pid``'s peak resident memory so far, in KiB (0 once it is gone)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return 0
    match = re.search(r"^VmHWM:\s+(\d+) kB", status, re.MULTILINE)
    return int(match.group(1)) if match else 0


def run_measured(command: list[str], *, cwd: Path, stop_when: Callable[[float], bool] | None = None) -> CommandRun:
    """Run ``command`` until it exits, sampling its memory every ``SAMPLE_EVERY_S``; with
    ``stop_when``, called at each sample with the seconds since the start, kill it (its whole
    session) as soon as that says so."""
    started = time.perf_counter()
    child = subprocess.Popen(command, cwd=cwd, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    peaks = [0]
    exited = threading.Event()

    def sample() -> None:
        while not exited.is_set():
            peaks.append(peak_rss_kib(child.pid))
            if stop_when is not None and stop_when(time.perf_counter() - started):
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(child.pid, signal.SIGKILL)
                return
            exited.wait(SAMPLE_EVERY_S)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    assert child.stdout is not None
    output = child.stdout.read().decode(errors="replace")  # until it exits: a full pipe would stall it
    _, status, usage = os.wait4(child.pid, 0)
    wall_s = time.perf_counter() - started
    child.returncode = os.waitstatus_to_exitcode(status)
    exited.set()
    sampler.join()
    return CommandRun(child.returncode, output, wall_s, usage.ru_utime + usage.ru_stime, max(peaks))
