"""A cancel outlives its pub/sub message: a running request's cancel is recorded in Redis
(``streamq:cancelled:<id>``) beside the message, so a worker that misses the message still
stops the request: one whose connection was cut finds the record as it comes back (its
lease renewal, its listener's resubscribe), and one that takes the request over from a dead
worker finds it as it claims the job, and ends it ``cancelled`` without generating.

Real worker processes on the scripted engine (100 tokens/s), logging in as the worker's
user; the test's client as the producer's. Worker W reaches Redis through a proxy the test
cuts: in the first test it runs the request, in the second it takes it over.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis.asyncio as aioredis

from devkit import worker_process
from devkit.redis_server import FreezingProxy, RedisServer
from devkit.worker_process import WorkerProcess
from producer.client import RequestHandle, StreamqClient
from streamq.broker.replay_log import ReplayLog
from streamq.protocol import ChunkEvent, Event, FinalEvent, decode_event
from streamq.protocol.names import cancelled_key
from streamq.protocol.roles import PRODUCER, WORKER

LONG = 3000
"""Tokens of a request that runs 30 s unless cancelled."""


@dataclass(frozen=True)
class Setup:
    server: RedisServer
    proxy: FreezingProxy
    w: WorkerProcess
    """The worker behind the proxy."""


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Setup]:
    server = RedisServer(user="streamq", password=uuid.uuid4().hex)
    with server, FreezingProxy(server.port) as proxy:
        url = server.url_for(WORKER).replace(f":{server.port}", f":{proxy.port}")
        w = worker_process.scripted_worker(url, tmp_path_factory.mktemp("w") / "worker.log", ready_url=server.url)
        w.start().wait_ready(timeout_s=120)
        try:
            yield Setup(server, proxy, w)
        finally:
            proxy.heal()
            assert w.stop() == 0, w.log_tail()


@pytest.fixture
async def admin(setup: Setup) -> AsyncIterator[aioredis.Redis]:
    client = aioredis.Redis.from_url(setup.server.url)
    yield client
    await client.aclose()


@pytest.fixture
async def client(setup: Setup) -> AsyncIterator[StreamqClient]:
    async with await StreamqClient.connect(setup.server.url_for(PRODUCER)) as client:
        yield client


class Following:
    """A request's events as its handle delivers them, collected in the background."""

    def __init__(self, handle: RequestHandle) -> None:
        self.handle = handle
        self.events: list[Event] = []
        self.task = asyncio.create_task(self._collect())

    async def _collect(self) -> None:
        async for event in self.handle:
            self.events.append(event)

    async def until_tokens(self, count: int, timeout_s: float = 30) -> None:
        async with asyncio.timeout(timeout_s):
            while sum(len(e.token_ids) for e in self.events if isinstance(e, ChunkEvent)) < count:
                await asyncio.sleep(0.02)

    async def final(self, timeout_s: float) -> FinalEvent:
        await asyncio.wait_for(self.task, timeout_s)
        final = self.events[-1]
        assert isinstance(final, FinalEvent), final
        return final


async def logged(admin: aioredis.Redis, request_id: str) -> list[Event]:
    return [decode_event(raw) for raw in await ReplayLog(admin).read(request_id)]


async def until_gone(admin: aioredis.Redis, key: str, timeout_s: float = 10) -> None:
    async with asyncio.timeout(timeout_s):
        while await admin.exists(key):
            await asyncio.sleep(0.05)


async def test_a_cancel_sent_while_the_worker_is_cut_off_still_stops_the_request(
    setup: Setup, client: StreamqClient, admin: aioredis.Redis
) -> None:
    """W runs the request; its connections are cut (its cancel listener among them), the
    cancel goes out, W is back a second later: the message is gone, but W finds the record
    (its listener resubscribing, its next lease renewal) and ends the request ``cancelled``
    within a few seconds of reaching Redis, where it would run on for 30 s."""
    following = Following(await client.submit("cancel me while cut off", max_tokens=LONG, ignore_eos=True))
    request_id = following.handle.request_id
    await following.until_tokens(20)
    await asyncio.to_thread(setup.proxy.cut)
    try:
        assert await client.cancel(request_id) == "running"  # W's lease is still held: recorded
        assert await admin.exists(cancelled_key(request_id))
        await asyncio.sleep(1)
    finally:
        setup.proxy.heal()
    healed = time.monotonic()
    final = await following.final(timeout_s=20)
    took = time.monotonic() - healed
    assert final.finish_reasons == ["cancelled"], setup.w.log_tail()
    assert final.completion_tokens < LONG
    assert took < 8, f"the request ended {took:.1f}s after the worker was back"
    assert f"request {request_id}: cancel found recorded" in setup.w.log_tail(400)
    await until_gone(admin, cancelled_key(request_id))  # deleted with the job


@contextlib.contextmanager
def stopped_for_good(worker: WorkerProcess) -> Iterator[None]:
    """SIGSTOP the worker (and its engine) now; SIGKILL it when the block is left."""
    assert worker.process is not None
    os.killpg(worker.process.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        worker.kill()


async def test_a_take_over_finds_a_cancel_recorded_before_it(
    setup: Setup, client: StreamqClient, admin: aioredis.Redis, tmp_path: Path
) -> None:
    """Worker A runs the request while W is cut off (so that W neither claims it nor hears
    its cancel). A freezes; the cancel finds A's lease still held, so it is answered
    ``running`` and recorded; A dies. W, back, takes the request over once A's lease lapses,
    finds the record in its claim, and ends it ``cancelled`` as attempt 2 with the tokens A
    logged, without generating."""
    a = worker_process.scripted_worker(setup.server.url_for(WORKER), tmp_path / "a.log", ready_url=setup.server.url)
    a.start().wait_ready(timeout_s=120)
    try:
        await asyncio.to_thread(setup.proxy.cut)
        try:
            following = Following(await client.submit("cancel me, then die", max_tokens=LONG, ignore_eos=True))
            request_id = following.handle.request_id
            await following.until_tokens(20)
            with stopped_for_good(a):
                assert await client.cancel(request_id) == "running"
            assert await admin.exists(cancelled_key(request_id))
        finally:
            setup.proxy.heal()
        final = await following.final(timeout_s=30)
    finally:
        a.kill()
    assert final.finish_reasons == ["cancelled"], setup.w.log_tail()
    assert final.attempt == 2
    events = await logged(admin, request_id)
    assert events[-1] == final and {e.attempt for e in events[:-1]} == {1}  # nothing generated by attempt 2
    assert [e.seq for e in events] == list(range(len(events)))
    assert final.completion_tokens == sum(len(e.token_ids) for e in events if isinstance(e, ChunkEvent)) > 0
    log = setup.w.log_tail(400)
    assert f"request {request_id}: attempt 2 takes over" in log
    assert f"request {request_id} started (attempt 2)" not in log  # the engine never saw it
    await until_gone(admin, cancelled_key(request_id))
