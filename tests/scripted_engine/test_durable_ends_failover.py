"""Durable ends in a real ``python -m worker`` (the scripted engine) and the producer library,
each as its own ACL user, on a primary with a replica: the worker says at start-up what an
end waits for and writes it to ``streamq:durability``; a request's end reaches its client
only once the replica has it; a producer's end of a request it takes off its queue waits as
the record says.

Then the faults the waits are for, on a deployment whose replica replicates through a
``FreezingProxy`` that Sentinel also monitors the primary through (so that Sentinel leaves
the replica's link alone, and ``freeze(replication_only=True)`` stalls that link alone):

- the link stalled, no failover: each end is held past its bound, and told once the
  primary stops counting the replica (``repl-timeout``); the worker logs the shortfall,
  naming the replica and its lag; each callback is POSTed once;
- the link stalled and the primary SIGKILLed while the ends are held, Sentinel taking
  longer to promote the replica than an end's bound (the worker's default flags): the
  promoted replica never saw those ends. Every request still ends once in every
  subscriber's eyes (the wire, each handle) and its callback is POSTed once. The same run
  with ``--durable-ends off`` shows what the waits prevent: ends told before the kill, and
  then a second end on the wire or a second POST, as the promoted replica runs the requests
  again.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import pytest
import redis
import redis.asyncio as aioredis

from devkit.chaos import EventWitness
from devkit.redis_server import FreezingProxy, RedisServer, SentinelServer
from devkit.worker_process import WorkerProcess, scripted_worker
from producer.client import RequestHandle, StreamqClient
from producer.errors import MissingEvents
from streamq.protocol import IN_PROGRESS_PREFIX, RESULT_KEY_PREFIX, ErrorEvent, Event, FinalEvent, events_channel
from streamq.protocol.names import DURABILITY_KEY
from streamq.protocol.roles import PRODUCER, WORKER, Role
from tests.support.callback_receiver import CallbackReceiver

MASTER = "streamq-durable"
TERMINAL_TYPES = ("final", "error")


@dataclass
class Deployment:
    """A primary whose replica replicates through ``proxy``; with ``sentinel``, a Sentinel
    monitoring the primary at the proxy's address (so the URLs it gives name the proxy)."""

    primary: RedisServer
    replica: RedisServer
    proxy: FreezingProxy
    sentinel: SentinelServer | None = None

    def url(self, role: Role | None = None) -> str:
        """The ``redis+sentinel://`` URL of ``role``'s user (``None``: the harness's own)."""
        assert self.sentinel is not None
        if role is None:
            auth = f"{self.primary.user}:{self.primary.password}"
        else:
            auth = f"{role.user}:{self.primary.role_passwords[role.name]}"
        return f"redis+sentinel://{auth}@127.0.0.1:{self.sentinel.port}/{MASTER}"

    def stall(self) -> None:
        """Freeze the replication link: the replica sees nothing more, the primary still
        lists it online, its lag rising (until ``repl-timeout``, 60 s)."""
        self.proxy.freeze(replication_only=True)


def wait_online(primary: RedisServer, timeout_s: float = 20.0) -> None:
    admin = redis.Redis.from_url(primary.url)
    try:
        deadline = time.monotonic() + timeout_s
        while admin.info("replication").get("slave0", {}).get("state") != "online":
            assert time.monotonic() < deadline, "the replica did not come online"
            time.sleep(0.05)
    finally:
        admin.close()


FAILOVER_DOWN_AFTER_MS = 7000
"""How long Sentinel takes to call the primary down: longer than an end's default bound
(``DEFAULT_DURABLE_ENDS_TIMEOUT_S``, 5 s), so the ends are held past it."""


@contextlib.contextmanager
def deployed(*, sentinel: bool) -> Iterator[Deployment]:
    password = uuid.uuid4().hex
    with RedisServer(user="streamq", password=password) as primary, FreezingProxy(primary.port) as proxy:
        admin = redis.Redis.from_url(primary.url)
        admin.config_set("repl-diskless-sync-delay", 0)  # the replica syncs at once
        admin.close()
        with RedisServer(user="streamq", password=password, replica_of=primary, master_port=proxy.port) as replica:
            wait_online(primary)
            if not sentinel:
                yield Deployment(primary, replica, proxy)
                return
            watcher = SentinelServer(primary, MASTER, monitored_port=proxy.port, down_after_ms=FAILOVER_DOWN_AFTER_MS)
            try:
                watcher.start().wait_until(lambda state: int(state["num-slaves"]) == 1)
                yield Deployment(primary, replica, proxy, watcher)
            finally:
                watcher.stop()


@pytest.fixture
def replicated() -> Iterator[tuple[RedisServer, RedisServer]]:
    with deployed(sentinel=False) as deployment:
        yield deployment.primary, deployment.replica


@pytest.fixture
def watched() -> Iterator[Deployment]:
    with deployed(sentinel=True) as deployment:
        yield deployment


def wait_calls(admin: redis.Redis) -> int:
    return int(admin.info("commandstats").get("cmdstat_wait", {}).get("calls", 0))


async def test_an_end_is_told_once_the_replica_has_it(
    replicated: tuple[RedisServer, RedisServer], tmp_path: Path
) -> None:
    primary, replica = replicated
    log_path = tmp_path / "worker.log"
    worker = scripted_worker(primary.url_for(WORKER), log_path, "--durable-ends-timeout-s", "2", ready_url=primary.url)
    worker.start().wait_ready(timeout_s=120)
    admin = redis.Redis.from_url(primary.url)
    at_replica = redis.Redis.from_url(replica.url)
    try:
        assert "durable ends (auto): each end waits for 1 replica (WAIT), at most 2s" in log_path.read_text()
        record = msgspec.json.decode(admin.get(DURABILITY_KEY))
        assert record["data"] == record["control"] == {"replicas": 1, "fsync": False}
        before = wait_calls(admin)
        async with await StreamqClient.connect(primary.url_for(PRODUCER), queue=worker.queue) as client:
            completion = await (await client.submit("hello", max_tokens=5)).result()
            assert completion.completion_tokens == 5
            # the client has the final: the replica had it first
            logged = at_replica.xrange(events_channel(completion.request_id))
            assert b'"type":"final"' in logged[-1][1][b"event"]
            assert wait_calls(admin) > before
        # a producer ends a request it takes off a queue nobody serves: it waits as the record says
        parked = f"streamq:queue:parked-{uuid.uuid4().hex[:8]}"
        async with await StreamqClient.connect(primary.url_for(PRODUCER), queue=parked) as client:
            handle = await client.submit("never run")
            before = wait_calls(admin)
            assert await client.cancel(handle.request_id, queue=parked) == "queued"
            assert wait_calls(admin) > before
            assert b'"cancelled"' in at_replica.xrange(events_channel(handle.request_id))[-1][1][b"event"]
            await handle.close()
    finally:
        admin.close()
        at_replica.close()
        assert worker.stop() == 0, worker.log_tail()


# --- a stalled replica, and a failover in the stall -------------------------------------------


@dataclass
class Followed:
    """One request of a run: its handle's events (with when each arrived) and how it ended."""

    handle: RequestHandle
    streamed: bool
    path: str
    """Its callback's path at the receiver."""
    events: list[tuple[float, Event]] = field(default_factory=list)
    error: BaseException | None = None
    task: asyncio.Task[None] | None = None

    @property
    def request_id(self) -> str:
        return self.handle.request_id

    def start(self) -> None:
        self.task = asyncio.create_task(self._collect())

    async def _collect(self) -> None:
        try:
            async for event in self.handle:
                self.events.append((time.monotonic(), event))
        except MissingEvents as exc:  # events it delivered were lost with the primary: allowed
            self.error = exc

    def ends(self) -> list[Event]:
        return [event for _, event in self.events if isinstance(event, FinalEvent | ErrorEvent)]


def wire_ends(witness: EventWitness, request_id: str) -> list[dict[str, Any]]:
    """``request_id``'s terminal events as they crossed the wire, an identical re-publication
    (same seq, same fields: a take-over that confirms a logged end publishes it again)
    counted once; any other, whatever its seq, is a second end."""
    distinct: list[dict[str, Any]] = []
    for seen in witness.events.get(request_id, []):
        if seen.event.get("type") in TERMINAL_TYPES and seen.event not in distinct:
            distinct.append(seen.event)
    return distinct


def ends_more_than_once(followed: list[Followed], witness: EventWitness, receiver: CallbackReceiver) -> list[str]:
    """What shows a request that ended more than once: a second end on the wire, a handle
    that delivered two ends (or neither an end nor ``MissingEvents``), a second POST."""
    problems = []
    for request in followed:
        rid = request.request_id
        on_wire = wire_ends(witness, rid)
        if len(on_wire) > 1:
            problems.append(f"{rid}: {len(on_wire)} ends on the wire: {[(e['seq'], e['type']) for e in on_wire]}")
        ends = request.ends()
        if len(ends) > 1:
            problems.append(f"{rid}: its handle delivered {len(ends)} ends")
        elif not ends and request.error is None:
            problems.append(f"{rid}: its handle delivered no end and raised nothing")
        posts = receiver.received(request.path)
        if len(posts) != 1:
            problems.append(f"{rid}: its callback was POSTed {len(posts)} times")
        if any(msgspec.json.decode(post.body)["request_id"] != rid for post in posts):
            problems.append(f"{rid}: a POST for another request")
    return problems


async def logged_end(admin: aioredis.Redis, request_id: str) -> bool:
    """The request's log (at ``admin``'s server) ends with a terminal event."""
    last = await admin.xrevrange(events_channel(request_id), count=1)
    return bool(last) and any(f'"type":"{kind}"'.encode() in last[0][1][b"event"] for kind in TERMINAL_TYPES)


async def until(check: Any, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not await check():
        assert time.monotonic() < deadline, f"not within {timeout_s:g}s: {what}"
        await asyncio.sleep(0.02)


def worker_for(deployment: Deployment, tmp_path: Path, durable_ends: str) -> WorkerProcess:
    """A scripted worker, as the worker's user, that finds the primary through Sentinel;
    its ends' bound the default."""
    flags = ["--durable-ends", durable_ends, "--callback-backoff-s", "0.5"]
    return scripted_worker(deployment.url(WORKER), tmp_path / "worker.log", *flags, ready_url=deployment.primary.url)


async def submitted(
    client: StreamqClient, receiver: CallbackReceiver, count: int, tokens: int, admin: aioredis.Redis
) -> list[Followed]:
    """``count`` requests of ``tokens`` tokens (every other one ``stream=False``), each with a
    callback, followed by their handles; returned once each runs (its lease held at the
    primary) and each streamed one has sent tokens."""
    followed = []
    for index in range(count):
        path = f"/{uuid.uuid4().hex}"
        streamed = index % 2 == 0
        handle = await client.submit(
            f"request {index}", max_tokens=tokens, stream=streamed, callback={"url": receiver.url(path)}
        )
        followed.append(Followed(handle, streamed, path))
    for request in followed:
        request.start()

    async def running() -> bool:
        leases = await admin.exists(*(IN_PROGRESS_PREFIX + r.request_id for r in followed))
        return leases == len(followed) and all(r.events for r in followed if r.streamed)

    await until(running, 30, "every request running")
    return followed


@dataclass
class Stalled:
    """Requests running on a worker of ``deployment`` whose replication link is now frozen,
    and what watches them: the primary (``admin``), the wire, the callbacks' receiver."""

    worker: WorkerProcess
    admin: aioredis.Redis
    witness: EventWitness
    receiver: CallbackReceiver
    followed: list[Followed]


@contextlib.asynccontextmanager
async def stalled_requests(
    deployment: Deployment, tmp_path: Path, durable_ends: str, count: int, tokens: int
) -> AsyncIterator[Stalled]:
    """A worker (``--durable-ends durable_ends``), ``count`` requests of ``tokens`` tokens
    submitted and running, none ended yet; then the link frozen. The worker is stopped on
    leaving (and must exit cleanly)."""
    worker = worker_for(deployment, tmp_path, durable_ends).start()
    worker.wait_ready(timeout_s=120)
    admin = aioredis.Redis.from_url(deployment.primary.url)
    witness = EventWitness(deployment.url())
    await witness.start()
    try:
        with CallbackReceiver() as receiver:
            async with await StreamqClient.connect(deployment.url(PRODUCER), queue=worker.queue) as client:
                followed = await submitted(client, receiver, count, tokens, admin)
                assert not [r for r in followed if await logged_end(admin, r.request_id)], "ended before the stall"
                deployment.stall()
                yield Stalled(worker, admin, witness, receiver, followed)
    finally:
        await witness.stop()
        await admin.aclose()
        assert worker.stop() == 0, worker.log_tail()


REPL_TIMEOUT_S = 8
"""The stalled-link test's primary stops counting a replica it has not heard from this long:
past an end's default bound (5 s), so the first shortfall finds the replica still listed."""


async def test_an_end_is_held_while_its_replica_is_stalled_and_told_once_the_primary_drops_it(
    watched: Deployment, tmp_path: Path
) -> None:
    """The replication link frozen, no failover, the worker's default flags: each end is
    held past its bound (not told: not durable yet), and told once the primary stops
    counting the replica (``repl-timeout``), once (the wire, the handle); each callback is
    POSTed once; the worker logs the shortfall once for the episode, naming the replica and
    its lag, and what ends wait for once the replica is gone."""
    admin = redis.Redis.from_url(watched.primary.url)
    admin.config_set("repl-timeout", REPL_TIMEOUT_S)
    admin.close()
    async with stalled_requests(watched, tmp_path, "auto", 2, 100) as run:
        stalled_at = time.monotonic()
        witness, receiver, followed = run.witness, run.receiver, run.followed
        async with asyncio.timeout(60):
            await asyncio.gather(*(r.task for r in followed if r.task is not None))
        for request in followed:
            [(told_at, _)] = [(at, e) for at, e in request.events if isinstance(e, FinalEvent)]
            after = told_at - stalled_at  # its end was logged within a second of the stall
            assert after >= REPL_TIMEOUT_S, f"{request.request_id}: told {after:.2f}s after the stall"
        for request in followed:
            await asyncio.to_thread(receiver.wait, request.path, 1, 30)
        await asyncio.sleep(2)  # a second POST would come within this
        assert ends_more_than_once(followed, witness, receiver) == []
        assert all(len(wire_ends(witness, r.request_id)) == 1 for r in followed)
        log = run.worker.log_path.read_text()
        held = [line for line in log.splitlines() if "is not durable yet" in line]
        assert len(held) == 1, held  # once for the episode, whatever ends fell short
        assert "0 of 1 replicas acknowledged it within 5s" in held[0], held[0]
        assert re.search(rf"replicas online: 127\.0\.0\.1:{watched.replica.port} lag \d+s", held[0]), held
        assert "durable ends (auto) now: no replica" in log


REQUESTS = 6
TOKENS = 200
"""Two seconds at the scripted engine's 100 tokens/s: each request ends after the stall (below the
worker's 256-token checkpoints: the requests not streamed send nothing before their end)."""


@dataclass
class FailoverRun:
    followed: list[Followed]
    told_before_kill: dict[str, int]
    """Ends each request had on the wire when the primary was killed."""
    problems: list[str]
    log: str


async def fail_over_while_ends_wait(deployment: Deployment, tmp_path: Path, durable_ends: str) -> FailoverRun:
    """Requests run; the replication link freezes; they end (at the primary); the primary is
    SIGKILLed; Sentinel promotes the replica, which lacks everything since the stall; every
    request is then followed to its job's end at the new primary, and its callback's POST."""
    assert deployment.sentinel is not None
    promoted = aioredis.Redis.from_url(deployment.replica.url)
    try:
        async with stalled_requests(deployment, tmp_path, durable_ends, REQUESTS, TOKENS) as run:
            admin, witness, receiver, followed = run.admin, run.witness, run.receiver, run.followed
            ids = [r.request_id for r in followed]

            async def one_logged() -> bool:
                return any([await logged_end(admin, rid) for rid in ids])

            await until(one_logged, 15, "an end logged at the primary")
            # The requests run in step: the others end within this (one confirmation is in
            # flight at a time: an end that comes while one waits is logged after it), and
            # without durable ends their callbacks are POSTed.
            await asyncio.sleep(1.5)
            logged = sum([await logged_end(admin, rid) for rid in ids])
            told_before_kill = {rid: len(wire_ends(witness, rid)) for rid in ids}
            deployment.primary.kill()
            print(f"{durable_ends}: {logged} of {len(ids)} ends logged at the primary as it was killed")
            killed = time.monotonic()
            await asyncio.to_thread(
                deployment.sentinel.wait_until, lambda state: int(state["port"]) == deployment.replica.port, 30
            )
            print(f"the replica promoted {time.monotonic() - killed:.1f}s after the kill")
            async with asyncio.timeout(90):
                await asyncio.gather(*(r.task for r in followed if r.task is not None))

            async def all_finished() -> bool:  # at the new primary: the jobs it ran too
                return bool(await promoted.exists(*(RESULT_KEY_PREFIX + rid for rid in ids)) == len(ids))

            await until(all_finished, 90, "every job finished at the new primary")
            for request in followed:
                await asyncio.to_thread(receiver.wait, request.path, 1, 30)
            await asyncio.sleep(3)  # a second POST would come within this
            problems = ends_more_than_once(followed, witness, receiver)
            return FailoverRun(followed, told_before_kill, problems, run.worker.log_path.read_text())
    finally:
        await promoted.aclose()


async def test_a_failover_while_ends_wait_for_a_stalled_replica_ends_each_request_once(
    watched: Deployment, tmp_path: Path
) -> None:
    """``--durable-ends auto`` with the default bound (5 s), Sentinel taking 7 s to call the
    primary down: the ends are held past their bound, so none is told before the primary
    dies, nor after it until the failover; the promoted replica lacks them (and the tokens since the stall), and
    the requests end there, once each: at most one end on the wire per request, each handle
    one end (or ``MissingEvents``, having delivered tokens the failover lost), one POST per
    callback."""
    run = await fail_over_while_ends_wait(watched, tmp_path, "auto")
    assert run.told_before_kill == dict.fromkeys(run.told_before_kill, 0), run.told_before_kill
    assert run.problems == [], "\n".join(run.problems) + "\n" + run.log[-4000:]
    assert all(r.ends() for r in run.followed if not r.streamed)  # nothing delivered before: nothing to lose
    print(f"handles that raised MissingEvents: {sum(r.error is not None for r in run.followed)} of {REQUESTS}")


async def test_without_durable_ends_the_same_failover_ends_requests_twice(watched: Deployment, tmp_path: Path) -> None:
    """The same run with ``--durable-ends off``: what the waits prevent. Each end is told as
    soon as the primary has it; the promoted replica lacks it and its request runs again, so
    the request ends a second time (on the wire, or by a second POST of its callback)."""
    run = await fail_over_while_ends_wait(watched, tmp_path, "off")
    assert all(count == 1 for count in run.told_before_kill.values()), run.told_before_kill
    assert run.problems, "no request ended twice: the failover test cannot tell durable ends from none"
    print("without durable ends:\n" + "\n".join(run.problems))
