"""``python -m bench.batch_scale``: ``streamq batch`` on a large file: its enqueue rate and its memory.

No model: the lines are one-token requests, and the workers (when any) run the scripted
engine, so what is measured is the command itself. Redis, the command and the workers each
run in a session of their own. Two runs over the same file (``--lines``, default 100,000):

1. **enqueue**: no worker is live and ``--max-in-flight`` admits every line, so the command
   enqueues the whole file as fast as it can: lines queued per second (sampled from the
   queue's length), and its peak memory with every line in flight;
2. **through workers**: ``--workers`` scripted workers are live and the command keeps its
   default window (twice their slots): the whole file answered, its peak memory, requests/s.

Peak memory is the command's ``VmHWM`` (its resident high-water mark), sampled every 50 ms.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import redis

from bench.command import CommandRun, run_measured
from devkit.redis_server import RedisServer
from devkit.worker_process import WorkerProcess, scripted_worker
from streamq.env_vars import SCRIPTED_MAX_NUM_SEQS_ENV

ROOT = Path(__file__).resolve().parents[1]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench.batch_scale", description=__doc__.splitlines()[0])
    parser.add_argument("--lines", type=int, default=100_000, help="lines of the file (default %(default)s)")
    parser.add_argument("--workers", type=int, default=2, help="scripted workers of run 2 (default %(default)s)")
    parser.add_argument("--slots", type=int, default=256, help="each worker's slots (default %(default)s)")
    parser.add_argument("--results-dir", type=Path, default=ROOT / "bench" / "results")
    return parser


@dataclass
class BatchRun:
    """One run of ``streamq batch``, and the queue's length while it ran."""

    run: CommandRun
    queued_at: list[tuple[float, int]]
    """(seconds since the start, requests queued or running), sampled every 50 ms."""


def run_command(command: list[str], redis_url: str, queue: str, *, until_queued: int | None = None) -> BatchRun:
    """Run ``command`` in a session of its own until it exits (or, with ``until_queued``,
    until that many requests are queued, then stop it), sampling its memory and the queue."""
    queued_at: list[tuple[float, int]] = []
    with redis.Redis.from_url(redis_url) as client:

        def sample(elapsed_s: float) -> bool:
            queued = int(client.zcard(queue))
            queued_at.append((elapsed_s, queued))
            return until_queued is not None and queued >= until_queued

        run = run_measured(command, cwd=ROOT, stop_when=sample)
    if until_queued is None and run.returncode != 0:
        raise SystemExit(f"streamq batch failed ({run.returncode}): {run.output[-2000:]}")
    return BatchRun(run, queued_at)


def enqueue_rate(run: BatchRun, lines: int) -> float:
    """Lines queued per second between 10% and 90% of the file (start-up and the tail left out)."""
    low = next(t for t, q in run.queued_at if q >= lines // 10)
    high = next(t for t, q in run.queued_at if q >= lines * 9 // 10)
    return (lines * 8 // 10) / (high - low)


def main() -> None:
    args = build_parser().parse_args()
    os.chdir(ROOT)
    args.results_dir.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    batch = args.results_dir / f"scale-{stamp}-in.jsonl"
    with batch.open("w") as out:
        for i in range(args.lines):
            body = {"prompt": f"line {i} of a large batch", "max_tokens": 1}
            out.write(json.dumps({"custom_id": f"line-{i}", "method": "POST", "url": "/v1/completions", "body": body}))
            out.write("\n")
    print(f"{args.lines:,} lines, {batch.stat().st_size / 1e6:.1f} MB: {batch}", flush=True)

    def command(redis_url: str, out: Path, *extra: str) -> list[str]:
        base = [sys.executable, "-m", "producer", "batch", str(batch), str(out), "--no-progress"]
        return [*base, "--redis-url", redis_url, *extra]

    with RedisServer() as server:
        queue = "streamq:queue"
        first = run_command(
            command(server.url, args.results_dir / f"scale-{stamp}-out-1.jsonl", "--max-in-flight", str(args.lines)),
            server.url,
            queue,
            until_queued=args.lines,
        )
        rate = enqueue_rate(first, args.lines)
        print(f"1. enqueue: {rate:,.0f} lines/s, peak {first.run.peak_kib / 1024:.0f} MiB with every line in flight")

    with RedisServer() as server:
        workers: list[WorkerProcess] = []
        try:
            for index in range(args.workers):
                log = args.results_dir / f"scale-{stamp}-worker-{index}.log"
                worker = scripted_worker(server.url, log, tokens_per_s=1000)
                worker.env[SCRIPTED_MAX_NUM_SEQS_ENV] = str(args.slots)
                workers.append(worker.start())
            for worker in workers:
                worker.wait_ready()
            out = args.results_dir / f"scale-{stamp}-out-2.jsonl"
            second = run_command(command(server.url, out), server.url, "streamq:queue")
        finally:
            for worker in workers:
                worker.stop()
        answered = sum(1 for _ in out.open())
        deepest = max(q for _, q in second.queued_at)
        print(
            f"2. through {args.workers} workers of {args.slots} slots: {answered:,} lines answered in "
            f"{second.run.wall_s:.1f}s ({answered / second.run.wall_s:,.0f} requests/s), "
            f"peak {second.run.peak_kib / 1024:.0f} MiB, "
            f"at most {deepest} requests queued or running"
        )
    summary = {
        "lines": args.lines,
        "enqueue_lines_per_s": round(rate),
        "peak_mib_all_in_flight": round(first.run.peak_kib / 1024),
        "workers": args.workers,
        "slots": args.slots,
        "through_workers_s": round(second.run.wall_s, 1),
        "peak_mib_default_window": round(second.run.peak_kib / 1024),
        "deepest_queue": deepest,
    }
    (args.results_dir / f"scale-{stamp}.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
