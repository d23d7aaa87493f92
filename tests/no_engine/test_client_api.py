"""The producer library as a newcomer meets it: ``connect()`` from the environment,
``generate``, ``result(timeout=)``, ``async with`` a handle, typed sampling options and
one error hierarchy. Real Redis, as the producer role; the test plays the worker by
writing a request's events to its log, as a worker does."""

from __future__ import annotations

import asyncio
import socket
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any, get_type_hints

import msgspec
import pytest
import redis.asyncio as aioredis
from arq.connections import ArqRedis
from redis.exceptions import ConnectionError as RedisConnectionError

import producer
from producer import (
    Completion,
    ConnectionFailed,
    DuplicateRequest,
    InvalidParameter,
    InvalidRequest,
    QueueFull,
    RedisUnavailable,
    RequestError,
    RequestTimeout,
    SamplingOptions,
    StreamqClient,
    StreamqError,
    UnknownModel,
    Usage,
)
from streamq.broker.replay_log import ReplayLog
from streamq.env_vars import QUEUE_ENV, REDIS_URL_ENV
from streamq.protocol import ChunkEvent, ErrorEvent, FinishReason, Sampling, events_channel
from tests.support.play_worker import play_worker

CLIENT_ERRORS = (
    "StreamqError",
    "ConnectionFailed",
    "RedisUnavailable",
    "RequestTimeout",
    "InvalidRequest",
    "InvalidParameter",
    "RequestError",
    "RequestLost",
    "MissingEvents",
    "DuplicateRequest",
    "QueueFull",
    "UnknownModel",
    "NoLiveWorker",
)


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


async def was_cancelled(client: StreamqClient, request_id: str) -> bool:
    """Taken off the queue, its stream ended with finish reason ``cancelled``."""
    status = await client.status(request_id)
    return status.state == "finished" and status.finish_reasons == [FinishReason.CANCELLED]


async def still_queued(raw_redis: aioredis.Redis, queue: str, request_id: str) -> bool:
    """Its job waits on ``queue`` (the test plays the worker, which never takes it)."""
    return await raw_redis.zscore(queue, request_id) is not None


def test_request_options_are_the_requests_fields_and_the_clients_own_pickup_and_deferral() -> None:
    """What ``submit`` and ``generate`` take beside the prompt and sampling, spelled once."""
    from producer.client import REQUEST_OPTION_NAMES
    from streamq.protocol import GenerateRequest

    client_side = {"affinity", "affinity_key", "defer_s"}
    carried = set(GenerateRequest.__struct_fields__) - {"prompt", "prompt_token_ids", "sampling", "stream"}
    assert carried | client_side == REQUEST_OPTION_NAMES


def test_sampling_options_name_every_field_of_the_requests_sampling_and_nothing_else() -> None:
    """The TypedDict is spelled out for editors and type checkers; the wire's struct is the truth."""
    on_the_wire: dict[str, Any] = {field.name: field.type for field in msgspec.structs.fields(Sampling)}
    on_the_wire["structured_outputs"] |= dict[str, Any]  # the struct, or its fields as a dict
    assert get_type_hints(SamplingOptions) == on_the_wire
    assert SamplingOptions.__optional_keys__ == set(on_the_wire)  # every one may be left out


def test_every_client_error_is_a_streamq_error_and_exported_from_producer() -> None:
    for name in CLIENT_ERRORS:
        assert name in producer.__all__
        assert issubclass(getattr(producer, name), StreamqError), name
    assert issubclass(InvalidRequest, ValueError) and issubclass(InvalidParameter, InvalidRequest)
    assert {"StreamqClient", "RequestHandle", "Completion", "SamplingOptions"} <= set(producer.__all__)


async def test_a_typo_in_a_sampling_option_is_refused_before_any_redis_command(queue: str) -> None:
    """The client's Redis is a port nobody listens on: any command would fail with a
    connection error, so a refusal proves nothing was sent."""
    async with StreamqClient(ArqRedis(host="127.0.0.1", port=unused_port()), queue=queue) as client:
        typo = "unknown sampling option 'max_tokns': did you mean 'max_tokens'"
        with pytest.raises(InvalidParameter, match=typo) as caught:
            await client.submit("Hello", max_tokns=5)  # type: ignore[call-arg]
        assert caught.value.param == "max_tokns"
        with pytest.raises(InvalidParameter, match="'temprature': did you mean 'temperature'?"):
            await client.generate("Hello", temprature=0.5)  # type: ignore[call-arg]
        with pytest.raises(InvalidRequest, match="temperature"):
            await client.submit("Hello", temperature="hot")  # type: ignore[arg-type]
        with pytest.raises(RedisUnavailable) as unreachable:  # a valid request does try to reach Redis
            await client.submit("Hello", temperature=0.5)
        assert isinstance(unreachable.value, ConnectionError)
        assert isinstance(unreachable.value.__cause__, RedisConnectionError)


async def test_a_bad_affinity_key_or_window_is_refused_before_any_redis_command(
    queue: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with StreamqClient(ArqRedis(host="127.0.0.1", port=unused_port()), queue=queue) as client:
        with pytest.raises(InvalidParameter, match="affinity_key is 300 characters") as caught:
            await client.submit("Hello", affinity_key="k" * 300)
        assert caught.value.param == "affinity_key"
    with pytest.raises(ValueError, match="affinity_window_s must be 0 to 10 seconds"):
        StreamqClient(ArqRedis(host="127.0.0.1", port=unused_port()), affinity_window_s=60)
    monkeypatch.setenv("STREAMQ_AFFINITY_WINDOW_S", "0.75")
    async with StreamqClient(ArqRedis(host="127.0.0.1", port=unused_port()), queue=queue) as client:
        assert client.affinity_window_s == 0.75


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
    producer_url: str, queue: str, monkeypatch: pytest.MonkeyPatch, raw_redis: aioredis.Redis
) -> None:
    monkeypatch.setenv(REDIS_URL_ENV, f"redis://127.0.0.1:{unused_port()}")  # nothing there
    monkeypatch.setenv(QUEUE_ENV, "streamq:queue:from-the-environment")
    async with await StreamqClient.connect(producer_url, queue=queue) as client:
        assert client.queue == queue
        async with await client.submit("Hello", cancel_on_close=True):
            assert await raw_redis.zcard(queue) == 1


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
    assert await still_queued(raw_redis, client.queue, request_id)  # it had ended: leaving generate cancelled nothing
    await client.cancel(request_id)


async def test_generate_past_its_timeout_raises_timeout_error_and_cancels_the_request(
    client: StreamqClient, request_id: str
) -> None:
    """Nobody holds the handle of a request ``generate`` stopped waiting for: it is cancelled."""
    started = time.monotonic()
    with pytest.raises(RequestTimeout) as timed_out:
        await client.generate("Hello", request_id=request_id, timeout=0.3)
    assert isinstance(timed_out.value, TimeoutError)  # `except TimeoutError` catches it
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
    assert await still_queued(raw_redis, client.queue, request_id) and not handle.done
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
    assert await still_queued(raw_redis, client.queue, request_id)
    await client.cancel(request_id)


async def test_leaving_async_with_cancels_an_unfinished_request_with_cancel_on_close(
    client: StreamqClient, request_id: str
) -> None:
    async with await client.submit("Hello", request_id=request_id, cancel_on_close=True):
        pass
    assert await was_cancelled(client, request_id)


async def test_a_loop_left_early_leaves_the_handle_open_for_the_rest(
    client: StreamqClient, raw_redis: aioredis.Redis, request_id: str
) -> None:
    """``break`` out of ``async for`` (say, at the first event) and the handle still
    follows the request: ``result()`` gathers what comes after, at once."""
    handle = await client.submit("Hello", request_id=request_id)
    await play_worker(raw_redis, request_id, "Hel", final=False)
    async for event in handle:
        assert isinstance(event, ChunkEvent) and event.text == "Hel"
        break
    await asyncio.sleep(0)  # the abandoned loop's generator is finalized
    await play_worker(raw_redis, request_id, "lo")
    completion = await handle.result(timeout=5)
    assert completion.text == "Hello" and completion.finish_reasons == ["stop"] and handle.done  # all of it


async def test_async_with_connect_opens_the_client_and_closes_it_on_exit(
    producer_url: str, queue: str, raw_redis: aioredis.Redis
) -> None:
    async def connections() -> int:
        """Connections of the producer's Redis user: this test's client alone uses it now."""
        return sum(1 for entry in await raw_redis.client_list() if entry.get("user") == "streamq-producer")

    before = await connections()
    async with StreamqClient.connect(producer_url, queue=queue) as client:
        await (await client.submit("Hi")).close()  # its pub/sub connection too
        assert await connections() > before
    assert await connections() == before  # every connection closed on exit
    async with await StreamqClient.connect(producer_url, queue=queue) as client:  # awaited first, also a form
        assert await raw_redis.zcard(queue) == 1
        await client.cancel((await raw_redis.zrange(queue, 0, 0))[0].decode())


@pytest.mark.parametrize("server", ["refusing", "silent"])
async def test_connecting_to_no_redis_fails_within_its_bound_naming_the_url_without_its_password(server: str) -> None:
    """A port nobody listens on, and one that accepts and never answers (a hung Redis)."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        port = listener.getsockname()[1]
        if server == "silent":
            listener.listen()
        else:
            listener.close()
        url = f"redis://user:s3cret@127.0.0.1:{port}"
        started = time.monotonic()
        with pytest.raises(ConnectionFailed) as failed:
            await StreamqClient.connect(url, connect_timeout_s=1)
        assert time.monotonic() - started < 3
    assert isinstance(failed.value, ConnectionError) and isinstance(failed.value, StreamqError)
    assert "s3cret" not in str(failed.value) and failed.value.url in str(failed.value)
    assert "s3cret" not in failed.value.url and f"127.0.0.1:{port}" in failed.value.url
    assert failed.value.__cause__ is not None


async def test_a_handle_gives_the_text_alone_and_its_result_after_the_loop_with_usage(
    client: StreamqClient, raw_redis: aioredis.Redis, request_id: str
) -> None:
    handle = await client.submit("Hi", request_id=request_id)
    await play_worker(raw_redis, request_id, "Hello", ", ", "world")
    assert [text async for text in handle.text()] == ["Hello", ", ", "world"]
    completion = await handle.result()  # after the loop that delivered every event
    assert (completion.text, completion.finish_reason) == ("Hello, world", "stop")
    assert completion.usage == Usage(prompt_tokens=2, completion_tokens=3, total_tokens=5)
    await client.cancel(request_id)


async def test_a_request_that_fails_raises_from_its_text_and_its_result(
    client: StreamqClient, raw_redis: aioredis.Redis, request_id: str
) -> None:
    handle = await client.submit("Hi", request_id=request_id)
    await ReplayLog(raw_redis).end(
        request_id, ErrorEvent(request_id=request_id, seq=0, code="internal", message="boom")
    )
    with pytest.raises(RequestError, match="boom") as failed:
        async for _ in handle.text():
            pass
    assert failed.value.code == "internal"
    with pytest.raises(RequestError, match="boom"):
        await handle.result()
    await client.cancel(request_id)


async def test_errors_carry_what_they_are_about(client: StreamqClient, request_id: str, producer_url: str) -> None:
    await (await client.submit("Hi", request_id=request_id)).close()
    with pytest.raises(DuplicateRequest) as duplicate:
        await client.submit("Hi", request_id=request_id)
    assert duplicate.value.request_id == request_id
    with pytest.raises(UnknownModel) as unknown:
        await client.submit("Hi", model="no-such-model")
    assert unknown.value.model == "no-such-model"
    async with StreamqClient.connect(producer_url, queue=client.queue, max_queue_depth=1) as bounded:
        with pytest.raises(QueueFull) as full:
            await bounded.submit("Hi")
    assert (full.value.queue, full.value.limit) == (client.queue, 1)
    await client.cancel(request_id)
