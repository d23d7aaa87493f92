"""CPU profiles of benchmark processes with py-spy, summarized as text.

py-spy samples a process from outside, so the worker is profiled exactly as it runs;
``--subprocesses`` includes its engine core, ``--nonblocking`` never pauses it. Only threads
on the CPU are sampled, so the counts are where CPU time goes, not where the program waits.
"""

from __future__ import annotations

import re
import shutil
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path
from types import TracebackType

_LOCATION = re.compile(r" \((?P<file>[^()]*?)(?::\d+)?\)$")


def py_spy_binary() -> str:
    found = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if not Path(found).exists():
        raise RuntimeError("py-spy is not installed: pip install py-spy")
    return found


class PySpyRecording:
    """Records ``pid`` (and its children) while the ``with`` block runs; on exit
    writes the collapsed stacks to ``out`` and a summary beside it."""

    def __init__(self, pid: int, out: Path, *, rate: int = 100, gil: bool = False) -> None:
        self.pid, self.out, self.rate = pid, out, rate
        self.gil = gil
        """Sample only the thread holding the GIL: what the Python code itself costs, without
        the time a thread spends waiting for the GIL (vLLM tokenizes in a thread pool)."""
        self._process: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> PySpyRecording:
        command = [
            py_spy_binary(),
            "record",
            "--pid",
            str(self.pid),
            "--subprocesses",
            "--nonblocking",
            *(["--gil"] if self.gil else []),
            "--rate",
            str(self.rate),
            "--format",
            "raw",
            "--output",
            str(self.out),
        ]
        self._process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        assert self._process is not None
        self._process.send_signal(signal.SIGINT)  # py-spy writes its output on SIGINT
        _, stderr = self._process.communicate(timeout=60)
        if not self.out.exists():
            print(f"py-spy wrote nothing: {stderr.decode(errors='replace')[-2000:]}", flush=True)
            return
        summary = summarize_collapsed(self.out)
        self.out.with_suffix(".summary.txt").write_text(summary)
        print(summary, flush=True)


def summarize_collapsed(path: Path, top: int = 30) -> str:
    """Samples per process, then the functions with the most self and inclusive time."""
    by_process: Counter[str] = Counter()
    self_time: Counter[str] = Counter()
    inclusive: Counter[str] = Counter()
    total = 0
    for line in path.read_text().splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        count = int(count_text)
        frames = stack.split(";")
        total += count
        by_process[_short_process(frames[0])] += count
        functions = [_function(f) for f in frames[2:]]  # after process and thread
        if functions:
            self_time[functions[-1]] += count
        for function in set(functions):
            inclusive[function] += count
    lines = [f"{path.name}: {total} samples on CPU", "", "per process:"]
    lines += [f"  {n:7d} {100 * n / total:5.1f}%  {name}" for name, n in by_process.most_common()]
    for title, counter in (("self time", self_time), ("inclusive time", inclusive)):
        lines += ["", f"top {top} by {title}:"]
        lines += [f"  {n:7d} {100 * n / total:5.1f}%  {name}" for name, n in counter.most_common(top)]
    return "\n".join(lines) + "\n"


def _function(frame: str) -> str:
    """``name (path/to/module.py:123)`` → ``name (module.py)``: one entry per function."""
    match = _LOCATION.search(frame)
    if match is None:
        return frame
    return f"{frame[: match.start()]} ({Path(match['file']).name})"


def _short_process(frame: str) -> str:
    return frame if len(frame) < 80 else frame[:77] + "..."
