"""Path (e): streamq as path (b), with the worker's two front ends on one engine core.

The same requests, client and Redis as (b), against ``python -m worker --front-ends 2``:
the per-token work of the worker spread over two processes. CPU roles: each front end
(``front_end_0``, ``front_end_1``; the report sums them as the front end), the engine
core (with the parent that started it, which only watches), Redis and the subscriber.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from pathlib import Path

import redis

from bench.cpu import descendants
from bench.path_queue import measure
from bench.path_run import parse_path_args, write_results
from devkit.redis_server import RedisServer
from devkit.worker_process import WorkerProcess, worker_env
from streamq.protocol.names import WORKER_STATS_KEY

FRONT_ENDS = 2


def front_end_pids(redis_url: str, parent_pid: int, count: int, timeout_s: float = 60.0) -> list[int]:
    """The front ends' pids, as their stats reports name them (each reports every second)."""
    client = redis.Redis.from_url(redis_url)
    children = set(descendants(parent_pid))
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            raws: list[bytes] = client.hvals(WORKER_STATS_KEY)  # type: ignore[assignment]
            reports = [json.loads(raw) for raw in raws]
            pids = sorted(r["pid"] for r in reports if r["pid"] in children)
            if len(pids) == count:
                return pids
            if time.monotonic() > deadline:
                raise RuntimeError(f"{len(pids)} of {count} front ends reported after {timeout_s:.0f}s")
            time.sleep(0.2)
    finally:
        client.close()


def main() -> None:
    config, out = parse_path_args(__doc__.splitlines()[0])
    log_path = Path(config.results_dir) / f"{config.run_id}-e-worker.log"
    with RedisServer() as redis_server:
        flags = [*config.engine_flags(), "--front-ends", str(FRONT_ENDS)]
        worker = WorkerProcess(redis_server.url, flags, log_path=log_path, env=worker_env())
        try:
            worker.start().wait_ready()
            assert worker.process is not None and redis_server.process is not None
            front_ends = front_end_pids(redis_server.url, worker.process.pid, FRONT_ENDS)
            engine = [pid for pid in descendants(worker.process.pid) if pid not in front_ends]
            roles = {f"front_end_{i}": [pid] for i, pid in enumerate(front_ends)}
            roles |= {
                "engine_core": [worker.process.pid, *engine],
                "redis": [redis_server.process.pid],
                "client": [os.getpid()],
            }
            results = asyncio.run(measure(config, redis_server, worker, roles, path="e", with_interval=False))
            write_results(out, results)
        finally:
            code = worker.stop()
            if code != 0:
                print(f"[e] worker exited with {code}; see {log_path}", flush=True)


if __name__ == "__main__":
    main()
