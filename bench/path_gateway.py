"""Path (d): streamq's OpenAI-compatible gateway, driven by ``vllm bench serve``.

The same client as path (c), pointed at ``python -m gateway`` instead of
``vllm serve``: HTTP + SSE → gateway → Redis → ``python -m worker`` (the same engine
flags) → pub/sub → gateway → client. What a user of ``vllm serve`` gets by putting
the queue between their clients and their GPUs. CPU roles: the worker (``front_end``), its
engine core, Redis, the gateway and this process (``client``).
"""

from __future__ import annotations

import time
from pathlib import Path

import httpx

from bench.cpu import descendants
from bench.path_front_ends import front_end_pids
from bench.path_run import parse_path_args, write_results
from bench.path_serve import bench_serve_levels, server_roles
from devkit.gateway_process import GatewayProcess
from devkit.redis_server import RedisServer
from devkit.worker_process import WorkerProcess, worker_env


def wait_for_model(gateway: GatewayProcess, model: str, timeout_s: float = 30) -> None:
    """Until ``/v1/models`` lists ``model`` (the worker registers once its engine is up)."""
    deadline = time.monotonic() + timeout_s
    while model not in {m["id"] for m in httpx.get(gateway.url + "/v1/models", timeout=5).json()["data"]}:
        if time.monotonic() > deadline:
            raise RuntimeError(f"/v1/models never listed {model!r}:\n{gateway.log_tail()}")
        time.sleep(0.2)


def main() -> None:
    config, out = parse_path_args(__doc__.splitlines()[0])
    results_dir = Path(config.results_dir)
    with RedisServer() as redis_server:
        worker = WorkerProcess(
            redis_server.url,
            [*config.engine_flags(), "--front-ends", str(config.front_ends)],
            log_path=results_dir / f"{config.run_id}-d-worker.log",
            env=worker_env(),
        )
        gateway_log = results_dir / f"{config.run_id}-d-gateway.log"
        gateway = GatewayProcess(redis_server.url, gateway_log, "--log-level", "warning")
        try:
            worker.start().wait_ready()
            gateway.wait_ready()
            wait_for_model(gateway, config.model_dir)
            assert worker.process is not None and redis_server.process is not None
            assert gateway.process is not None
            several = config.front_ends > 1
            front_ends = front_end_pids(redis_server.url, worker.process.pid, config.front_ends) if several else []
            roles = server_roles(
                worker.process.pid,
                front_ends,
                redis=[redis_server.process.pid],
                gateway=[gateway.process.pid, *descendants(gateway.process.pid)],
            )
            write_results(out, bench_serve_levels(config, gateway.port, "d", roles))
        finally:
            gateway.stop()
            code = worker.stop()
            if code != 0:
                print(f"[d] worker exited with {code}; see {worker.log_path}", flush=True)


if __name__ == "__main__":
    main()
