"""Path (e): streamq as path (b), with the worker's two front ends on one engine core.

The same requests, client and Redis as (b), against ``python -m worker --front-ends 2``:
the per-token work of the worker spread over two processes. CPU roles: each front end
(``front_end_0``, ``front_end_1``; the report sums them as the front end), the engine
core (with the parent that started it, which only watches), Redis and the subscriber.
"""

from __future__ import annotations

import json
import os
import time

import redis

from bench.cpu import descendants
from bench.path_queue import run_path
from devkit.redis_server import RedisServer
from devkit.worker_process import WorkerProcess
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


def front_end_roles(redis_server: RedisServer, worker: WorkerProcess) -> dict[str, list[int]]:
    """Each front end its own role; the parent that only watches counts with the engine core."""
    assert worker.process is not None and redis_server.process is not None
    front_ends = front_end_pids(redis_server.url, worker.process.pid, FRONT_ENDS)
    engine = [pid for pid in descendants(worker.process.pid) if pid not in front_ends]
    return {f"front_end_{i}": [pid] for i, pid in enumerate(front_ends)} | {
        "engine_core": [worker.process.pid, *engine],
        "redis": [redis_server.process.pid],
        "client": [os.getpid()],
    }


def main() -> None:
    run_path("e", __doc__.splitlines()[0], ["--front-ends", str(FRONT_ENDS)], front_end_roles, with_interval=False)


if __name__ == "__main__":
    main()
