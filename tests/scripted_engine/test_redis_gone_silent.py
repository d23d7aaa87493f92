"""Connections to a Redis that stops answering: nobody waits forever.

A paused Redis (SIGSTOP: it keeps its sockets and accepts connections, but answers
nothing) and a connection that goes silent without closing (``FreezingProxy``: what a
vanished host or NAT entry leaves behind) are noticed within the bounds configured in
``streamq.broker.connection`` (reply timeout, ping interval, retry budget): a pub/sub reader
errors or reconnects, and a request followed through such a connection completes
exactly. Workers run the scripted engine: what is under test is the connections.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from devkit import worker_process
from devkit.redis_server import FreezingProxy, RedisServer
from devkit.worker_process import WorkerProcess
from producer.client import StreamqClient
from producer.subscriber import EventSubscriber
from streamq.broker.connection import RetryFor, StreamqRedisSettings, close_pool, create_pool, redis_settings_for
from streamq.protocol import ChunkEvent, Event, FinalEvent, deserialize_job, events_channel, serialize_job

PING_AFTER_S = 1.0
REPLY_WITHIN_S = 2.0
RETRY_FOR_S = 3.0
RECONNECT_FOR_S = 3.0
DETECTED_WITHIN_S = PING_AFTER_S + REPLY_WITHIN_S + PING_AFTER_S  # + one wait step
"""A silent connection is declared dead within this (``live_messages``)."""


def short_bounds(url: str) -> StreamqRedisSettings:
    """``url``'s settings with bounds short enough for a test (the defaults: 5 s, 10 s, 20 s)."""
    settings = redis_settings_for(url)
    settings.health_check_interval = PING_AFTER_S
    settings.socket_timeout = REPLY_WITHIN_S
    settings.retry = RetryFor(RETRY_FOR_S)
    return settings


@pytest.fixture
def own_redis() -> Iterator[RedisServer]:
    """A Redis of this test's own: it gets paused."""
    with RedisServer() as server:
        yield server


async def test_a_pubsub_reader_of_a_paused_redis_errors_within_its_bound(own_redis: RedisServer) -> None:
    redis = await create_pool(short_bounds(own_redis.url))
    subscriber = EventSubscriber(redis, reconnect_for_s=RECONNECT_FOR_S)
    try:
        waiting = await subscriber.subscribe(events_channel("outage"))
        own_redis.pause()
        started = time.monotonic()
        try:
            delivery = await asyncio.wait_for(waiting.get(), timeout=60)
            waited = time.monotonic() - started
        finally:
            own_redis.resume()
        # Declared dead, reconnection tried for RECONNECT_FOR_S (each try within the retry
        # budget plus one reply timeout), then the follower is told.
        bound = DETECTED_WITHIN_S + RECONNECT_FOR_S + RETRY_FOR_S + REPLY_WITHIN_S + 1.0
        assert isinstance(delivery, RedisConnectionError | RedisTimeoutError), delivery
        assert waited < bound, f"the reader heard of the dead connection after {waited:.1f}s (bound {bound:.1f}s)"
        # Redis answers again: the same subscriber serves new followers.
        again = await subscriber.subscribe(events_channel("after"))
        await redis.publish(events_channel("after"), b"hello")
        assert await asyncio.wait_for(again.get(), timeout=10) == b"hello"
    finally:
        await subscriber.close()
        await close_pool(redis)


@pytest.fixture
async def scripted_worker(own_redis: RedisServer, tmp_path: Path) -> AsyncIterator[WorkerProcess]:
    """A worker on the scripted engine at 100 tokens/s, connected to Redis directly."""
    worker = worker_process.scripted_worker(own_redis.url, tmp_path / "worker.log")
    worker.start().wait_ready(timeout_s=120)
    try:
        yield worker
    finally:
        assert worker.stop() == 0, worker.log_tail()


def assert_exact(events: list[Event], tokens: int) -> None:
    """Every token once, in order, numbered without a gap, one final event at the end."""
    assert [e.seq for e in events] == list(range(len(events)))
    assert isinstance(events[-1], FinalEvent) and events[-1].finish_reasons == ["length"]
    assert not any(isinstance(e, FinalEvent) for e in events[:-1])
    assert sum(len(e.token_ids) for e in events if isinstance(e, ChunkEvent)) == tokens


async def test_a_request_followed_through_a_connection_gone_silent_completes_exactly(
    own_redis: RedisServer, scripted_worker: WorkerProcess
) -> None:
    with FreezingProxy(own_redis.port) as proxy:
        redis = await create_pool(
            short_bounds(proxy.url(own_redis)), job_serializer=serialize_job, job_deserializer=deserialize_job
        )
        async with StreamqClient(redis) as client:
            handle = await client.submit("through a proxy", max_tokens=300)  # three seconds of tokens
            events: list[Event] = []

            async def collect() -> None:
                async for event in handle:
                    events.append(event)

            following = asyncio.create_task(collect())
            while len(events) < 20:
                await asyncio.sleep(0.05)
            await asyncio.to_thread(proxy.freeze)  # every connection of the client: its pub/sub and its pool
            frozen_at = time.monotonic()
            await asyncio.wait_for(following, timeout=60)
            took = time.monotonic() - frozen_at
        assert_exact(events, 300)
        # Noticed, reconnected, and the log re-read (through a fresh pooled connection:
        # the frozen one first times out, within the retry budget).
        bound = DETECTED_WITHIN_S + RETRY_FOR_S + 2 * REPLY_WITHIN_S + 3.0
        assert took < bound, f"the request completed {took:.1f}s after the freeze (bound {bound:.1f}s)"


async def test_a_worker_whose_connections_went_silent_still_hears_cancels(
    own_redis: RedisServer, tmp_path: Path
) -> None:
    with FreezingProxy(own_redis.port) as proxy:
        url = proxy.url(own_redis)
        worker = worker_process.scripted_worker(url, tmp_path / "worker.log", ready_url=own_redis.url)
        worker.start().wait_ready(timeout_s=120)
        try:
            await asyncio.to_thread(proxy.freeze)  # the cancel listener, the wake-up listener, the pool
            # The worker's defaults: silence noticed within 5 s + 10 s (+ a wait step), a
            # command's reply within 10 s; give it that, then use it.
            await asyncio.sleep(5 + 10 + 5)
            events: list[Event] = []

            async def submit_and_cancel() -> None:
                async with await StreamqClient.connect(own_redis.url) as client:
                    handle = await client.submit("cancel me", max_tokens=3000)  # 30 s of tokens
                    async for event in handle:
                        events.append(event)
                        if len(events) == 5:
                            await handle.cancel()

            await asyncio.wait_for(submit_and_cancel(), timeout=60)
            final = events[-1]
            assert isinstance(final, FinalEvent) and final.finish_reasons == ["cancelled"], worker.log_tail()
        finally:
            assert worker.stop() == 0, worker.log_tail()
