"""The producer library as a newcomer meets it: ``connect()`` from the environment.
Real Redis, as the producer role."""

from __future__ import annotations

import socket
import uuid

import pytest
import redis.asyncio as aioredis

from producer import StreamqClient
from streamq.protocol.names import QUEUE_ENV, REDIS_URL_ENV


def unused_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@pytest.fixture
def queue() -> str:
    """A queue nobody serves: its requests stay queued."""
    return f"streamq:queue:client-api-{uuid.uuid4().hex[:8]}"


async def test_connect_without_arguments_reads_the_redis_url_and_queue_from_the_environment(
    producer_url: str, queue: str, raw_redis: aioredis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(REDIS_URL_ENV, producer_url)
    monkeypatch.setenv(QUEUE_ENV, queue)
    async with await StreamqClient.connect() as client:
        assert client.queue == queue
        handle = await client.submit("Hello")
        assert await raw_redis.zcard(queue) == 1
        assert await handle.cancel() == "queued"
        await handle.close()


async def test_connect_arguments_win_over_the_environment(
    producer_url: str, queue: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(REDIS_URL_ENV, f"redis://127.0.0.1:{unused_port()}")  # nothing there
    monkeypatch.setenv(QUEUE_ENV, "streamq:queue:from-the-environment")
    async with await StreamqClient.connect(producer_url, queue=queue) as client:
        assert client.queue == queue
        assert await client.queue_depth() == 0
