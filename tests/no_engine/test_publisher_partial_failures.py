"""The publisher when a batch partly fails, as on a Redis Cluster with a shard away: the
events that were not logged go out again, in order, with the next batch; the requests whose
events were logged are not held up; a request whose events keep failing past the retry
budget fails alone. And which Redis replies count as passing (sent again) or final."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import pytest
from redis._parsers.base import BaseParser
from redis.asyncio.cluster import ClusterParser
from redis.exceptions import ConnectionError as RedisConnectionError

from streamq.broker.replay_log import Appended, LogEvent
from worker.publisher import EventPublisher, PublishFailed, is_transient


class ShardAway:
    """A stand-in for a cluster's ``ReplayLog``: the events of ``failing`` requests are not
    logged (returned as unsent) while ``down``; every other event is, in the order sent."""

    def __init__(self, failing: str) -> None:
        self.failing = failing
        self.down = True
        self.logged: list[tuple[str, int]] = []
        self.durability = None  # ends wait for nothing: they go the one way

    async def append(self, events: Sequence[LogEvent]) -> Appended:
        await asyncio.sleep(0.01)
        unsent = tuple(e for e in events if self.down and e.request_id == self.failing)
        self.logged += [(e.request_id, e.seq) for e in events if e not in unsent]
        error = RedisConnectionError("shard away") if unsent else None
        return Appended(0, unsent=unsent, error=error)


async def test_a_failing_shard_holds_up_only_its_own_requests_and_its_events_go_out_in_order() -> None:
    log = ShardAway(failing="doomed")
    publisher = EventPublisher(log, retry_for_s=30, retry_delay_s=0.01)  # type: ignore[arg-type]
    publisher.start()
    try:
        for seq in range(3):
            publisher.publish("doomed", seq, 1, b"d%d" % seq)
            publisher.publish("healthy", seq, 1, b"h%d" % seq)
        healthy, doomed = publisher.flushed("healthy"), publisher.flushed("doomed")
        await asyncio.wait_for(healthy, timeout=5)
        assert [seq for request, seq in log.logged if request == "healthy"] == [0, 1, 2]
        assert not doomed.done()
        publisher.publish("doomed", 3, 1, b"d3")  # published while its earlier events wait
        await asyncio.sleep(0.1)
        log.down = False
        await asyncio.wait_for(doomed, timeout=5)
        await asyncio.wait_for(publisher.flushed(), timeout=5)
        assert [seq for request, seq in log.logged if request == "doomed"] == [0, 1, 2, 3]
    finally:
        await publisher.close()


async def test_a_request_whose_events_fail_past_the_retry_budget_fails_alone() -> None:
    log = ShardAway(failing="doomed")
    publisher = EventPublisher(log, retry_for_s=0.3, retry_delay_s=0.02)  # type: ignore[arg-type]
    publisher.start()
    try:
        publisher.publish("doomed", 0, 1, b"d0")
        publisher.publish("healthy", 0, 1, b"h0")
        doomed = publisher.flushed("doomed")
        with pytest.raises(PublishFailed, match="could not publish"):
            await asyncio.wait_for(doomed, timeout=5)
        publisher.publish("healthy", 1, 1, b"h1")
        await asyncio.wait_for(publisher.flushed("healthy"), timeout=5)
        assert [seq for request, seq in log.logged if request == "healthy"] == [0, 1]
        assert not [seq for request, seq in log.logged if request == "doomed"]
    finally:
        await publisher.close()


@pytest.mark.parametrize(
    "reply",
    [
        "READONLY You can't write against a read only replica.",
        "OOM command not allowed when used memory > 'maxmemory'.",
        "LOADING Redis is loading the dataset in memory",
        "BUSY Redis is busy running a script.",
        "MASTERDOWN Link with MASTER is down",
        "TRYAGAIN Multiple keys request during rehashing of slot",
        "CLUSTERDOWN The cluster is down",
        # an end's wait on a primary demoted under its connection
        "ERR WAIT cannot be used with replica instances. Please also note that since Redis 4.0 ...",
        "ERR WAITAOF cannot be used with replica instances. Please also note that since Redis 4.0 ...",
    ],
)
def test_replies_that_pass_on_their_own_are_sent_again(reply: str) -> None:
    assert is_transient(BaseParser.parse_error(reply)), reply
    assert is_transient(ClusterParser.parse_error(reply)), reply


@pytest.mark.parametrize("reply", ["MOVED 3999 127.0.0.1:6381", "ASK 3999 127.0.0.1:6381"])
def test_a_cluster_redirect_that_outlived_the_logs_own_following_is_sent_again(reply: str) -> None:
    assert is_transient(ClusterParser.parse_error(reply)), reply


@pytest.mark.parametrize(
    "reply",
    ["NOPERM User has no permissions to run the 'evalsha' command", "WRONGTYPE Operation against a key", "ERR bad"],
)
def test_replies_that_will_not_pass_fail_the_batch(reply: str) -> None:
    assert not is_transient(BaseParser.parse_error(reply)), reply
