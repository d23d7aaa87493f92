"""Path (b): streamq, clocked at the subscriber.

A throwaway Redis, one real ``python -m worker`` holding the same engine, and the
producer library in this process: each request is ``client.submit(...)``
(subscribe, enqueue, wake-up) and then its chunk events off pub/sub, so the clock
covers producer → Redis → worker → engine → pub/sub → subscriber. CPU roles: the
worker (``front_end``), its engine core, Redis, and this process (``client``: the subscriber).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

from bench.config import BenchConfig
from bench.cpu import descendants
from bench.path_run import parse_path_args, write_results
from bench.profiling import PySpyRecording
from bench.prompts import Prompt, sample_prompts
from bench.timing import PathResult, measure_levels
from devkit.redis_server import RedisServer
from devkit.worker_process import WorkerProcess, worker_env
from producer.client import StreamqClient
from streamq.protocol import ChunkEvent, ErrorEvent


def one_process_roles(redis_server: RedisServer, worker: WorkerProcess) -> dict[str, list[int]]:
    """The CPU roles of a worker that is one process beside its engine core."""
    assert worker.process is not None and redis_server.process is not None
    return {
        "front_end": [worker.process.pid],
        "engine_core": descendants(worker.process.pid),
        "redis": [redis_server.process.pid],
        "client": [os.getpid()],
    }


async def measure(
    config: BenchConfig,
    redis_server: RedisServer,
    worker: WorkerProcess,
    roles: dict[str, list[int]],
    *,
    path: str = "b",
    with_interval: bool = True,
) -> list[PathResult]:
    """Every token as a chunk (``path``), then, if configured and ``with_interval``, a chunk
    every ``config.stream_interval`` tokens ("b-interval"; its ITL is between chunks)."""
    async with await StreamqClient.connect(redis_server.url) as client:
        interval: dict[str, Any] = {}

        async def stream(prompt: Prompt) -> AsyncIterator[int]:
            handle = await client.submit(
                prompt.text, max_tokens=prompt.output_len, ignore_eos=True, temperature=0, **interval
            )
            async for event in handle:
                if isinstance(event, ChunkEvent):
                    yield len(event.token_ids)
                elif isinstance(event, ErrorEvent):
                    raise RuntimeError(f"request failed: {event.code}: {event.message}")

        def prompts_for(concurrency: int) -> list[Prompt]:
            return sample_prompts(config, config.prompts_for(concurrency))

        with contextlib.ExitStack() as stack:
            if config.profile and path == "b":  # (e)'s parent only watches its front ends
                assert worker.process is not None
                out = Path(config.results_dir) / f"{config.run_id}-b-worker.pyspy.txt"
                stack.enter_context(PySpyRecording(worker.process.pid, out, gil=True))
            results = await measure_levels(path, stream, prompts_for, config.concurrencies, roles)
            if with_interval and config.stream_interval > 1:
                interval["stream_interval"] = config.stream_interval
                results += await measure_levels("b-interval", stream, prompts_for, config.concurrencies, roles)
            return results


Roles = Callable[[RedisServer, WorkerProcess], dict[str, list[int]]]
"""The CPU roles of a running worker's processes (and Redis's, and this process's)."""


def run_path(path: str, description: str, worker_flags: list[str], roles_of: Roles, *, with_interval: bool) -> None:
    """A path's whole run: a throwaway Redis, one ``python -m worker`` with the engine
    flags and ``worker_flags``, ``measure``, the results written where the parent asked."""
    config, out = parse_path_args(description)
    log_path = Path(config.results_dir) / f"{config.run_id}-{path}-worker.log"
    with RedisServer() as redis_server:
        flags = [*config.engine_flags(), *worker_flags]
        worker = WorkerProcess(redis_server.url, flags, log_path=log_path, env=worker_env())
        try:
            worker.start().wait_ready()
            roles = roles_of(redis_server, worker)
            results = asyncio.run(measure(config, redis_server, worker, roles, path=path, with_interval=with_interval))
            write_results(out, results)
        finally:
            code = worker.stop()
            if code != 0:
                print(f"[{path}] worker exited with {code}; see {log_path}", flush=True)


def main() -> None:
    run_path("b", __doc__.splitlines()[0], [], one_process_roles, with_interval=True)


if __name__ == "__main__":
    main()
