"""A worker that stops (SIGTERM) stops attracting the requests that share its prefixes at
once, while it drains: they go to another worker (held for it as the least busy one, or
queued for all), never held for the stopping one. Two real
worker processes on the scripted engine (this is about the queue, not the model) on a
queue of their own; the real engine's cases are in tests/real_engine/test_pickup_order.py."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis.asyncio as aioredis

from devkit.worker_process import WorkerProcess, scripted_worker
from producer.client import StreamqClient
from streamq.protocol import ChunkEvent
from streamq.protocol.names import affinity_free_key
from tests.support.worker_faults import pid_of


@pytest.fixture
def two_workers(worker_url: str, tmp_path: Path) -> Iterator[list[WorkerProcess]]:
    queue = f"streamq:queue:affinity-stop-{uuid.uuid4().hex[:8]}"
    workers = [
        scripted_worker(worker_url, tmp_path / f"worker-{i}.log", tokens_per_s=100, queue=queue).start()
        for i in range(2)
    ]
    for worker in workers:
        worker.wait_ready()
    yield workers
    for worker in workers:
        worker.kill()


async def test_a_stopping_worker_gets_no_more_requests_held_for_it(
    two_workers: list[WorkerProcess], producer_url: str, raw_redis: aioredis.Redis
) -> None:
    queue = two_workers[0].queue
    key = f"conversation-{uuid.uuid4().hex[:8]}"
    async with await StreamqClient.connect(producer_url, queue=queue) as client:
        first = await client.generate("Hello", affinity_key=key, max_tokens=4)
        first_pid = pid_of(first.worker_id)
        (affinity_worker,) = [w for w in two_workers if w.process is not None and w.process.pid == first_pid]
        (other,) = [w for w in two_workers if w is not affinity_worker]
        draining = await client.submit("Keep going", affinity_key=key, max_tokens=200, ignore_eos=True)
        assert isinstance(await anext(aiter(draining)), ChunkEvent)  # it runs on its affinity worker
        assert affinity_worker.process is not None
        affinity_worker.process.terminate()  # SIGTERM: it drains its running request
        async with asyncio.timeout(10):
            while await raw_redis.exists(affinity_free_key(queue, str(first.worker_id))):
                await asyncio.sleep(0.01)
        follow_up = await client.submit("Again", affinity_key=key, max_tokens=4)
        held = await raw_redis.hget(f"{queue}:held", follow_up.request_id)
        assert held is None or held.decode() != first.worker_id, "held for the stopping worker"
        assert other.process is not None and pid_of((await follow_up.result()).worker_id) == other.process.pid
        assert affinity_worker.process.poll() is None, "the follow-up waited for the drain to end"
        completion = await draining.result()
        assert completion.completion_tokens == 200 and pid_of(completion.worker_id) == affinity_worker.process.pid
    assert affinity_worker.process.wait(timeout=30) == 0
