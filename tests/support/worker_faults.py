"""Making a request start on the worker a test then fails: a second real worker on the
session's queue, and the session worker paused (SIGSTOP) until the fault."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from devkit.worker_process import SIZED_LINE, WorkerProcess, tiny_engine_flags
from tests.support.session import MAX_MODEL_LEN


def pid_of(worker_id: str | None) -> int:
    """The process id in a worker id (``host-pid-random``)."""
    assert worker_id is not None, "the final event names no worker"
    return int(worker_id.rsplit("-", 2)[1])


@contextmanager
def paused(worker: WorkerProcess) -> Iterator[None]:
    """SIGSTOP the worker so that it takes no job until the block ends."""
    assert worker.process is not None
    os.kill(worker.process.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(worker.process.pid, signal.SIGCONT)


def second_worker(worker: WorkerProcess, tiny_model: Path, tmp_path: Path, *extra: str) -> WorkerProcess:
    """Another real worker on the session's queue; it must be ready before any test
    pauses the session worker (which is then the only one able to take jobs)."""
    flags = tiny_engine_flags(tiny_model, max_model_len=MAX_MODEL_LEN) + list(extra)
    process = WorkerProcess(worker.redis_url, flags, log_path=tmp_path / "second-worker.log").start()
    deadline = time.monotonic() + 300
    while SIZED_LINE not in process.log_tail(200):
        assert process.process is not None and process.process.poll() is None, process.log_tail()
        assert time.monotonic() < deadline, process.log_tail()
        time.sleep(0.2)
    return process
