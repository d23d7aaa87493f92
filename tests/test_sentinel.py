"""A highly available Redis, reached through Sentinel: ``redis+sentinel://`` URLs.

Real parts: a password-protected Redis, a real Sentinel process monitoring it (the
same server binary in sentinel mode), a real ``python -m worker`` and the producer
library, both given only the Sentinel's address and the master's name. The worker
runs the scripted engine: what is under test is how both sides find Redis.
"""

from __future__ import annotations

import gc
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from devkit.redis_server import RedisServer, free_port, server_binary
from devkit.worker_process import WorkerProcess, worker_env
from producer.client import StreamqClient

MASTER = "streamq-master"


@pytest.fixture
def sentinel_url(tmp_path: Path) -> Iterator[tuple[str, RedisServer]]:
    """``redis+sentinel://`` URL of a Sentinel watching a password-protected Redis."""
    password = uuid.uuid4().hex
    with RedisServer(user="streamq", password=password) as master:
        port = free_port()
        config = tmp_path / "sentinel.conf"
        config.write_text(
            f"port {port}\nbind 127.0.0.1\ndir {tmp_path}\n"
            f"sentinel monitor {MASTER} 127.0.0.1 {master.port} 1\n"
            f"sentinel auth-user {MASTER} streamq\nsentinel auth-pass {MASTER} {password}\n"
        )
        sentinel = subprocess.Popen(
            [server_binary(), str(config), "--sentinel"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        try:
            probe = redis.Redis(port=port)
            deadline = time.monotonic() + 10
            while True:
                try:
                    if probe.sentinel_get_master_addr_by_name(MASTER):
                        break
                except redis.ConnectionError:
                    pass
                assert time.monotonic() < deadline and sentinel.poll() is None, "Sentinel did not come up"
                time.sleep(0.05)
            probe.close()
            yield f"redis+sentinel://streamq:{password}@127.0.0.1:{port}/{MASTER}", master
        finally:
            sentinel.terminate()
            sentinel.wait(timeout=10)


async def test_worker_and_producer_find_redis_through_sentinel(
    sentinel_url: tuple[str, RedisServer], tiny_model: Path, tmp_path: Path
) -> None:
    url, master = sentinel_url
    command = [
        sys.executable,
        "-m",
        "worker",
        "--redis-url",
        url,
        "--metrics-port",
        "0",
        "--engine-factory",
        "bench.synthetic_engine:create",
        "--model",
        str(tiny_model),
    ]
    # WorkerProcess waits for the worker's health check on the master itself.
    worker = WorkerProcess(master.url, [], log_path=tmp_path / "worker.log", command=command, env=worker_env())
    worker.start().wait_ready(timeout_s=120)
    try:
        async with await StreamqClient.connect(url) as client:
            completion = await (await client.submit("Hello", max_tokens=5)).result()
        gc.collect()  # a connection the client failed to close fails this test, not a later one
        assert completion.completion_tokens == 5 and completion.finish_reasons == ["length"]
        assert redis.Redis.from_url(master.url).exists(f"arq:result:{completion.request_id}")
    finally:
        assert worker.stop() == 0, worker.log_tail()
