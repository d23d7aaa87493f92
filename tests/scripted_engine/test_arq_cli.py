"""``arq worker.WorkerSettings`` (arq's own command line) runs a working worker.

On the scripted engine: what is tested is arq's loop around the worker's hooks; the engine
flags that command line reads from ``$STREAMQ_ENGINE_ARGS`` resolve as the command line's
do (tests/no_engine/test_worker_engine_config.py)."""

from __future__ import annotations

import sys
from pathlib import Path

from devkit.worker_process import SCRIPTED_ENGINE, WorkerProcess, worker_env
from producer.client import StreamqClient


async def test_arq_command_line_serves_jobs(worker_url: str, producer_url: str, tmp_path: Path) -> None:
    """arq's own worker (its poll, WATCH/MULTI claims, start-up INFO) as the worker role."""
    queue = "streamq:queue:arq-cli-test"
    env = worker_env(
        REDIS_URL=worker_url,
        STREAMQ_QUEUE=queue,
        STREAMQ_ENGINE_FACTORY=SCRIPTED_ENGINE,  # streamq.env_vars.ENGINE_FACTORY_ENV
    )
    arq = str(Path(sys.executable).with_name("arq"))
    process = WorkerProcess(
        worker_url, [], queue=queue, log_path=tmp_path / "arq.log", command=[arq, "worker.WorkerSettings"], env=env
    )
    process.start().wait_ready()
    try:
        async with await StreamqClient.connect(producer_url, queue=queue) as client:
            completion = await (await client.submit("Hello", max_tokens=5, ignore_eos=True)).result()
        assert completion.completion_tokens == 5
    finally:
        assert process.stop() == 0, process.log_tail()
