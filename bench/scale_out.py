"""The scale-out run: 1, 2, 4 workers on one Redis with the scripted engine.

No model compute, so the tokens per second reaching subscribers are what the queue layer can
carry (a worker may merge several tokens into one chunk event under load: tokens are the
throughput, events per token what merging saves). Each worker count gets a fresh Redis, its
workers and subscriber processes; the CPU time of every process over the window (100% = one
core) shows which of them is the limit, and per delivered token what each one costs.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from bench.cpu import CpuWindow
from bench.profiling import PySpyRecording
from devkit.redis_server import RedisServer
from devkit.worker_process import SCRIPTED_ENGINE, SIZED_LINE, WorkerProcess, worker_env
from streamq.env_vars import SCRIPTED_MAX_NUM_SEQS_ENV, SCRIPTED_TOKENS_PER_S_ENV

READY_LINE = SIZED_LINE
"""Each worker logs this once its engine is up; with several workers on one queue
the shared arq health-check key cannot tell them apart."""


@dataclass(frozen=True)
class ScaleOutConfig:
    workers: tuple[int, ...]
    tokens_per_s: float  # per request
    max_num_seqs: int  # per worker
    output_len: int
    subscribers: int  # subscriber processes
    warmup_s: float
    measure_s: float
    results_dir: Path
    run_id: str
    model_dir: str  # the worker builds engine arguments even for a factory, so it needs a model that resolves offline
    profile: bool = False  # record worker 0 with py-spy over the window (perturbs the figures)


@dataclass
class ScaleOutResult:
    workers: int
    subscribers: int
    requests_in_flight: int
    offered_tokens_s: float  # what the scripted engines generate when nothing holds them back
    delivered_tokens_s: float  # token ids reaching subscribers
    delivered_events_s: float  # chunk events reaching subscribers
    errors: int
    # Submit to first chunk, of requests submitted inside the window: how long a request waits to
    # be picked up and started. None when none was (requests outlasting the window hold every slot).
    ttft_p50_ms: float | None
    ttft_p99_ms: float | None
    cpu_percent: dict[str, float] = field(default_factory=dict)  # by process, 100 = one core
    cpu_us_per_token: dict[str, float] = field(default_factory=dict)  # by process and role, per delivered token

    def ttft_ms(self) -> str:
        if self.ttft_p50_ms is None or self.ttft_p99_ms is None:
            return "n/a (no request started in the window)"
        return f"{self.ttft_p50_ms:.0f} / {self.ttft_p99_ms:.0f}"

    @property
    def events_per_token(self) -> float:
        return self.delivered_events_s / self.delivered_tokens_s if self.delivered_tokens_s else 0.0


def wait_logged(worker: WorkerProcess, line: str, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while line not in worker.log_path.read_text(errors="replace"):
        assert worker.process is not None
        if worker.process.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"worker not ready:\n{worker.log_tail()}")
        time.sleep(0.2)


def run_one(config: ScaleOutConfig, workers: int) -> ScaleOutResult:
    in_flight = workers * config.max_num_seqs
    env = worker_env(
        **{SCRIPTED_TOKENS_PER_S_ENV: str(config.tokens_per_s), SCRIPTED_MAX_NUM_SEQS_ENV: str(config.max_num_seqs)}
    )
    with RedisServer() as redis_server:
        assert redis_server.process is not None
        processes = []
        for i in range(workers):
            log_path = config.results_dir / f"{config.run_id}-scale{workers}-worker{i}.log"
            command = [
                sys.executable,
                "-m",
                "worker",
                "--redis-url",
                redis_server.url,
                "--engine-factory",
                SCRIPTED_ENGINE,
                "--model",
                config.model_dir,
            ]
            processes.append(WorkerProcess(redis_server.url, [], log_path=log_path, command=command, env=env).start())
        try:
            for worker in processes:
                wait_logged(worker, READY_LINE)
            start_at = time.time() + 2.0
            clients = []
            for i in range(config.subscribers):
                share = in_flight // config.subscribers + (i < in_flight % config.subscribers)
                out = config.results_dir / f"{config.run_id}-scale{workers}-subscriber{i}.json"
                command = [
                    sys.executable,
                    "-m",
                    "bench.scale_out_client",
                    "--redis-url",
                    redis_server.url,
                    "--concurrency",
                    str(share),
                    "--output-len",
                    str(config.output_len),
                    "--start-at",
                    str(start_at),
                    "--stagger",
                    str(config.output_len / config.tokens_per_s),
                    "--warmup",
                    str(config.warmup_s),
                    "--measure",
                    str(config.measure_s),
                    "--out",
                    str(out),
                ]
                clients.append((subprocess.Popen(command, env=env, start_new_session=True), out))
            roles = {f"worker{i}": [w.process.pid] for i, w in enumerate(processes) if w.process is not None}
            roles["redis"] = [redis_server.process.pid]
            roles.update({f"subscriber{i}": [c.pid] for i, (c, _) in enumerate(clients)})
            window = CpuWindow(roles)
            window_start = start_at + config.warmup_s
            time.sleep(max(0.0, window_start - time.time()))
            with contextlib.ExitStack() as stack:
                if config.profile:
                    out = config.results_dir / f"{config.run_id}-scale{workers}-worker0.pyspy.txt"
                    stack.enter_context(PySpyRecording(roles["worker0"][0], out))
                window.start()
                time.sleep(max(0.0, window_start + config.measure_s - time.time()))
                cpu = window.stop()
            for client, _ in clients:
                if client.wait(timeout=120) != 0:
                    raise RuntimeError(f"a subscriber process exited with {client.returncode}")
            counts = [json.loads(out.read_text()) for _, out in clients]
        finally:
            for worker in processes:
                worker.stop()
    tokens = sum(c["tokens_in_window"] for c in counts)
    ttfts = [t for c in counts for t in c["ttft_s"]]
    result = ScaleOutResult(
        workers=workers,
        subscribers=config.subscribers,
        requests_in_flight=in_flight,
        offered_tokens_s=in_flight * config.tokens_per_s,
        delivered_tokens_s=tokens / config.measure_s,
        delivered_events_s=sum(c["events_in_window"] for c in counts) / config.measure_s,
        errors=sum(c["errors"] for c in counts),
        ttft_p50_ms=1000 * float(np.percentile(ttfts, 50)) if ttfts else None,
        ttft_p99_ms=1000 * float(np.percentile(ttfts, 99)) if ttfts else None,
        cpu_percent=cpu.percent(),
        cpu_us_per_token=by_role(cpu.us_per_token(tokens)),
    )
    shares = ", ".join(f"{role} {pct:.0f}%" for role, pct in result.cpu_percent.items())
    costs = ", ".join(f"{role} {us:.1f}" for role, us in result.cpu_us_per_token.items())
    print(
        f"[scale-out] {workers} worker(s): {result.delivered_tokens_s:,.0f} tokens/s delivered "
        f"(offered {result.offered_tokens_s:,.0f}) in {result.delivered_events_s:,.0f} events/s "
        f"({result.events_per_token:.3f} per token); time to first chunk p50/p99 {result.ttft_ms()} ms; "
        f"CPU: {shares}; CPU us per token: {costs}",
        flush=True,
    )
    return result


def by_role(us_per_token: dict[str, float]) -> dict[str, float]:
    """Each process's CPU per delivered token, then the sums over all workers
    (``workers``) and all subscribers (``subscribers``)."""
    totals = {
        group: round(sum(us for role, us in us_per_token.items() if role.startswith(prefix)), 2)
        for group, prefix in (("workers", "worker"), ("subscribers", "subscriber"))
    }
    return us_per_token | totals


def run_scale_out(config: ScaleOutConfig) -> list[ScaleOutResult]:
    return [run_one(config, workers) for workers in config.workers]
