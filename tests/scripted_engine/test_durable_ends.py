"""Durable ends in a real ``python -m worker`` (the scripted engine) and the producer library,
each as its own ACL user, on a primary with a replica: the worker says at start-up what an
end waits for and writes it to ``streamq:durability``; a request's end reaches its client
only once the replica has it; a producer's end of a request it takes off its queue waits as
the record says. (The failover with a stalled link is a test of its own.)"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
import redis

from devkit.redis_server import RedisServer
from devkit.worker_process import scripted_worker
from producer.client import StreamqClient
from streamq.protocol import events_channel
from streamq.protocol.names import DURABILITY_KEY
from streamq.protocol.roles import PRODUCER, WORKER


@pytest.fixture
def replicated() -> Iterator[tuple[RedisServer, RedisServer]]:
    password = uuid.uuid4().hex
    with RedisServer(user="streamq", password=password) as primary:
        admin = redis.Redis.from_url(primary.url)
        admin.config_set("repl-diskless-sync-delay", 0)  # the replica syncs at once
        with RedisServer(user="streamq", password=password, replica_of=primary) as replica:
            deadline = time.monotonic() + 20
            while admin.info("replication").get("slave0", {}).get("state") != "online":
                assert time.monotonic() < deadline, "the replica did not come online"
                time.sleep(0.05)
            admin.close()
            yield primary, replica


def wait_calls(admin: redis.Redis) -> int:
    return int(admin.info("commandstats").get("cmdstat_wait", {}).get("calls", 0))


async def test_an_end_is_told_once_the_replica_has_it(
    replicated: tuple[RedisServer, RedisServer], tmp_path: Path
) -> None:
    primary, replica = replicated
    log_path = tmp_path / "worker.log"
    worker = scripted_worker(primary.url_for(WORKER), log_path, "--durable-ends-timeout-s", "2", ready_url=primary.url)
    worker.start().wait_ready(timeout_s=120)
    admin = redis.Redis.from_url(primary.url)
    at_replica = redis.Redis.from_url(replica.url)
    try:
        assert "durable ends (auto): each end waits for 1 replica (WAIT), at most 2s" in log_path.read_text()
        record = msgspec.json.decode(admin.get(DURABILITY_KEY))
        assert record["data"] == record["control"] == {"replicas": 1, "fsync": False}
        before = wait_calls(admin)
        async with await StreamqClient.connect(primary.url_for(PRODUCER), queue=worker.queue) as client:
            completion = await (await client.submit("hello", max_tokens=5)).result()
            assert completion.completion_tokens == 5
            # the client has the final: the replica had it first
            logged = at_replica.xrange(events_channel(completion.request_id))
            assert b'"type":"final"' in logged[-1][1][b"event"]
            assert wait_calls(admin) > before
        # a producer ends a request it takes off a queue nobody serves: it waits as the record says
        parked = f"streamq:queue:parked-{uuid.uuid4().hex[:8]}"
        async with await StreamqClient.connect(primary.url_for(PRODUCER), queue=parked) as client:
            handle = await client.submit("never run")
            before = wait_calls(admin)
            assert await client.cancel(handle.request_id, queue=parked) == "queued"
            assert wait_calls(admin) > before
            assert b'"cancelled"' in at_replica.xrange(events_channel(handle.request_id))[-1][1][b"event"]
            await handle.close()
    finally:
        admin.close()
        at_replica.close()
        assert worker.stop() == 0, worker.log_tail()
