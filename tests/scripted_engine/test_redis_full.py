"""A Redis full at its ``maxmemory`` (``noeviction``: it answers writes with ``OOM``) under a
running worker: the worker lives, says so, and claims again once memory is freed.

A real Redis whose limit is set just above what it holds, then filled by the harness; a
real worker on the scripted engine (what is under test is the worker's loop and its Redis
calls, not the model); the library's client as a user runs it.
"""

from __future__ import annotations

import asyncio
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import redis.asyncio as aioredis
from redis.exceptions import OutOfMemoryError

from devkit.redis_server import RedisServer, free_port
from devkit.worker_process import WorkerProcess, scripted_worker
from producer.client import StreamqClient
from streamq.protocol import ChunkEvent, FinalEvent
from tests.support.metrics import scrape, value

TOKENS_PER_S = 100
REFUSED_LINE = "Redis refuses the worker's writes"


@pytest.fixture
def redis_server() -> Iterator[RedisServer]:
    with RedisServer() as server:
        yield server


@pytest.fixture
async def admin(redis_server: RedisServer) -> AsyncIterator[aioredis.Redis]:
    client = aioredis.Redis.from_url(redis_server.url)
    yield client
    await client.aclose()


async def fill(admin: aioredis.Redis) -> None:
    """Make Redis full: ``noeviction`` and a limit below what it holds, a Redis that filled
    up as far as every write goes (one nearly full refuses only the writes that would take
    it past its limit; small ones pass)."""
    await admin.config_set("maxmemory-policy", "noeviction")
    used = int((await admin.info("memory"))["used_memory"])
    await admin.config_set("maxmemory", used // 2)
    with pytest.raises(OutOfMemoryError):
        await admin.set("test:refused", b"x")


async def free(admin: aioredis.Redis) -> None:
    await admin.config_set("maxmemory", 0)


def ready(worker: WorkerProcess) -> tuple[int, str]:
    """What the worker's ``/ready`` answers: status and body."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{worker.metrics_port}/ready", timeout=5) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


async def until_ready_is(worker: WorkerProcess, status: int, timeout_s: float = 30) -> str:
    async with asyncio.timeout(timeout_s):
        while (answer := await asyncio.to_thread(ready, worker))[0] != status:
            assert worker.process is not None and worker.process.poll() is None, worker.log_tail()
            await asyncio.sleep(0.1)
    return answer[1]


async def test_a_worker_lives_through_a_full_redis_and_its_stream_ends_once_with_every_token(
    redis_server: RedisServer, admin: aioredis.Redis, tmp_path: Path
) -> None:
    """A request streams (300 tokens at 100/s) when Redis fills up: the worker stays up, stops
    claiming, says so once (log, ``streamq_redis_refusing_writes``, ``/ready`` 503 with
    Redis's reply) for as long as writes are refused; memory freed, the stream goes on and
    ends once with every token, and the worker takes new requests."""
    worker = scripted_worker(
        redis_server.url, tmp_path / "worker.log", tokens_per_s=TOKENS_PER_S, metrics_port=free_port()
    )
    worker.start().wait_ready(timeout_s=120)
    try:
        async with await StreamqClient.connect(redis_server.url) as client:
            handle = await client.submit("fill me up", max_tokens=300, ignore_eos=True)
            events: list[ChunkEvent | FinalEvent] = []
            async with asyncio.timeout(60):
                async for event in handle:
                    events.append(event)  # type: ignore[arg-type]
                    if len(events) == 3:
                        break
            await fill(admin)
            reason = await until_ready_is(worker, 503)
            assert "Redis refuses writes" in reason and "OOM" in reason, reason
            assert value(await asyncio.to_thread(scrape, worker), "streamq_redis_refusing_writes") == 1
            await asyncio.sleep(3)  # dozens of refused claims, a refused flush and lease renewal or two
            assert worker.process is not None and worker.process.poll() is None, worker.log_tail()
            await free(admin)

            async with asyncio.timeout(90):
                events += [event async for event in handle]  # type: ignore[misc]
            assert [event.seq for event in events] == list(range(len(events))), "a gap or a repeat"
            assert sum(len(e.token_ids) for e in events if isinstance(e, ChunkEvent)) == 300
            final = events[-1]
            assert isinstance(final, FinalEvent) and final.finish_reasons == ["length"]
            assert [type(e) for e in events].count(FinalEvent) == 1
            assert {e.attempt for e in events} == {1}, "the worker kept its request"

            await until_ready_is(worker, 200)
            assert value(await asyncio.to_thread(scrape, worker), "streamq_redis_refusing_writes") == 0
            after = await (await client.submit("after the refusal", max_tokens=5, ignore_eos=True)).result()
            assert after.completion_tokens == 5
        log = worker.log_path.read_text()
        assert log.count(REFUSED_LINE) == 1, worker.log_tail(60)
        assert "Redis takes the worker's writes again" in log
    finally:
        assert worker.stop() == 0, worker.log_tail()
