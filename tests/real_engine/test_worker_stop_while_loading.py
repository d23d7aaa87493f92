"""A worker stopped while its engine loads (a scale-down reaching a pod that is still
starting) exits at once, with its engine core, and never registers.

vLLM's ``AsyncLLM`` start-up blocks the event loop on which arq handles SIGTERM; without
``worker/interrupt.py`` the worker would ignore the signal until the engine is up (up to
``VLLM_ENGINE_READY_TIMEOUT_S``), and a supervisor would kill it and leave the engine core
behind. One worker start, stopped early in the load.
"""

from __future__ import annotations

import os
import signal
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import psutil
import redis

from devkit.worker_process import WorkerProcess, tiny_engine_flags
from streamq.protocol import HEALTH_CHECK_SUFFIX
from streamq.protocol.messages import decode_registration
from streamq.protocol.names import WORKERS_KEY
from tests.support.session import MAX_MODEL_LEN

LOAD_BEGINS = "structured outputs backend"
"""What the worker logs just before it builds ``AsyncLLM`` (which starts the engine core)."""
STOPPED = "stopped before serving (SIGTERM while the engine was loading)"


def wait_for(condition: Callable[[], object], what: str, worker: WorkerProcess, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert worker.process is not None and worker.process.poll() is None, f"exited:\n{worker.log_tail()}"
        assert time.monotonic() < deadline, f"no {what} after {timeout_s:.0f}s:\n{worker.log_tail()}"
        time.sleep(0.05)


def engine_core_started(pid: int) -> bool:
    """Whether the worker has spawned its engine core (named so once its imports are done)."""
    return any(
        "spawn_main" in command or "EngineCore" in command
        for command in (" ".join(child.cmdline()) for child in psutil.Process(pid).children())
    )


def session_processes(session_id: int) -> list[psutil.Process]:
    """The live processes of the session the worker leads (its engine core included)."""
    found = []
    for process in psutil.process_iter():
        try:
            if os.getsid(process.pid) == session_id and process.status() != psutil.STATUS_ZOMBIE:
                found.append(process)
        except (ProcessLookupError, psutil.Error):
            continue
    return found


def test_sigterm_while_the_engine_loads_exits_at_once_and_leaves_nothing(
    worker_url: str, redis_url: str, tiny_model: Path, tmp_path: Path
) -> None:
    queue = f"streamq:queue:stop-while-loading-{uuid.uuid4().hex[:8]}"
    flags = tiny_engine_flags(tiny_model, max_model_len=MAX_MODEL_LEN)
    worker = WorkerProcess(worker_url, flags, queue=queue, log_path=tmp_path / "worker.log").start()
    assert worker.process is not None
    pid = worker.process.pid
    try:
        wait_for(lambda: LOAD_BEGINS in worker.log_path.read_text(errors="replace"), LOAD_BEGINS, worker, 180)
        # The engine core's process exists: the load is under way, in the worker and beside it.
        wait_for(lambda: engine_core_started(pid), "engine core process", worker, 30)
        sent = time.monotonic()
        worker.process.send_signal(signal.SIGTERM)
        code = worker.process.wait(timeout=30)
        took = time.monotonic() - sent
        log = worker.log_path.read_text(errors="replace")
        assert code == 0, log
        assert took < 10, f"exited {took:.1f}s after SIGTERM:\n{worker.log_tail()}"
        assert STOPPED in log
        assert "model loaded" not in log and "registered model" not in log
        deadline = time.monotonic() + 5  # the resource tracker ends once its pipe closes
        while (left := session_processes(pid)) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not left, [(p.pid, p.cmdline()) for p in left]
        with redis.Redis.from_url(redis_url) as client:
            registrations = [decode_registration(raw) for raw in client.zrange(WORKERS_KEY, 0, -1)]
            assert queue not in {registration.queue for registration in registrations}
            assert not client.exists(queue + HEALTH_CHECK_SUFFIX)
    finally:
        worker.kill()
