"""A highly available Redis, reached through Sentinel: ``redis+sentinel://`` URLs.

Real parts: a password-protected Redis, real Sentinel processes monitoring it (the
same server binary in sentinel mode), a replica, a real ``python -m worker`` and the
producer library, both given only the Sentinels' addresses and the master's name. The
worker runs the scripted engine: what is under test is how both sides find Redis, and
follow it when the master dies and a replica takes its place.
"""

from __future__ import annotations

import asyncio
import gc
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from devkit.redis_server import RedisServer, SentinelServer, free_port, server_binary
from devkit.worker_process import scripted_worker
from producer.client import RequestHandle, StreamqClient
from streamq.protocol import RESULT_KEY_PREFIX, ChunkEvent, Event, FinalEvent
from tests.support.sentinels import MASTER, replicated_redis_with_sentinels


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
    # Its health check is awaited on the master itself.
    worker = scripted_worker(url, tmp_path / "worker.log", "--model", str(tiny_model), ready_url=master.url)
    worker.start().wait_ready(timeout_s=120)
    try:
        async with await StreamqClient.connect(url) as client:
            completion = await (await client.submit("Hello", max_tokens=5, ignore_eos=True)).result()
        gc.collect()  # a connection the client failed to close fails this test, not a later one
        assert completion.completion_tokens == 5 and completion.finish_reasons == ["length"]
        master_client = redis.Redis.from_url(master.url)
        deadline = time.monotonic() + 10  # arq's result is stored as the job is acknowledged, after its end
        while not master_client.exists(RESULT_KEY_PREFIX + completion.request_id):
            assert time.monotonic() < deadline, "the job's result never reached the master"
            time.sleep(0.02)
        master_client.close()
    finally:
        assert worker.stop() == 0, worker.log_tail()


@pytest.fixture
def replicated_redis() -> Iterator[tuple[str, RedisServer, RedisServer, list[SentinelServer]]]:
    """A password-protected master, one replica and three Sentinels (quorum 2) that fail
    over one second after the master stops answering; the ``redis+sentinel://`` URL."""
    with replicated_redis_with_sentinels() as servers:
        yield servers


TOKENS = 600  # at 100 tokens/s per request: six seconds of streaming each


async def test_requests_in_flight_complete_exactly_across_a_sentinel_failover(
    replicated_redis: tuple[str, RedisServer, RedisServer, list[SentinelServer]], tmp_path: Path
) -> None:
    url, master, replica, sentinels = replicated_redis
    worker = scripted_worker(url, tmp_path / "worker.log", ready_url=master.url)
    worker.start().wait_ready(timeout_s=120)
    try:
        async with await StreamqClient.connect(url) as client:
            handles = [await client.submit(f"request {i}", max_tokens=TOKENS) for i in range(4)]

            async def collect(handle: RequestHandle) -> list[Event]:
                return [event async for event in handle]

            streams = asyncio.gather(*(collect(h) for h in handles))
            await asyncio.sleep(1.5)
            master.kill()  # SIGKILL mid-stream
            killed_at = time.monotonic()
            results = await asyncio.wait_for(streams, timeout=90)
            recovered_in = time.monotonic() - killed_at

            assert all(s.master_port() == replica.port for s in sentinels), "the replica was not promoted"
            for events in results:
                assert [e.seq for e in events] == list(range(len(events))), worker.log_tail()  # no gap, no repeat
                assert isinstance(events[-1], FinalEvent) and events[-1].finish_reasons == ["length"]
                assert not any(isinstance(e, FinalEvent) for e in events[:-1])
                assert sum(len(e.token_ids) for e in events if isinstance(e, ChunkEvent)) == TOKENS
            # ...and the worker takes new work from the new master.
            after = await (await client.submit("after the failover", max_tokens=5)).result()
            assert after.completion_tokens == 5
        # The ends after the failover waited for the new master's replicas (none), not the old
        # one's: none waited out its bound for a replica that is not there.
        assert "was told before it was durable" not in worker.log_path.read_text(), worker.log_tail()
        print(f"failover: requests complete {recovered_in:.1f}s after the master was killed")
        assert worker.process is not None and worker.process.poll() is None, worker.log_tail()
    finally:
        assert worker.stop() == 0, worker.log_tail()
