"""The chaos soak's check of one request (``tests/support/soak_check.py``) fails on a second
end, however it shows: a second terminal event on the wire (at another seq, or at the same
seq with other contents: a request run again after a failover took its first end back), a
handle that delivered two ends, a log that holds two; it lets an end published again as it
was pass (a take-over that confirms a logged end publishes it again), and, where a failover
may take writes back, any event published again as it was. The cluster soak's
witness records past a request's first end, so that a second one can be seen."""

from __future__ import annotations

import asyncio
import json

import pytest
import redis.asyncio as aioredis

from devkit.chaos import ShardedEventWitness
from devkit.redis_cluster import RedisCluster
from streamq.broker.data_plane import CLUSTER
from streamq.protocol import ChunkEvent, ErrorEvent, Event, FinalEvent, decode_event, encode_event
from tests.support.soak_check import Answer, Run, Spec, check

RID = "soak-check"
SPEC = Spec("plain-2", {"prompt": "x", "max_tokens": 2, "ignore_eos": True})
EXPECTED = Answer("ab", [1, 2], ["length"])


def chunk(seq: int, text: str, token: int, attempt: int = 1) -> ChunkEvent:
    return ChunkEvent(request_id=RID, seq=seq, text=text, token_ids=[token], attempt=attempt)


def final(seq: int, attempt: int = 1, reason: str = "length") -> FinalEvent:
    return FinalEvent(
        request_id=RID, seq=seq, finish_reasons=[reason], prompt_tokens=1, completion_tokens=seq, attempt=attempt
    )


LOGGED: list[Event] = [chunk(0, "a", 1), chunk(1, "b", 2), final(2)]


def run_of(events: list[Event]) -> Run:
    return Run(RID, SPEC, events=[(float(index), event) for index, event in enumerate(events)])


def test_a_request_that_ended_once_passes() -> None:
    assert check(run_of(LOGGED), LOGGED, LOGGED, EXPECTED) == ([], False, False)


def test_an_end_published_again_as_it_was_passes() -> None:
    assert check(run_of(LOGGED), LOGGED, [*LOGGED, final(2)], EXPECTED) == ([], False, False)


@pytest.mark.parametrize(
    ("second", "why"),
    [
        (final(2, attempt=2), "the same seq, run again: another attempt's end"),
        (final(3, attempt=2), "another seq"),
        (ErrorEvent(request_id=RID, seq=2, code="worker_lost", message="m", attempt=2), "an error after a final"),
    ],
)
def test_a_second_end_on_the_wire_fails_whatever_its_seq(second: Event, why: str) -> None:
    problems, lost, duplicated = check(run_of(LOGGED), LOGGED, [*LOGGED, second], EXPECTED)
    assert duplicated and not lost, why
    assert any("2 ends on the wire" in problem for problem in problems), problems


def test_a_handle_that_delivered_two_ends_fails() -> None:
    problems, _, duplicated = check(run_of([*LOGGED, final(3, attempt=2)]), LOGGED, LOGGED, EXPECTED)
    assert duplicated
    assert any("the handle delivered 2 ends" in problem for problem in problems), problems


def test_a_log_that_holds_two_ends_fails() -> None:
    logged = [*LOGGED, final(3, attempt=2)]
    problems, _, duplicated = check(run_of(logged), logged, logged, EXPECTED)
    assert duplicated and any("2 terminal events" in problem for problem in problems), problems


def test_a_chunk_published_twice_fails() -> None:
    problems, _, duplicated = check(run_of(LOGGED), LOGGED, [LOGGED[0], *LOGGED], EXPECTED)
    assert duplicated and any("events published twice: seqs [0]" in problem for problem in problems), problems


def test_where_a_failover_may_take_writes_back_a_chunk_published_again_as_it_was_passes() -> None:
    """The promoted replica lacked the chunk; its attempt wrote it again, and published it."""
    wire = [LOGGED[0], LOGGED[1], LOGGED[1], LOGGED[2]]
    assert check(run_of(LOGGED), LOGGED, wire, EXPECTED, writes_may_be_lost=True) == ([], False, False)


def test_where_a_failover_may_take_writes_back_a_seq_published_with_other_contents_still_fails() -> None:
    wire = [LOGGED[0], chunk(1, "c", 3, attempt=2), *LOGGED[1:]]
    problems, _, duplicated = check(run_of(LOGGED), LOGGED, wire, EXPECTED, writes_may_be_lost=True)
    assert duplicated and any("published events that the log does not hold" in p for p in problems), problems


async def test_the_sharded_witness_records_past_a_requests_first_end() -> None:
    """The cluster soak's witness follows each request's sharded channel: it must still be
    listening when a second end comes, or the check could not see one."""
    with RedisCluster(primaries=1, replicas_per_primary=0) as cluster:
        witness = ShardedEventWitness(cluster.url)
        await witness.start()
        [port] = cluster.primary_ports()
        primary = aioredis.Redis(port=port)
        try:
            await witness.follow(RID)
            for event in [*LOGGED, final(2, attempt=2)]:
                await primary.execute_command("SPUBLISH", CLUSTER.events(RID), encode_event(event))
            async with asyncio.timeout(5):
                while len(witness.events.get(RID, [])) < len(LOGGED) + 1:
                    await asyncio.sleep(0.02)
        finally:
            await witness.stop()
            await primary.aclose()
        wire = [decode_event(json.dumps(seen.event)) for seen in witness.events[RID]]
        problems, _, duplicated = check(run_of(LOGGED), LOGGED, wire, EXPECTED)
        assert duplicated and any("2 ends on the wire" in problem for problem in problems), problems
