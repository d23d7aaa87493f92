"""Keeping the engine's busy CPUs from starving Redis and clients on the same host.

vLLM keeps its processes busy while requests run, and Linux shares CPU time between
scheduling groups (a session's autogroup, a cgroup), not processes. The worker lowers its
group's and its processes' weight at start-up: it still gets every cycle nobody else
wants, but Redis and clients run the moment they are ready.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Mapping
from pathlib import Path

from streamq.env_vars import CPU_NICE_ENV

logger = logging.getLogger("streamq.worker")

DEFAULT_CPU_NICE = 10
"""Nice value for the worker's processes and scheduling group: CFS weight 110 against
1024 for a default process, so Redis and clients win the CPU when both want it."""

_CGROUP_ROOT = Path("/sys/fs/cgroup")


def cpu_nice_from_env(environ: Mapping[str, str] = os.environ) -> int:
    """``$STREAMQ_CPU_NICE`` or the default; 0 leaves the worker's weight alone."""
    return int(environ.get(CPU_NICE_ENV, DEFAULT_CPU_NICE))


def cfs_weight(nice: int) -> int:
    """The kernel's CFS weight for a nice value (1024 at 0, about 1.25x per step)."""
    return max(2, round(1024 / 1.25**nice))


def lower_cpu_weight(nice: int = DEFAULT_CPU_NICE) -> list[str]:
    """Lower this process's CPU weight (and that of every process it starts later) by
    ``nice``, in each way the host schedules it: the process itself, its session's
    autogroup, and its own cgroup when that cgroup is not the host's root and may be
    written. Returns what was changed, for the log."""
    if nice <= 0:
        return []
    changed: list[str] = []
    with contextlib.suppress(OSError):
        os.setpriority(os.PRIO_PROCESS, 0, max(os.getpriority(os.PRIO_PROCESS, 0), nice))
        changed.append(f"process nice {nice}")
    autogroup = Path("/proc/self/autogroup")
    with contextlib.suppress(OSError):
        autogroup.write_text(str(nice))
        changed.append(f"autogroup nice {nice} ({autogroup.read_text().strip()})")
    changed += _lower_cgroup_weight(nice)
    return changed


def lower_worker_cpu_weight(nice: int) -> None:
    """``lower_cpu_weight`` for a worker about to start its engine, said in its log."""
    changed = lower_cpu_weight(nice)
    if changed:
        logger.info("CPU weight lowered so Redis and clients on this host are not starved: %s", "; ".join(changed))


def _lower_cgroup_weight(nice: int) -> list[str]:
    """cgroup v2 ``cpu.weight.nice``, or v1 ``cpu.shares``, of this process's own cgroup."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if path == "/":
            continue  # the host's root group: not ours to change
        if controllers == "":
            target, value = _CGROUP_ROOT / path.lstrip("/") / "cpu.weight.nice", str(nice)
        elif "cpu" in controllers.split(","):
            target, value = _CGROUP_ROOT / controllers / path.lstrip("/") / "cpu.shares", str(cfs_weight(nice))
        else:
            continue
        try:
            target.write_text(value)
        except OSError as exc:
            logger.info("cannot lower the CPU weight of cgroup %s (%s); set it in the unit or container", path, exc)
            continue
        return [f"{target} = {value}"]
    return []
