"""The blocking client (``producer.sync``) as a web server's threads, a script and a
notebook use it: one client shared by eight threads, each seeing only its own request's
text; ``generate_many`` as a plain iterator; a call from inside a running event loop; a
connect that fails within its bound. Real Redis, as the producer role; the test plays the
worker (tests/real_engine/test_end_to_end.py shares one among eight threads against the real one)."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
import uuid
from collections.abc import AsyncIterator, Iterator

import pytest
import redis.asyncio as aioredis

from producer import ChunkEvent, ConnectionFailed, FinalEvent, RequestTimeout, StreamqError
from producer.sync import StreamqClient
from tests.support.play_worker import play_worker


@pytest.fixture
def queue() -> str:
    return f"streamq:queue:sync-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def client(producer_url: str, queue: str) -> Iterator[StreamqClient]:
    with StreamqClient.connect(producer_url, queue=queue) as client:
        yield client


@pytest.fixture
async def worker(raw_redis: aioredis.Redis, queue: str) -> AsyncIterator[None]:
    """Answers each request queued on ``queue``: three chunks naming it, then its end."""
    served: set[str] = set()

    async def serve() -> None:
        while True:
            for member in await raw_redis.zrange(queue, 0, -1):
                request_id = member.decode()
                if request_id not in served:
                    served.add(request_id)
                    await play_worker(raw_redis, request_id, "text ", "of ", request_id)
            await asyncio.sleep(0.01)

    task = asyncio.create_task(serve())
    yield
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


async def test_eight_threads_share_one_client_each_with_its_own_request(client: StreamqClient, worker: None) -> None:
    results: dict[int, str] = {}
    errors: list[BaseException] = []

    def view(i: int) -> None:  # what a web server's request thread does
        try:
            request_id = f"view-{i}-{uuid.uuid4().hex[:6]}"
            if i % 2:
                results[i] = client.generate("Hi", request_id=request_id, max_tokens=8, timeout=30).text
            else:
                with client.submit("Hi", request_id=request_id, max_tokens=8) as handle:
                    results[i] = "".join(handle.text())
            assert results[i] == f"text of {request_id}"
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=view, args=(i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    await asyncio.to_thread(lambda: [thread.join(timeout=60) for thread in threads])
    assert not errors, errors
    assert len(results) == 8


async def test_a_handle_iterates_with_a_plain_for_and_gives_its_result_after(
    client: StreamqClient, worker: None
) -> None:
    def follow() -> tuple[list[object], str]:
        with client.submit("Hi", max_tokens=8) as handle:
            events = list(handle)
            return events, handle.result().text

    events, text = await asyncio.to_thread(follow)
    assert [type(event) for event in events] == [ChunkEvent, ChunkEvent, ChunkEvent, FinalEvent]
    assert text.startswith("text of ")


async def test_generate_many_is_an_iterator_of_completions(client: StreamqClient, worker: None) -> None:
    def run() -> set[str]:
        prompts = [{"prompt": "Hi", "request_id": f"many-{i}-{uuid.uuid4().hex[:6]}"} for i in range(5)]
        return {completion.request_id for completion in client.generate_many(prompts, max_tokens=4)}

    assert len(await asyncio.to_thread(run)) == 5


async def test_follow_resumes_after_the_digest_of_the_last_event_had(
    client: StreamqClient, raw_redis: aioredis.Redis
) -> None:
    """``follow``'s ``after`` and the handle's ``last_digest``, as the async client's."""
    request_id = f"sync-follow-{uuid.uuid4().hex[:8]}"
    await play_worker(raw_redis, request_id, "a", "b")

    def follow() -> tuple[list[int], list[int], bool]:
        with client.follow(request_id) as handle:
            for event in handle:
                if event.seq == 1:
                    break  # the connection drops here: the caller keeps seq and digest
            after_one = handle.last_digest
        assert after_one is not None
        rest = client.follow(request_id, from_seq=2, after=after_one)
        seqs = [event.seq for event in rest]
        assert rest.last_digest is not None
        with client.follow(request_id, from_seq=3, after=rest.last_digest) as ended:
            return seqs, [event.seq for event in ended], ended.done

    assert await asyncio.to_thread(follow) == ([2], [], True)  # 0, 1: chunks; 2: the end


def test_status_cancel_and_a_timeout_as_the_async_client_answers(client: StreamqClient) -> None:
    handle = client.submit("Hi")  # nobody serves the queue: it stays queued
    assert client.status(handle.request_id).state == "queued"
    with pytest.raises(RequestTimeout):
        handle.result(timeout=0.2)
    assert client.cancel(handle.request_id) == "queued"
    assert handle.result().finish_reason == "cancelled"  # the handle kept following it
    assert client.status(handle.request_id).state == "finished"


async def test_a_call_from_inside_a_running_event_loop_does_not_deadlock(client: StreamqClient) -> None:
    """A notebook cell runs in an event loop: a blocking call there waits on the client's own."""
    assert client.status(f"never-{uuid.uuid4().hex}").state == "unknown"
    handle = client.submit("Hi")
    assert client.cancel(handle.request_id) == "queued"
    handle.close()


def test_a_call_from_the_clients_own_loop_is_refused_rather_than_waiting_forever(client: StreamqClient) -> None:
    outcome: list[BaseException | int] = []

    async def inside() -> None:
        try:
            outcome.append(len(client.status("any").request_id))
        except BaseException as exc:
            outcome.append(exc)

    client._loop.run(inside())
    assert isinstance(outcome[0], StreamqError) and "own event loop" in str(outcome[0])


def test_connecting_to_no_redis_fails_within_its_bound() -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    started = time.monotonic()
    with pytest.raises(ConnectionFailed, match=f"127.0.0.1:{port}"):
        StreamqClient.connect(f"redis://:hunter2@127.0.0.1:{port}", connect_timeout_s=1)
    assert time.monotonic() - started < 3
    assert not [thread for thread in threading.enumerate() if thread.name == "streamq-client"]  # its loop stopped
