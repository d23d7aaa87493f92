"""The producer library as a newcomer meets it: ``connect()`` from the environment,
``generate``, ``result(timeout=)`` and ``async with`` a handle. Real Redis, as the
producer role; the test plays the worker by writing a request's events to its log, as
a worker does."""

from __future__ import annotations

import asyncio
import socket
import time
import uuid
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis

from producer import Completion, FinalEvent, StreamqClient, StreamqError
from streamq.broker.replay_log import LogEvent, ReplayLog
from streamq.protocol import ChunkEvent, FinishReason, encode_event, events_channel
from streamq.protocol.names import QUEUE_ENV, REDIS_URL_ENV


def unused_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@pytest.fixture
def queue() -> str:
    """A queue nobody serves: its requests stay queued unless the test plays the worker."""
    return f"streamq:queue:client-api-{uuid.uuid4().hex[:8]}"


@pytest.fixture
async def client(producer_url: str, queue: str) -> AsyncIterator[StreamqClient]:
    async with await StreamqClient.connect(producer_url, queue=queue) as client:
        yield client


async def play_worker(redis: aioredis.Redis, request_id: str, *texts: str, final: bool = True) -> None:
    """Log (and publish) chunks of ``texts``, then a final event: what a worker writes."""
    log = ReplayLog(redis)
    seq = len(await redis.xrange(events_channel(request_id)))
    events: list[LogEvent] = []
    for text in texts:
        chunk = ChunkEvent(request_id=request_id, seq=seq, attempt=1, text=text, token_ids=[seq])
        events.append(LogEvent(request_id, seq, 1, encode_event(chunk)))
        seq += 1
    if final:
        end = FinalEvent(
            request_id=request_id, seq=seq, attempt=1, finish_reasons=["stop"], prompt_tokens=2, completion_tokens=seq
        )
        events.append(LogEvent(request_id, seq, 1, encode_event(end), terminal=True))
    await log.append(events)


async def was_cancelled(client: StreamqClient, request_id: str) -> bool:
    """Taken off the queue, its stream ended with finish reason ``cancelled``."""
    last = await client.last_event(request_id)
    cancelled = isinstance(last, FinalEvent) and last.finish_reasons == [FinishReason.CANCELLED]
    return cancelled and await client.job_state(request_id) == "unknown"


async def test_connect_without_arguments_reads_the_redis_url_and_queue_from_the_environment(
    producer_url: str, queue: str, raw_redis: aioredis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(REDIS_URL_ENV, producer_url)
    monkeypatch.setenv(QUEUE_ENV, queue)
    async with await StreamqClient.connect() as client:
        assert client.queue == queue
        async with await client.submit("Hello", cancel_on_close=True):
            assert await raw_redis.zcard(queue) == 1


async def test_connect_arguments_win_over_the_environment(
    producer_url: str, queue: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(REDIS_URL_ENV, f"redis://127.0.0.1:{unused_port()}")  # nothing there
    monkeypatch.setenv(QUEUE_ENV, "streamq:queue:from-the-environment")
    async with await StreamqClient.connect(producer_url, queue=queue) as client:
        assert client.queue == queue
        assert await client.queue_depth() == 0


async def test_generate_submits_and_returns_the_whole_output(
    client: StreamqClient, raw_redis: aioredis.Redis, request_id: str
) -> None:
    async def when_queued() -> None:
        while not await raw_redis.zcard(client.queue):
            await asyncio.sleep(0.01)
        await play_worker(raw_redis, request_id, "Hello", ", world")

    serving = asyncio.create_task(when_queued())
    completion = await client.generate("Hi", request_id=request_id, max_tokens=8, timeout=10)
    await serving
    assert isinstance(completion, Completion)
    assert (completion.request_id, completion.text, completion.finish_reasons) == (request_id, "Hello, world", ["stop"])
    assert (completion.prompt_tokens, completion.completion_tokens, completion.token_ids) == (2, 2, [[0, 1]])
    assert await client.job_state(request_id) == "queued"  # it had ended: leaving generate cancelled nothing
    await client.cancel(request_id)


async def test_generate_past_its_timeout_raises_timeout_error_and_cancels_the_request(
    client: StreamqClient, request_id: str
) -> None:
    """Nobody holds the handle of a request ``generate`` stopped waiting for: it is cancelled."""
    started = time.monotonic()
    with pytest.raises(TimeoutError):
        await client.generate("Hello", request_id=request_id, timeout=0.3)
    assert 0.3 <= time.monotonic() - started < 5
    assert await was_cancelled(client, request_id)


async def test_result_past_its_timeout_raises_timeout_error_and_the_request_keeps_running(
    client: StreamqClient, raw_redis: aioredis.Redis, request_id: str
) -> None:
    """Even with ``cancel_on_close``: a timeout closes nothing. A later ``result()`` waits
    on, keeping what the first one gathered."""
    handle = await client.submit("Hello", request_id=request_id, cancel_on_close=True)
    await play_worker(raw_redis, request_id, "Hel", final=False)
    with pytest.raises(TimeoutError):
        await handle.result(timeout=0.3)
    assert await client.job_state(request_id) == "queued" and not handle.done
    await play_worker(raw_redis, request_id, "lo")
    completion = await handle.result(timeout=10)
    assert completion.text == "Hello" and handle.done
    await client.cancel(request_id)


async def test_leaving_async_with_closes_the_handle_and_the_request_keeps_running(
    client: StreamqClient, raw_redis: aioredis.Redis, request_id: str
) -> None:
    channel = events_channel(request_id)
    async with await client.submit("Hello", request_id=request_id) as handle:
        assert await raw_redis.pubsub_numsub(channel) == [(channel.encode(), 1)]
    async with asyncio.timeout(5):  # unsubscribed
        while await raw_redis.pubsub_numsub(channel) != [(channel.encode(), 0)]:
            await asyncio.sleep(0.01)
    with pytest.raises(StreamqError, match="closed"):
        await handle.result(timeout=1)
    assert await client.job_state(request_id) == "queued"
    await client.cancel(request_id)


async def test_leaving_async_with_cancels_an_unfinished_request_with_cancel_on_close(
    client: StreamqClient, request_id: str
) -> None:
    async with await client.submit("Hello", request_id=request_id, cancel_on_close=True):
        pass
    assert await was_cancelled(client, request_id)
