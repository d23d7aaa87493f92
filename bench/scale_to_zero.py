"""``python -m bench.scale_to_zero``: the autoscaling loop, played against real processes.

One Redis, the exporter (``python -m gateway.exporter``: it tends the waiting set while no
worker claims) and a controller that reads only what KEDA's ``redis`` scaler reads: the size
of the two keys ``deploy/kubernetes/base/keda.yaml`` names (``<queue>:waiting``, and arq's
queue: waiting or running). It sizes the workers as that ScaledObject's HPA would:
``max(ceil(waiting / 8), ceil(in flight / 64))``, at most ``--max-workers``, and down to
zero only once both were empty for ``--cooldown-s``; it starts ``python -m worker`` processes
(the tiny random Llama, real engine) and stops them with SIGTERM (drain, then hand back),
the newest first, as a scale-down removes a pod even while it serves.

Each of ``--cycles`` cycles waits for zero workers, then sends a burst of streaming requests
(the library, with the model declared: nobody serves it yet), and half as many again while
they run; a worker scaled down meanwhile hands back what its 2 s drain did not finish, and
the other takes it over. Every request is followed to its end. It reports:

- requests lost: any that did not end with exactly one final event (an error event, a gap or
  a duplicate the handle refuses, a request that never ended) — the goal is 0;
- per cycle, the first token after zero (from the burst's first submit) against the cold
  start of the first worker started for it (from its process start to its registration, by
  the timestamp of its log line): ≈ 1;
- whether the waiting set equalled the truth (arq's queue, less the jobs whose lease is held
  and those not due), checked atomically at every controller poll.

Writes ``bench/results/<run>-scale-to-zero.json`` and ``.md``; worker logs land beside them.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import redis.asyncio as aioredis

from bench.affinity import engine_env
from devkit.keda import LIST_LENGTH_SCRIPT
from devkit.redis_server import RedisServer, free_port
from devkit.tiny_model import build_tiny_model
from devkit.worker_process import WorkerProcess, tiny_engine_flags
from producer.client import StreamqClient
from streamq.protocol import IN_PROGRESS_PREFIX, ChunkEvent, FinalEvent
from streamq.protocol.names import queue_waiting_key

ROOT = Path(__file__).resolve().parent.parent
MODEL = "tiny"
QUEUE = "streamq:queue:scale-bench"
READY_LINE = "registered model"
"""What a worker logs once it takes requests (its registration)."""
WAITING_PER_WORKER = 8
SLOTS_PER_WORKER = 64
"""The ScaledObject's listLength of each trigger."""

EXACT_SCRIPT = """
local t = redis.call('TIME')
local now = t[1] * 1000 + math.floor(t[2] / 1000)
local truth = 0
for _, id in ipairs(redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now)) do
  if redis.call('EXISTS', ARGV[1] .. id) == 0 then
    truth = truth + 1
    if not redis.call('ZSCORE', KEYS[2], id) then return {truth, -1} end
  end
end
return {truth, redis.call('ZCARD', KEYS[2])}
"""
"""The requests that wait by arq's own keys (due, no lease held), and the waiting set's
size; -1 when one that waits is missing from the set."""


@dataclass
class Request:
    request_id: str
    cycle: int
    submitted: float
    first_chunk: float | None = None
    finals: int = 0
    failure: str | None = None


@dataclass
class Cycle:
    index: int
    burst_at: float
    first_token_s: float | None = None
    cold_start_s: float | None = None

    @property
    def ratio(self) -> float | None:
        if self.first_token_s is None or not self.cold_start_s:
            return None
        return self.first_token_s / self.cold_start_s


@dataclass
class Pod:
    """A worker process as the autoscaler's pod: when it started (Unix time)."""

    worker: WorkerProcess
    started_at: float

    @property
    def ready_at(self) -> float | None:
        """When its engine was up and it took requests, by its own log's clock (Unix time)."""
        for line in self.worker.log_path.read_text(errors="replace").splitlines():
            if READY_LINE in line:
                stamp, _, millis = line[:23].partition(",")
                return time.mktime(time.strptime(stamp, "%Y-%m-%d %H:%M:%S")) + int(millis) / 1000
        return None

    @property
    def cold_start_s(self) -> float | None:
        ready = self.ready_at
        return None if ready is None else ready - self.started_at


@dataclass
class Controller:
    """The autoscaler: KEDA's reads, the HPA's sizing, worker processes as pods."""

    redis: aioredis.Redis
    flags: list[str]
    worker_url: str
    logs: Path
    max_workers: int
    cooldown_s: float
    poll_s: float = 1.0
    workers: list[Pod] = field(default_factory=list)
    """The running workers, oldest first."""
    pods: list[Pod] = field(default_factory=list)
    """Every worker started."""
    stopping: set[asyncio.Future[int]] = field(default_factory=set)
    """Workers told to stop (SIGTERM), not exited yet."""
    checks: int = 0
    exact: int = 0
    started: int = 0
    stopped: int = 0
    _idle_since: float | None = None

    async def run(self) -> None:
        keda = self.redis.register_script(LIST_LENGTH_SCRIPT)
        exact = self.redis.register_script(EXACT_SCRIPT)
        while True:
            truth, members = await exact(keys=[QUEUE, queue_waiting_key(QUEUE)], args=[IN_PROGRESS_PREFIX])
            self.checks += 1
            self.exact += int(truth == members)
            waiting = int(await keda(keys=[queue_waiting_key(QUEUE)]))
            in_flight = int(await keda(keys=[QUEUE]))
            wanted = min(
                self.max_workers, max(math.ceil(waiting / WAITING_PER_WORKER), math.ceil(in_flight / SLOTS_PER_WORKER))
            )
            now = time.time()
            if wanted == 0:
                self._idle_since = self._idle_since or now
                if now - self._idle_since < self.cooldown_s:
                    wanted = min(1, len(self.workers))
            else:
                self._idle_since = None
            while len(self.workers) < wanted:
                self.started += 1
                worker = WorkerProcess(
                    self.worker_url,
                    self.flags,
                    queue=QUEUE,
                    log_path=self.logs / f"worker-{self.started}.log",
                    metrics_port=free_port(),
                    env=engine_env(self.started, 2, True),
                ).start()
                pod = Pod(worker, time.time())
                self.workers.append(pod)
                self.pods.append(pod)
            while len(self.workers) > wanted:
                pod = self.workers.pop()  # the newest, as a scale-down takes a pod
                self.stopped += 1
                # A pod's termination (its drain) runs on while the autoscaler reads on.
                stopping = asyncio.ensure_future(asyncio.to_thread(pod.worker.stop))
                self.stopping.add(stopping)
                stopping.add_done_callback(self.stopping.discard)
            await asyncio.sleep(self.poll_s)

    async def stop_all(self) -> None:
        await asyncio.gather(*self.stopping, *(asyncio.to_thread(pod.worker.stop) for pod in self.workers))
        self.workers.clear()


async def follow(client: StreamqClient, request: Request, max_tokens: int) -> None:
    try:
        handle = await client.submit(
            "The future of artificial intelligence is",
            request_id=request.request_id,
            model=MODEL,
            max_tokens=max_tokens,
            ignore_eos=True,
        )
        async with handle:
            async for event in handle:
                if isinstance(event, ChunkEvent) and request.first_chunk is None:
                    request.first_chunk = time.time()
                elif isinstance(event, FinalEvent):
                    request.finals += 1
        if request.finals != 1:
            request.failure = f"{request.finals} final events"
    except Exception as exc:
        request.failure = f"{type(exc).__name__}: {exc}"


async def play(args: argparse.Namespace, server: RedisServer, logs: Path) -> dict[str, object]:
    model_dir = build_tiny_model(ROOT / ".cache" / "tiny-llama")
    # 16 slots a worker: a burst spreads over both workers, so a scale-down stops one that serves.
    flags = [*tiny_engine_flags(model_dir, max_model_len=1024), "--served-model-name", MODEL, "--max-jobs", "16"]
    flags += ["--drain-seconds", "2"]
    with open(logs / "exporter.log", "ab") as exporter_log:  # the exporter keeps its own copy of the file
        exporter = subprocess.Popen(
            [sys.executable, "-m", "gateway.exporter", "--redis-url", server.url, "--port", str(free_port())],
            stdout=exporter_log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    redis = aioredis.Redis.from_url(server.url)
    controller = Controller(redis, flags, server.url, logs, args.max_workers, args.cooldown_s)
    loop = asyncio.create_task(controller.run())
    requests: list[Request] = []
    cycles: list[Cycle] = []
    try:
        async with await StreamqClient.connect(server.url, declared_models={MODEL: QUEUE}) as client:
            for index in range(args.cycles):
                while controller.workers or controller.stopping:  # zero workers, the last one exited
                    await asyncio.sleep(0.5)
                cycle = Cycle(index, burst_at=time.time())
                cycles.append(cycle)
                burst = [Request(f"c{index}-{i}", index, time.time()) for i in range(args.burst)]
                tasks = [asyncio.ensure_future(follow(client, r, args.max_tokens)) for r in burst]
                while not any(r.first_chunk for r in burst):
                    await asyncio.sleep(0.05)
                more = [Request(f"c{index}-more-{i}", index, time.time()) for i in range(args.burst // 2)]
                tasks += [asyncio.ensure_future(follow(client, r, args.max_tokens)) for r in more]
                await asyncio.gather(*tasks)
                requests += burst + more
                first = min(r.first_chunk for r in burst if r.first_chunk is not None)
                cycle.first_token_s = first - cycle.burst_at
                ready = [pod for pod in controller.pods if pod.started_at >= cycle.burst_at and pod.ready_at]
                cycle.cold_start_s = min(ready, key=lambda pod: pod.ready_at or 0).cold_start_s if ready else None
    finally:
        loop.cancel()
        await asyncio.gather(loop, return_exceptions=True)
        await controller.stop_all()
        exporter.terminate()
        exporter.wait(timeout=30)
        await redis.aclose()
    lost = [asdict(r) for r in requests if r.failure is not None or r.finals != 1]
    return {
        "requests": len(requests),
        "lost": lost,
        "cycles": [{**asdict(c), "ratio": c.ratio} for c in cycles],
        "workers": [
            {"started_at": pod.started_at, "ready_at": pod.ready_at, "cold_start_s": pod.cold_start_s}
            for pod in controller.pods
        ],
        "taken_over": sum(log.read_text(errors="replace").count("(attempt 2)") for log in logs.glob("worker-*.log")),
        "workers_started": controller.started,
        "workers_stopped": controller.stopped,
        "signal_checks": controller.checks,
        "signal_exact": controller.exact,
    }


def report(result: dict[str, object]) -> str:
    lines = [
        f"requests: {result['requests']}, lost: {len(result['lost'])}",  # type: ignore[arg-type]
        f"workers started {result['workers_started']}, stopped {result['workers_stopped']}; "
        f"requests taken over from a stopped worker: {result['taken_over']}",
        f"waiting set exact at {result['signal_exact']} of {result['signal_checks']} checks",
        "",
        "| cycle | first token after zero (s) | cold start (s) | ratio |",
        "|---:|---:|---:|---:|",
    ]
    for cycle in result["cycles"]:  # type: ignore[attr-defined]
        first, cold, ratio = cycle["first_token_s"], cycle["cold_start_s"], cycle["ratio"]
        cells = [f"{v:.2f}" if v is not None else "n/a" for v in (first, cold, ratio)]
        lines.append(f"| {cycle['index']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.scale_to_zero", description=__doc__.split("\n\n")[0])
    parser.add_argument("--cycles", type=int, default=5)
    parser.add_argument("--burst", type=int, default=24, help="requests at zero workers, each cycle (default 24)")
    parser.add_argument(
        "--max-tokens",
        type=int,
        default=600,
        help="per request, all generated (ignore_eos): longer than a scaled-down worker's 2 s drain (default 600)",
    )
    parser.add_argument("--max-workers", type=int, default=2)
    parser.add_argument("--cooldown-s", type=float, default=10.0)
    parser.add_argument("--results-dir", type=Path, default=ROOT / "bench" / "results")
    args = parser.parse_args(argv)
    run_id = time.strftime("%Y%m%d-%H%M%S")
    logs = args.results_dir / f"{run_id}-scale-to-zero-logs"
    logs.mkdir(parents=True, exist_ok=True)
    with RedisServer() as server:
        result = asyncio.run(play(args, server, logs))
    text = report(result)
    print(text)
    (args.results_dir / f"{run_id}-scale-to-zero.json").write_text(json.dumps(result, indent=2))
    (args.results_dir / f"{run_id}-scale-to-zero.md").write_text(text + "\n")


if __name__ == "__main__":
    main()
