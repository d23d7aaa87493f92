"""Redis restarted under load: workers and subscribers carry on by themselves.

The server keeps its data on disk (as a production Redis would), stops and starts
again on the same port while requests stream. The worker runs the scripted engine:
what is under test is every Redis connection of both sides, not the model.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest

from devkit.redis_server import RedisServer
from devkit.worker_process import scripted_worker
from producer.client import StreamqClient
from streamq.protocol import ChunkEvent, FinalEvent

TOKENS_PER_S = 100  # the scripted engine's pace per request


@pytest.fixture
def restartable_redis() -> Iterator[RedisServer]:
    with RedisServer(persistent=True) as server:
        yield server


@pytest.mark.parametrize(
    ("down_s", "tokens"),
    [(0.5, 300), (10.0, 1500)],
    ids=["a short restart", "an outage longer than the lease"],
)
async def test_requests_in_flight_survive_a_redis_restart(
    restartable_redis: RedisServer, tmp_path: Path, down_s: float, tokens: int
) -> None:
    """Requests keep streaming (tokens/100 s each) across the restart; while Redis is
    down the worker's leases lapse (3 s) and come back to it, its events wait in the
    publisher, and every request ends exactly, as one attempt."""
    url = restartable_redis.url
    worker = scripted_worker(url, tmp_path / "worker.log", tokens_per_s=TOKENS_PER_S)
    worker.start().wait_ready(timeout_s=120)
    try:
        async with await StreamqClient.connect(url) as client:
            handles = [await client.submit(f"request {i}", max_tokens=tokens) for i in range(8)]

            async def collect(handle_index: int) -> list[ChunkEvent | FinalEvent]:
                return [event async for event in handles[handle_index]]  # type: ignore[misc]

            streams = asyncio.gather(*(collect(i) for i in range(8)))
            await asyncio.sleep(1.0)
            await asyncio.to_thread(restartable_redis.stop)
            await asyncio.sleep(down_s)
            await asyncio.to_thread(restartable_redis.start)
            results = await asyncio.wait_for(streams, timeout=90)

            for events in results:
                assert [e.seq for e in events] == list(range(len(events)))  # no gap, no repeat
                final = events[-1]
                assert isinstance(final, FinalEvent) and final.finish_reasons == ["length"]
                assert sum(len(e.token_ids) for e in events if isinstance(e, ChunkEvent)) == tokens
                assert {e.attempt for e in events} == {1}  # the worker kept its own jobs
            # ...and the worker still takes new work.
            after = await (await client.submit("after the restart", max_tokens=5, ignore_eos=True)).result()
            assert after.completion_tokens == 5
        assert worker.process is not None and worker.process.poll() is None, worker.log_tail()
    finally:
        assert worker.stop() == 0, worker.log_tail()
