"""One handle delivers one end at most, and a follow continues only the stream its caller
had: a Redis that lost acknowledged writes (a crash without fsync, a failover to a replica
that lagged) may hold another version of a request's stream, numbered alike; each test
plays such a log into Redis (no worker) and checks that the client never delivers a mix of
two versions, nor a second end. Real Redis, as the producer role."""

from __future__ import annotations

import asyncio
import hashlib
import uuid
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis

from producer.client import RequestHandle, StreamqClient, event_digest
from producer.errors import InvalidParameter, MissingEvents
from streamq.protocol import ChunkEvent, Event, FinalEvent, encode_event, events_channel
from tests.support.events import lose_writes


@pytest.fixture
async def client(producer_url: str) -> AsyncIterator[StreamqClient]:
    async with await StreamqClient.connect(producer_url, queue=f"streamq:queue:nobody-{uuid.uuid4().hex[:8]}") as c:
        yield c


@pytest.fixture
def request_id() -> str:
    return f"resume-checks-{uuid.uuid4().hex}"


def chunk(request_id: str, seq: int, text: str, attempt: int = 1) -> ChunkEvent:
    return ChunkEvent(request_id=request_id, seq=seq, attempt=attempt, text=text, token_ids=[seq])


def end(request_id: str, seq: int, reason: str = "stop", attempt: int = 1) -> FinalEvent:
    return FinalEvent(
        request_id=request_id,
        seq=seq,
        attempt=attempt,
        finish_reasons=[reason],
        prompt_tokens=2,
        completion_tokens=seq,
        worker=f"worker-{attempt}",
    )


async def play(redis: aioredis.Redis, *events: Event, published: bool = True) -> None:
    """Log each event as its log's entry ``0-<seq + 1>`` (and publish it), as a worker does."""
    for event in events:
        payload = encode_event(event)
        await redis.xadd(events_channel(event.request_id), {"event": payload}, id=f"0-{event.seq + 1}")
        if published:
            await redis.publish(events_channel(event.request_id), payload)


async def logged(redis: aioredis.Redis, request_id: str) -> list[bytes]:
    return [fields[b"event"] for _, fields in await redis.xrange(events_channel(request_id))]


async def delivered(handle: RequestHandle) -> list[Event]:
    return [event async for event in handle]


def test_an_event_digest_is_blake2b_of_8_bytes_in_hex_the_same_in_every_process() -> None:
    """Stable (not Python's salted ``hash``): another process, or language, computes it alike."""
    raw = b'{"type":"chunk","v":1,"request_id":"r1","seq":0}'
    assert event_digest(raw) == hashlib.blake2b(raw, digest_size=8).hexdigest() == "44bae145fd020693"


async def test_a_handle_delivers_one_end_whatever_the_log_holds_after_it(
    client: StreamqClient, raw_redis: aioredis.Redis, request_id: str
) -> None:
    """The end delivered, the log is rewritten (Redis lost the end and the chunk before it;
    another attempt went on from what it kept, to an end of its own, published to the handle
    still subscribed): the handle delivers nothing more, and its result is the first end's."""
    await play(raw_redis, chunk(request_id, 0, "a0"), chunk(request_id, 1, "a1"), end(request_id, 2))
    handle = await client.follow(request_id)
    events = handle.__aiter__()
    first = [await anext(events) for _ in range(3)]
    assert isinstance(first[-1], FinalEvent) and handle.done
    await lose_writes(raw_redis, request_id, keep=1)
    await play(
        raw_redis,
        chunk(request_id, 1, "b1", attempt=2),
        chunk(request_id, 2, "b2", attempt=2),
        end(request_id, 3, "length", attempt=2),
    )
    with pytest.raises(StopAsyncIteration):
        await asyncio.wait_for(anext(events), timeout=5)
    assert await delivered(handle) == []
    completion = await handle.result()
    assert (completion.text, completion.finish_reasons, completion.worker_id) == ("a0a1", ["stop"], "worker-1")


async def test_a_gap_filled_from_a_rewritten_log_fails_rather_than_mix_two_versions(
    client: StreamqClient, raw_redis: aioredis.Redis, request_id: str
) -> None:
    """Events 0 and 1 delivered; Redis lost event 1, and another attempt logged 1', 2' without
    the handle hearing them, then 3' (its end), which the handle hears: a gap. Filling it
    from the log checks event 1 again (``1'`` is another): ``MissingEvents``, never 2' and
    the second version's end after the first version's 1."""
    await play(raw_redis, chunk(request_id, 0, "a0"), chunk(request_id, 1, "a1"))
    handle = await client.follow(request_id)
    events = handle.__aiter__()
    assert [(await anext(events)).seq for _ in range(2)] == [0, 1]
    await lose_writes(raw_redis, request_id, keep=1)
    await play(raw_redis, chunk(request_id, 1, "b1", 2), chunk(request_id, 2, "b2", 2), published=False)
    await play(raw_redis, end(request_id, 3, attempt=2))
    with pytest.raises(MissingEvents, match="event 1 is no longer the one delivered"):
        await asyncio.wait_for(anext(events), timeout=5)
    assert not handle.done


async def test_follow_after_continues_only_from_the_event_its_caller_had(
    client: StreamqClient, raw_redis: aioredis.Redis, request_id: str
) -> None:
    await play(raw_redis, chunk(request_id, 0, "a0"), chunk(request_id, 1, "a1"), end(request_id, 2))
    whole = await client.follow(request_id)
    assert [event.seq for event in await delivered(whole)] == [0, 1, 2]
    digests = [whole.digest(seq) for seq in range(3)]
    assert digests == [event_digest(raw) for raw in await logged(raw_redis, request_id)]
    assert whole.last_digest == digests[2] and whole.digest(3) is None

    # The log holds the events the caller had: it continues from them, exactly.
    rest = await client.follow(request_id, from_seq=2, after=digests[1])
    assert rest.last_digest == digests[1]
    assert [event.seq for event in await delivered(rest)] == [2] and rest.last_digest == digests[2]
    assert (await rest.result()).finish_reasons == ["stop"]
    assert digests[1] is not None
    upper = await client.follow(request_id, from_seq=2, after=digests[1].upper())
    assert [event.seq for event in await delivered(upper)] == [2]
    # After the end it had: done at once, nothing delivered, and the end it had is the result.
    after_end = await client.follow(request_id, from_seq=3, after=digests[2])
    assert after_end.done and await delivered(after_end) == []
    assert (await after_end.result()).finish_reasons == ["stop"]

    # Redis lost events 1 and 2, and another attempt went on to an end of its own.
    await lose_writes(raw_redis, request_id, keep=1)
    await play(raw_redis, chunk(request_id, 1, "b1", 2), end(request_id, 2, "length", 2))
    for from_seq, digest in ((2, digests[1]), (3, digests[2])):
        with pytest.raises(MissingEvents, match=f"event {from_seq - 1} is not the one .* holds another event"):
            await client.follow(request_id, from_seq=from_seq, after=digest)
    # Redis lost them, and nothing was logged since.
    await lose_writes(raw_redis, request_id, keep=1)
    with pytest.raises(MissingEvents, match="event 1 is not the one the caller had: the log no longer holds it"):
        await client.follow(request_id, from_seq=2, after=digests[1])


async def test_follow_refuses_an_after_that_names_no_event(client: StreamqClient, request_id: str) -> None:
    with pytest.raises(InvalidParameter, match="from_seq=0") as before_any:
        await client.follow(request_id, from_seq=0, after="0" * 16)
    with pytest.raises(InvalidParameter, match="16 hex digits") as not_a_digest:
        await client.follow(request_id, from_seq=1, after="12")
    assert before_any.value.param == not_a_digest.value.param == "after"
