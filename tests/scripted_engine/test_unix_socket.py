"""``unix://`` end to end: a worker and a client on the host of their Redis reach it over its
Unix socket (cheaper per token than loopback TCP, both for Redis and for the sender:
docs/performance.md), and none of their connections goes over TCP. The worker runs the
scripted engine: what is under test is the connections, not the model."""

from __future__ import annotations

from pathlib import Path

import redis

from devkit.redis_server import RedisServer
from devkit.worker_process import scripted_worker
from producer.client import StreamqClient
from streamq.protocol import ChunkEvent, FinalEvent


async def test_a_request_streams_whole_with_every_connection_on_the_unix_socket(tmp_path: Path) -> None:
    with RedisServer(unix_socket=True) as server:
        worker = scripted_worker(server.unix_url, tmp_path / "worker.log", tokens_per_s=200)
        worker.start().wait_ready(timeout_s=120)
        try:
            async with await StreamqClient.connect(server.unix_url) as client:
                handle = await client.submit("over the socket", max_tokens=12, ignore_eos=True)
                events = [event async for event in handle]
                with redis.Redis(port=server.port) as inspector:  # this test's own, the one TCP client
                    listed = inspector.client_list()
        finally:
            assert worker.stop() == 0, worker.log_tail()
    assert [event.seq for event in events] == list(range(len(events)))
    assert isinstance(events[-1], FinalEvent) and events[-1].finish_reasons == ["length"]
    assert sum(len(event.token_ids) for event in events if isinstance(event, ChunkEvent)) == 12
    on_tcp = [entry["addr"] for entry in listed if not entry["addr"].startswith("/")]
    assert len(on_tcp) == 1, on_tcp  # the inspector alone
    assert len(listed) > 3  # the worker's connections and the client's, on the socket
