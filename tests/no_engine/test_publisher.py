"""The coalescing publisher and the replay log against a real Redis (no engine)."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis

from streamq.broker.replay_log import Appended, LogEvent, ReplayLog, TakeOver
from streamq.protocol import ChunkEvent, ErrorEvent, FinalEvent, decode_event, encode_event, events_channel
from tests.support.events import lose_writes
from worker.publisher import EventPublisher, PublishFailed, Refusal


@pytest.fixture
async def redis(redis_url: str) -> AsyncIterator[aioredis.Redis]:
    client = aioredis.Redis.from_url(redis_url)
    yield client
    await client.aclose()


async def test_concurrent_requests_arrive_complete_and_in_order(redis: aioredis.Redis, redis_url: str) -> None:
    listener = aioredis.Redis.from_url(redis_url)
    pubsub = listener.pubsub()
    request_ids = [f"pub-{uuid.uuid4().hex}" for _ in range(8)]
    await pubsub.subscribe(*map(events_channel, request_ids))
    for _ in request_ids:
        await pubsub.get_message(timeout=5)
    publisher = EventPublisher(ReplayLog(redis))
    publisher.start()

    async def one_request(request_id: str) -> None:
        for seq in range(200):
            publisher.publish(request_id, seq, 1, json.dumps({"seq": seq}).encode())
            if seq % 7 == 0:
                await asyncio.sleep(0)  # let other "requests" interleave, as jobs do

    await asyncio.gather(*(one_request(r) for r in request_ids))
    await publisher.flushed()
    received: dict[str, list[int]] = {events_channel(r): [] for r in request_ids}
    while sum(map(len, received.values())) < 8 * 200:
        message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=5)
        assert message is not None, "events went missing"
        received[message["channel"].decode()].append(json.loads(message["data"])["seq"])
    assert all(seqs == list(range(200)) for seqs in received.values())
    # ...and the replay log holds the same, readable from any sequence number.
    log = ReplayLog(redis)
    assert [json.loads(e)["seq"] for e in await log.read(request_ids[0], from_seq=150)] == list(range(150, 200))

    await publisher.close()
    await pubsub.aclose()
    await listener.aclose()


async def test_close_flushes_what_is_buffered(redis: aioredis.Redis) -> None:
    request_id = f"pub-{uuid.uuid4().hex}"
    publisher = EventPublisher(ReplayLog(redis))
    publisher.start()
    publisher.publish(request_id, 0, 1, b"last words")
    await publisher.close()
    assert await ReplayLog(redis).read(request_id) == [b"last words"]


async def test_an_event_already_logged_is_not_published_again(redis: aioredis.Redis, redis_url: str) -> None:
    """A retried batch, or a second worker on the same request, cannot duplicate events."""
    request_id = f"pub-{uuid.uuid4().hex}"
    log = ReplayLog(redis)
    listener = aioredis.Redis.from_url(redis_url)
    pubsub = listener.pubsub()
    await pubsub.subscribe(events_channel(request_id))
    await pubsub.get_message(timeout=5)

    assert await log.append([LogEvent(request_id, 0, 1, b"first"), LogEvent(request_id, 1, 1, b"second")]) == Appended(
        0
    )
    again = await log.append([LogEvent(request_id, 1, 1, b"second"), LogEvent(request_id, 2, 1, b"third")])
    assert again == Appended(1)  # a duplicate, not a superseded attempt

    published = []
    while (message := await pubsub.get_message(ignore_subscribe_messages=True, timeout=1)) is not None:
        published.append(message["data"])
    assert published == [b"first", b"second", b"third"]
    assert await log.read(request_id) == [b"first", b"second", b"third"]
    assert 0 < await redis.pttl(events_channel(request_id)) <= 3_600_000  # the log expires
    await pubsub.aclose()
    await listener.aclose()


async def test_a_superseded_attempt_can_no_longer_write(redis: aioredis.Redis) -> None:
    """A worker that lost its lease but still runs must not write over the one that
    took the request over."""
    request_id = f"pub-{uuid.uuid4().hex}"
    log = ReplayLog(redis)
    await log.append([LogEvent(request_id, 0, 1, b"a1-0"), LogEvent(request_id, 1, 1, b"a1-1")])

    assert await log.take_over(request_id, 2) == TakeOver(True, [b"a1-0", b"a1-1"])
    assert await log.append([LogEvent(request_id, 2, 1, b"a1-2 (stale)")]) == Appended(1, frozenset({request_id}))
    mixed = await log.append([LogEvent(request_id, 2, 2, b"a2-2"), LogEvent(request_id, 3, 1, b"a1-3 (stale)")])
    assert mixed == Appended(1, frozenset({request_id}))
    assert await log.append([LogEvent(request_id, 3, 0, b"producer's own event")]) == Appended(0)
    assert await log.read(request_id) == [b"a1-0", b"a1-1", b"a2-2", b"producer's own event"]
    assert await log.take_over(request_id, 1) == TakeOver(False, [b"a1-0", b"a1-1", b"a2-2", b"producer's own event"])


async def test_an_entry_written_by_another_attempt_is_refused_not_counted_as_delivered(redis: aioredis.Redis) -> None:
    """The stale attempt's events take numbers the attempt that took over has already
    written: they are not duplicates of its own (their payload differs), so the stale
    attempt is told it was superseded rather than that its events are logged."""
    request_id = f"pub-{uuid.uuid4().hex}"
    log = ReplayLog(redis)
    await log.append([LogEvent(request_id, 0, 1, b"a1-0")])
    await log.take_over(request_id, 2)
    await log.append([LogEvent(request_id, 1, 2, b"a2-1"), LogEvent(request_id, 2, 2, b"a2-2")])
    stale = [LogEvent(request_id, 1, 1, b"a1-1"), LogEvent(request_id, 2, 1, b"a1-final", terminal=True)]
    assert await log.append(stale) == Appended(2, frozenset({request_id}))
    assert await log.read(request_id) == [b"a1-0", b"a2-1", b"a2-2"]


async def test_an_event_that_would_leave_a_gap_is_refused_as_out_of_step(redis: aioredis.Redis) -> None:
    """A Redis that lost acknowledged writes (a crash without fsync, a failover to a replica
    that lagged) no longer holds events an attempt wrote: its next events would leave a hole
    in the log, so none is logged and its request is reported out of step."""
    request_id = f"pub-{uuid.uuid4().hex}"
    log = ReplayLog(redis)
    await log.append([LogEvent(request_id, seq, 1, b"e%d" % seq) for seq in range(4)])
    await lose_writes(redis, request_id, keep=2)
    assert await log.append([LogEvent(request_id, 4, 1, b"e4"), LogEvent(request_id, 5, 1, b"e5")]) == Appended(
        2, out_of_step=frozenset({request_id})
    )
    assert await log.read(request_id) == [b"e0", b"e1"]


async def test_nothing_is_logged_after_a_terminal_event(redis: aioredis.Redis) -> None:
    """Once a request ended, any attempt still writing is refused and told to stop, while
    a retried batch that holds the terminal event itself is a plain duplicate."""
    request_id = f"pub-{uuid.uuid4().hex}"
    log = ReplayLog(redis)
    ended = [LogEvent(request_id, 0, 1, b"a1-0"), LogEvent(request_id, 1, 1, b"a1-final", terminal=True)]
    assert await log.append(ended) == Appended(0)
    assert await log.append(ended) == Appended(2)  # retried: duplicates only
    assert await log.append([LogEvent(request_id, 2, 1, b"late")]) == Appended(1, frozenset({request_id}))
    assert await log.append([LogEvent(request_id, 2, 3, b"newer attempt")]) == Appended(1, frozenset({request_id}))
    assert await log.read(request_id) == [b"a1-0", b"a1-final"]


async def test_end_numbers_the_event_in_redis_and_ends_a_request_once(redis: aioredis.Redis) -> None:
    request_id = f"pub-{uuid.uuid4().hex}"
    log = ReplayLog(redis)
    await log.append([LogEvent(request_id, 0, 1, b'{"x":0}'), LogEvent(request_id, 1, 1, b'{"x":1}')])
    error = ErrorEvent(request_id=request_id, seq=0, code="expired", message="gone \u00e9")
    assert await log.end(request_id, error) == 2
    final = FinalEvent(request_id=request_id, seq=0, finish_reasons=["cancelled"], prompt_tokens=0, completion_tokens=0)
    assert await log.end(request_id, final) is None  # already ended: not a second terminal event
    logged = decode_event((await log.read(request_id, from_seq=2))[0])
    assert logged == ErrorEvent(request_id=request_id, seq=2, code="expired", message="gone \u00e9")
    assert await log.append([LogEvent(request_id, 3, 1, b"late")]) == Appended(1, frozenset({request_id}))
    fresh = f"pub-{uuid.uuid4().hex}"
    assert (
        await log.end(
            fresh,
            FinalEvent(request_id=fresh, seq=0, finish_reasons=["cancelled"], prompt_tokens=0, completion_tokens=0),
        )
        == 0
    )


async def test_a_final_written_from_outside_counts_the_tokens_already_sent(redis: aioredis.Redis) -> None:
    """A cancel that finds the request queued while an attempt whose lease lapsed had
    already streamed some tokens: the final it writes counts them."""
    request_id = f"pub-{uuid.uuid4().hex}"
    log = ReplayLog(redis)
    chunks = [ChunkEvent(request_id=request_id, seq=seq, text="ab", token_ids=[seq, seq + 1]) for seq in range(3)]
    await log.append([LogEvent(request_id, c.seq, 1, encode_event(c)) for c in chunks])
    final = FinalEvent(request_id=request_id, seq=0, finish_reasons=["cancelled"], prompt_tokens=0, completion_tokens=0)
    assert await log.end(request_id, final) == 3
    logged = decode_event((await log.read(request_id, from_seq=3))[0])
    assert isinstance(logged, FinalEvent) and logged.seq == 3 and logged.completion_tokens == 6


@pytest.mark.parametrize("ended_by", ["its attempt", "end_request"])
async def test_an_ended_log_keeps_its_bytes_not_a_streams_node_and_its_reader_gets_the_end(
    redis: aioredis.Redis, redis_url: str, ended_by: str
) -> None:
    """Redis allocates a Stream's newest node at 4 KB for the entries to come: a short log,
    once ended, is rewritten at its size, and a reader blocked on the log still gets the end."""
    request_id, open_id = f"pub-{uuid.uuid4().hex}", f"pub-{uuid.uuid4().hex}"
    log = ReplayLog(redis, ttl_ms=60_000)
    chunk = encode_event(ChunkEvent(request_id=request_id, seq=0, text="ab", token_ids=[1, 2]))
    for one in (request_id, open_id):
        await log.append([LogEvent(one, 0, 1, chunk)])
    reader = aioredis.Redis.from_url(redis_url)
    try:
        waiting = asyncio.ensure_future(reader.xread({events_channel(request_id): "0-1"}, block=10_000))
        await asyncio.sleep(0.1)
        final = FinalEvent(
            request_id=request_id, seq=1, finish_reasons=["length"], prompt_tokens=3, completion_tokens=2
        )
        if ended_by == "end_request":
            assert await log.end(request_id, final) == 1
        else:
            await log.append([LogEvent(request_id, 1, 1, encode_event(final), terminal=True)])
        [[_, [(entry_id, fields)]]] = await asyncio.wait_for(waiting, 10)
    finally:
        await reader.aclose()
    assert entry_id == b"0-2" and isinstance(decode_event(fields[b"event"]), FinalEvent)
    ended_bytes = await redis.memory_usage(events_channel(request_id), samples=0)
    open_bytes = await redis.memory_usage(events_channel(open_id), samples=0)
    assert open_bytes > 4096 > 4 * ended_bytes, (open_bytes, ended_bytes)
    assert 0 < await redis.pttl(events_channel(request_id)) <= 60_000
    assert [decode_event(e).seq for e in await log.read(request_id)] == [0, 1]


async def test_an_event_redis_refuses_fails_its_batch_loudly_and_the_publisher_goes_on(redis: aioredis.Redis) -> None:
    """A write error that is not a duplicate (here WRONGTYPE) is never counted as
    delivered: the waiters of that batch fail, and later batches still go out."""
    broken, healthy = f"pub-{uuid.uuid4().hex}", f"pub-{uuid.uuid4().hex}"
    await redis.set(events_channel(broken), "not a stream")
    publisher = EventPublisher(ReplayLog(redis))
    publisher.start()
    publisher.publish(broken, 0, 1, b"doomed")
    with pytest.raises(PublishFailed, match="WRONGTYPE"):
        await publisher.flushed()
    publisher.publish(healthy, 0, 1, b"fine")
    await publisher.flushed()
    assert await ReplayLog(redis).read(healthy) == [b"fine"]
    await publisher.close()


async def test_a_redis_that_forgot_its_scripts_still_takes_the_batch(redis: aioredis.Redis) -> None:
    """A restarted Redis has no scripts loaded: the batch loads it and goes through once."""
    request_id = f"pub-{uuid.uuid4().hex}"
    log = ReplayLog(redis)
    assert await log.append([LogEvent(request_id, 0, 1, b"before")]) == Appended(0)
    await redis.script_flush()
    payload = "après".encode()
    assert await log.append([LogEvent(request_id, 1, 1, payload)]) == Appended(0)
    assert await log.read(request_id) == [b"before", payload]


async def test_a_single_connection_client_is_refused_by_name(redis_url: str) -> None:
    """The log sends many commands to a write on connections of the client's pool."""
    client = aioredis.Redis.from_url(redis_url, single_connection_client=True)
    with pytest.raises(ValueError, match="pooled client"):
        ReplayLog(client)
    await client.aclose()


async def test_flushed_waits_for_the_batch_already_in_flight(redis: aioredis.Redis) -> None:
    """An attempt asks whether its last events reached Redis after the flusher took them:
    the answer must wait for that batch, and a refusal in its reply is known by then."""
    request_id = f"pub-{uuid.uuid4().hex}"
    log = ReplayLog(redis)
    await log.append([LogEvent(request_id, 0, 1, b"a1-0")])
    await log.take_over(request_id, 2)
    reported: list[tuple[str, int, Refusal]] = []
    publisher = EventPublisher(log, on_refused=lambda *refused: reported.append(refused))
    publisher.start()
    publisher.publish(request_id, 1, 1, b"a1-final", terminal=True)
    await asyncio.sleep(0)  # the flusher takes the batch and sends it
    assert not publisher._pending and publisher._in_flight
    await publisher.flushed()
    assert reported == [(request_id, 1, Refusal.SUPERSEDED)]
    assert publisher.take_refusal(request_id, 1) is Refusal.SUPERSEDED
    assert publisher.take_refusal(request_id, 1) is None  # told once
    await publisher.close()


async def test_end_request_is_fenced_by_attempt(redis: aioredis.Redis) -> None:
    """A worker ending a job arq failed writes nothing while a newer attempt owns the
    request; a producer's end (no attempt) ends it whoever runs it."""
    request_id = f"pub-{uuid.uuid4().hex}"
    log = ReplayLog(redis)
    await log.append([LogEvent(request_id, 0, 1, b'{"x":0}')])
    await log.take_over(request_id, 2)
    failed = ErrorEvent(request_id=request_id, seq=0, code="timeout", message="job_timeout")
    assert await log.end(request_id, failed, attempt=1) is None
    assert await log.end(request_id, failed, attempt=2) == 1
    cancelled = FinalEvent(
        request_id=request_id, seq=0, finish_reasons=["cancelled"], prompt_tokens=0, completion_tokens=0
    )
    assert await log.end(request_id, cancelled) is None  # already ended
    other = f"pub-{uuid.uuid4().hex}"
    await log.take_over(other, 3)
    assert await log.end(other, cancelled) == 0


async def test_a_flush_split_into_pipelined_calls_logs_and_reports_as_one_call(redis_url: str) -> None:
    """The shape a Redis Cluster needs (one script call per slot, pipelined): the same
    logs, and duplicates, refusals and gaps reported together as one call reports them,
    also on a Redis that forgot its scripts."""
    client = aioredis.Redis.from_url(redis_url)
    log = ReplayLog(client)
    fresh, taken, gapped = (f"pub-{uuid.uuid4().hex}" for _ in range(3))
    await log.append([LogEvent(taken, 0, 1, b"t0"), *(LogEvent(gapped, seq, 1, b"g%d" % seq) for seq in range(3))])
    await log.take_over(taken, 2)
    await lose_writes(client, gapped, keep=1)
    await client.script_flush()
    groups = [
        [LogEvent(fresh, 0, 1, b"f0"), LogEvent(fresh, 1, 1, b"f1", terminal=True)],
        [LogEvent(taken, 0, 1, b"t0"), LogEvent(taken, 1, 1, b"t1 (stale)")],
        [LogEvent(gapped, 3, 1, b"g3")],
        [],
    ]
    assert await log.append_groups(groups) == Appended(
        3, superseded=frozenset({taken}), out_of_step=frozenset({gapped})
    )
    assert await log.read(fresh) == [b"f0", b"f1"]
    assert await log.read(taken) == [b"t0"]
    assert await log.read(gapped) == [b"g0"]
    assert await log.append_groups([groups[0]]) == Appended(2)  # retried: duplicates only
    await client.aclose()
