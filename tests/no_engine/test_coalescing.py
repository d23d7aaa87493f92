"""Adaptive coalescing: DELTAs that wait behind a batch in flight merge into one chunk
event, which reassembles to exactly what one event per DELTA would have carried.

A gated replay log holds a batch in flight for as long as a test wants, so merging
happens when the test says, not when the machine happens to be slow.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis
from prometheus_client import REGISTRY

from streamq.broker.replay_log import ReplayLog
from streamq.protocol import ChunkEvent, Event, FinalEvent, decode_event
from tests.support.gated_log import GatedLog
from worker.publisher import EventPublisher, coalesce_from_env
from worker.request_events import RequestEvents

# (index, text, token_ids, finish_reason) of one engine DELTA; a multi-byte character
# split over two tokens gives one DELTA with empty text, as vLLM's detokenizer does.
Delta = tuple[int, str, list[int], str | None]
DELTAS: list[Delta] = [
    (0, "Hello", [9906], None),
    (0, ",", [11], None),
    (0, "", [15722], None),
    (0, " é", [227], None),
    (0, " world", [1917], None),
    (0, "!", [0], "length"),
]


@pytest.fixture
async def redis(redis_url: str) -> AsyncIterator[aioredis.Redis]:
    client = aioredis.Redis.from_url(redis_url)
    yield client
    await client.aclose()


async def logged(redis: aioredis.Redis, request_id: str) -> list[Event]:
    return [decode_event(raw) for raw in await ReplayLog(redis).read(request_id)]


def reassembled(events: list[Event], index: int = 0) -> tuple[str, list[int], str | None]:
    """Completion ``index`` as a reader rebuilds it: its chunks' text and ids in seq order."""
    chunks = [e for e in sorted(events, key=lambda e: e.seq) if isinstance(e, ChunkEvent) and e.index == index]
    text = "".join(c.text for c in chunks)
    return text, [t for c in chunks for t in c.token_ids], chunks[-1].finish_reason


def expected(deltas: list[Delta], index: int = 0) -> tuple[str, list[int], str | None]:
    mine = [d for d in deltas if d[0] == index]
    return "".join(d[1] for d in mine), [t for d in mine for t in d[2]], mine[-1][3]


async def stream_behind_a_batch_in_flight(
    publisher: EventPublisher, log: GatedLog, request_id: str, deltas: list[Delta]
) -> None:
    """Publish the first DELTA, hold it in flight, publish the rest, then let it all through."""
    events = RequestEvents(publisher, request_id)
    events.chunk(*deltas[0])
    await log.in_flight()
    for delta in deltas[1:]:
        events.chunk(*delta)
    events.final([deltas[-1][3]], prompt_tokens=3, completion_tokens=sum(len(d[2]) for d in deltas))
    log.gate.set()
    await events.delivered()


def sample(name: str) -> float:
    return REGISTRY.get_sample_value(name) or 0.0


async def test_deltas_waiting_behind_a_batch_merge_and_reassemble_to_the_same_text_and_ids(
    redis: aioredis.Redis,
) -> None:
    request_id = f"co-{uuid.uuid4().hex}"
    log = GatedLog(redis)
    publisher = EventPublisher(log)
    publisher.start()
    before = {name: sample(name) for name in ("streamq_deltas_total", "streamq_chunks_total")}
    await stream_behind_a_batch_in_flight(publisher, log, request_id, DELTAS)
    await publisher.close()

    events = await logged(redis, request_id)
    # The first DELTA went out alone; the five that waited became one chunk, then the final.
    assert [type(e).__name__ for e in events] == ["ChunkEvent", "ChunkEvent", "FinalEvent"]
    assert [e.seq for e in events] == [0, 1, 2]
    assert reassembled(events) == expected(DELTAS)
    final = events[-1]
    assert isinstance(final, FinalEvent) and final.completion_tokens == 6
    # Operators see the merging: six DELTAs went out as two chunk events.
    assert sample("streamq_deltas_total") - before["streamq_deltas_total"] == 6
    assert sample("streamq_chunks_total") - before["streamq_chunks_total"] == 2


async def test_without_coalescing_every_delta_is_an_event_of_its_own_under_the_same_slow_log(
    redis: aioredis.Redis,
) -> None:
    request_id = f"co-{uuid.uuid4().hex}"
    log = GatedLog(redis)
    publisher = EventPublisher(log, coalesce=False)
    publisher.start()
    await stream_behind_a_batch_in_flight(publisher, log, request_id, DELTAS)
    await publisher.close()

    events = await logged(redis, request_id)
    assert [e.seq for e in events] == list(range(len(DELTAS) + 1))
    chunks = [e for e in events if isinstance(e, ChunkEvent)]
    assert [(c.index, c.text, c.token_ids, c.finish_reason) for c in chunks] == DELTAS
    assert reassembled(events) == expected(DELTAS)


async def test_an_idle_publisher_sends_every_delta_as_its_own_event(redis: aioredis.Redis) -> None:
    """With no batch in flight nothing waits, so nothing merges: each DELTA is sent as it
    comes, even DELTAs published back to back before the flusher has run."""
    request_id = f"co-{uuid.uuid4().hex}"
    publisher = EventPublisher(ReplayLog(redis))
    publisher.start()
    events = RequestEvents(publisher, request_id)
    events.chunk(*DELTAS[0])
    events.chunk(*DELTAS[1])  # buffered together, but no batch was in flight: not merged
    await events.delivered()
    for delta in DELTAS[2:]:
        events.chunk(*delta)
        await events.delivered()
    await publisher.close()

    logged_events = await logged(redis, request_id)
    assert [e.seq for e in logged_events] == list(range(len(DELTAS)))
    assert [(e.text, e.token_ids) for e in logged_events if isinstance(e, ChunkEvent)] == [(d[1], d[2]) for d in DELTAS]


async def test_only_the_requests_last_chunk_of_the_same_completion_is_extended(redis: aioredis.Redis) -> None:
    """n=2: DELTAs of completions 0 and 1 alternate, so none merges (a chunk is never
    extended across another event of its request); consecutive DELTAs of one completion
    do, and nothing joins a chunk that carries a finish reason."""
    request_id = f"co-{uuid.uuid4().hex}"
    log = GatedLog(redis)
    publisher = EventPublisher(log)
    publisher.start()
    deltas: list[Delta] = [
        (0, "a", [1], None),  # goes out alone, then is held in flight
        (0, "b", [2], None),
        (1, "x", [7], None),
        (0, "c", [3], None),
        (0, "d", [4], "stop"),
        (0, "e", [5], None),  # after a finish reason: a new chunk (an engine never sends it; the rule holds anyway)
        (1, "y", [8], None),
        (1, "z", [9], "length"),
    ]
    events = RequestEvents(publisher, request_id)
    events.chunk(*deltas[0])
    await log.in_flight()
    for delta in deltas[1:]:
        events.chunk(*delta)
    log.gate.set()
    await events.delivered()
    await publisher.close()

    chunks = [e for e in await logged(redis, request_id) if isinstance(e, ChunkEvent)]
    assert [(c.seq, c.index, c.text, c.token_ids, c.finish_reason) for c in chunks] == [
        (0, 0, "a", [1], None),
        (1, 0, "b", [2], None),
        (2, 1, "x", [7], None),
        (3, 0, "cd", [3, 4], "stop"),
        (4, 0, "e", [5], None),
        (5, 1, "yz", [8, 9], "length"),
    ]


async def test_a_chunk_taken_by_the_flusher_is_never_extended(redis: aioredis.Redis) -> None:
    """DELTAs merge only into a chunk still in the buffer: one already on its way to
    Redis stays as it was sent, and later DELTAs start the next chunk."""
    request_id = f"co-{uuid.uuid4().hex}"
    log = GatedLog(redis)
    publisher = EventPublisher(log)
    publisher.start()
    events = RequestEvents(publisher, request_id)
    events.chunk(0, "a", [1], None)
    await log.in_flight()  # "a" is in flight
    events.chunk(0, "b", [2], None)
    events.chunk(0, "c", [3], None)  # joins "b", which waits
    log.gate.set()
    await log.in_flight()  # "bc" taken; the gate stays open
    events.chunk(0, "d", [4], None)
    await events.delivered()
    await publisher.close()

    assert [[event.seq for event in batch] for batch in log.batches] == [[0], [1], [2]]
    chunks = [e for e in await logged(redis, request_id) if isinstance(e, ChunkEvent)]
    assert [(c.seq, c.text, c.token_ids) for c in chunks] == [(0, "a", [1]), (1, "bc", [2, 3]), (2, "d", [4])]


async def test_many_requests_merged_under_load_keep_contiguous_seqs_and_their_own_tokens(
    redis: aioredis.Redis,
) -> None:
    log = GatedLog(redis)
    publisher = EventPublisher(log)
    publisher.start()
    ids = [f"co-{uuid.uuid4().hex}" for _ in range(8)]
    requests = {request_id: RequestEvents(publisher, request_id) for request_id in ids}
    sent: dict[str, list[int]] = {request_id: [] for request_id in requests}
    for step in range(40):
        for k, (request_id, events) in enumerate(requests.items()):
            token = 1000 * k + step
            events.chunk(0, f"<{token}>", [token], "length" if step == 39 else None)
            sent[request_id].append(token)
        if step % 10 == 0:
            log.gate.clear()
            await asyncio.sleep(0)  # the flusher takes what is there and waits at the gate
        elif step % 10 == 5:
            log.gate.set()
            await asyncio.sleep(0)
    for events in requests.values():
        events.final(["length"], prompt_tokens=1, completion_tokens=40)
    log.gate.set()
    await publisher.flushed()
    await publisher.close()

    for request_id, tokens in sent.items():
        events_logged = await logged(redis, request_id)
        assert [e.seq for e in events_logged] == list(range(len(events_logged)))
        assert len(events_logged) < 41, "nothing merged: the test did not hold batches in flight"
        assert reassembled(events_logged) == ("".join(f"<{t}>" for t in tokens), tokens, "length")
        assert isinstance(events_logged[-1], FinalEvent)


def test_the_environment_turns_merging_off() -> None:
    assert coalesce_from_env({}) is True
    assert coalesce_from_env({"STREAMQ_COALESCE": "1"}) is True
    for off in ("0", "false", "No", "off"):
        assert coalesce_from_env({"STREAMQ_COALESCE": off}) is False
    with pytest.raises(ValueError, match=r"\$STREAMQ_COALESCE='of': expected one of 1, true"):
        coalesce_from_env({"STREAMQ_COALESCE": "of"})  # a typo does not leave merging on
