"""Start ``python -m worker`` as a real process and wait until it serves.

Shared by the demo, the tests and the benchmarks, which all need a worker that is
exactly what users run, not an in-process imitation.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import redis

from streamq.env_vars import SCRIPTED_TOKENS_PER_S_ENV
from streamq.protocol import DEFAULT_QUEUE, HEALTH_CHECK_SUFFIX


def tiny_engine_flags(model_dir: str | Path, *, max_model_len: int = 256) -> list[str]:
    """Engine flags for the generated tiny model on a CPU (or any) machine."""
    return [
        "--model",
        str(model_dir),
        "--dtype",
        "float32",
        "--max-model-len",
        str(max_model_len),
        "--enforce-eager",
    ]


def worker_env(**extra: str) -> dict[str, str]:
    """The environment for a worker: offline hub, a small CPU KV cache unless set."""
    env = dict(os.environ)
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; ignored by GPU builds
    env.setdefault("PYTHONUNBUFFERED", "1")
    env.update(extra)
    return env


class WorkerProcess:
    """One worker process: started, awaited until healthy, stopped with SIGTERM."""

    def __init__(
        self,
        redis_url: str,
        engine_flags: list[str],
        *,
        queue: str = DEFAULT_QUEUE,
        log_path: Path,
        command: list[str] | None = None,
        env: dict[str, str] | None = None,
        metrics_port: int = 0,
    ) -> None:
        self.redis_url = redis_url
        self.queue = queue
        self.metrics_port = metrics_port
        """Where the worker serves Prometheus metrics; 0 (the default here) turns them
        off, so that several workers on one machine do not contend for one port."""
        self.log_path = log_path
        self.command = command or [
            sys.executable,
            "-m",
            "worker",
            "--redis-url",
            redis_url,
            "--queue",
            queue,
            "--metrics-port",
            str(metrics_port),
            *engine_flags,
        ]
        self.env = env or worker_env()
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> WorkerProcess:
        # A session of its own, as a service manager or a container starts it (and a
        # process group, so kill() takes the engine's processes down with it).
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(
                self.command, stdout=log, stderr=subprocess.STDOUT, env=self.env, start_new_session=True
            )
        return self

    def wait_ready(self, timeout_s: float = 300.0) -> WorkerProcess:
        """Block until the worker serves: its ``/ready`` answers 200 where it has a metrics
        port (this worker registered), else its queue's arq health check appears in Redis
        (written by every worker of the queue). A worker not ready in time is killed before
        the error is raised: a fixture that fails here has no worker to stop, and one left
        running would spin on a core for the rest of the session."""
        assert self.process is not None, "start() first"
        client = redis.Redis.from_url(self.redis_url)
        deadline = time.monotonic() + timeout_s
        try:
            while not (self._answers_ready() if self.metrics_port else client.exists(self.queue + HEALTH_CHECK_SUFFIX)):
                if self.process.poll() is not None:
                    raise RuntimeError(f"worker exited with {self.process.returncode}:\n{self.log_tail()}")
                if time.monotonic() > deadline:
                    self.kill()
                    raise RuntimeError(f"worker not ready after {timeout_s:.0f}s:\n{self.log_tail()}")
                time.sleep(0.2)
        finally:
            client.close()
        return self

    def _answers_ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/ready", timeout=2) as response:
                return bool(response.status == 200)
        except OSError:  # not listening yet (the engine loads), or 503 (not registered yet)
            return False

    def stop(self, timeout_s: float = 60.0) -> int:
        """SIGTERM (arq's graceful shutdown), then SIGKILL if it hangs; the exit code."""
        if self.process is None:
            return 0
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        return self.process.returncode

    def kill(self) -> None:
        """SIGKILL the worker and its engine processes at once: a crash, no cleanup.

        The whole process group, even when the worker itself has exited: engine
        processes it left behind would otherwise spin on a core for a while."""
        if self.process is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()

    def log_tail(self, lines: int = 40) -> str:
        return tail(self.log_path, lines)


def tail(log_path: Path, lines: int = 40) -> str:
    """The last ``lines`` lines of a process's log, for error messages."""
    try:
        return "\n".join(log_path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


SIZED_LINE = "requests at once, and holds up to"
"""What a worker logs once its engine is up and its slots are sized (``StreamqWorker``): it
claims from then on. The queue's health check is not a worker's own."""

SCRIPTED_ENGINE = "devkit.scripted_engine:create"
"""The scripted engine (``devkit/scripted_engine.py``'s ``ClockedEngine``): the queue layer
without a model."""
SCRIPTED_MODEL = "scripted"
"""The model a scripted engine serves: what requests to its worker name."""


def scripted_worker(
    redis_url: str,
    log_path: Path,
    *extra_flags: str,
    tokens_per_s: int = 100,
    ready_url: str | None = None,
    queue: str = DEFAULT_QUEUE,
    metrics_port: int = 0,
) -> WorkerProcess:
    """A real ``python -m worker`` on the scripted engine, for tests of the queue layer
    (Redis faults, connections): no model start-up, little CPU. ``ready_url`` is where
    its health check is awaited, when ``redis_url`` is not a plain URL (Sentinels, a proxy);
    ``metrics_port``: where it serves ``/metrics`` and ``/ready`` (0: nowhere)."""
    command = [sys.executable, "-m", "worker", "--redis-url", redis_url, "--queue", queue]
    command += ["--metrics-port", str(metrics_port), "--engine-factory", SCRIPTED_ENGINE, *extra_flags]
    env = worker_env(**{SCRIPTED_TOKENS_PER_S_ENV: str(tokens_per_s)})
    return WorkerProcess(
        ready_url or redis_url, [], queue=queue, log_path=log_path, command=command, env=env, metrics_port=metrics_port
    )
