"""The processes of the Redis capacity run: publishers that play workers' flushes, and
subscribers that follow every request as clients do.

``publish``: simulated workers, each an asyncio task with its own connection, each holding
``--requests-per-worker`` running requests. A worker's flush carries one chunk event per running
request (``--tokens-per-event`` tokens each, as a worker that merges the tokens waiting while its
previous flush was in flight), sent with ``ReplayLog.append`` (the ``append_and_publish`` script,
owner keys, the deployed log bounds) as soon as the previous flush returned: a worker whose engine
outruns Redis. ``--grouping`` splits each flush into several pipelined calls, as a Redis Cluster
needs (``GROUPINGS``). A request ends after ``--output-len`` tokens with its final event, and the slot
starts the next request (a new id: new log, owner key and channel).

``subscribe``: one ``EventSubscriber`` (one pub/sub connection) per process, following its share of
the slots, each subscribed two requests ahead; every event is decoded and checked for gaps as a
client's handle does. A request starts only once its channel is followed, as a client subscribes
before it enqueues: the subscriber pushes ``<slot>:<request>`` to the worker's ready list, which
the publisher reads every 8 flushes or when a slot waits (an RPUSH per request and an LPOP per
few flushes: per-request work, like the enqueue it stands for, counted in Redis's CPU).

With ``--events-url`` (a ``redis+cluster://`` URL) the logs and channels are a Redis Cluster's,
as a deployment with ``$STREAMQ_EVENTS_REDIS_URL`` has them: the publishers' flushes split by
bucket and pipelined per shard (``ReplayLog`` on the cluster), the subscribers follow with the
``ShardedEventSubscriber``; ``--redis-url`` then carries only the ready lists.

Both print ``ready`` once set up and write their counts over the measurement window as JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
import zlib
from collections import deque
from dataclasses import asdict, dataclass
from pathlib import Path

from redis.asyncio import Redis

from producer.sharded_subscriber import ShardedEventSubscriber
from producer.subscriber import EventSubscriber, Inbox
from streamq.broker.cluster import connect_cluster
from streamq.broker.data_plane import DataRedis, names_of
from streamq.broker.replay_log import LogEvent, ReplayLog
from streamq.protocol import ChunkEvent, ErrorEvent, FinalEvent, decode_event, encode_event

PROMPT_TOKENS = 32
TOKEN_TEXT = " tok"
"""Four characters per token, about what an English BPE token decodes to."""


def request_id(run: str, worker: int, slot: int, generation: int) -> str:
    """The id of ``generation``-th request of a worker's slot: known to both sides in advance."""
    return f"{run}-w{worker}-r{slot}-g{generation}"


def ready_key(run: str, worker: int) -> str:
    """A list of ``<slot>:<generation>`` a subscriber pushes once it follows that request."""
    return f"{run}:ready:w{worker}"


GROUPINGS = ("flush", "request", "buckets-<B>")
"""How a flush is split into script calls: one call for the whole flush (one Redis, today);
one per request, pipelined (a Redis Cluster with a hash tag per request: a call may touch one
slot only); one per bucket of requests, pipelined (a hash tag per bucket, ``crc32(id) mod B``)."""


def group_by(events: list[LogEvent], grouping: str) -> list[list[LogEvent]]:
    """``events`` split into script calls as ``grouping`` (``GROUPINGS``) says, each request's
    events in order."""
    buckets = 0 if grouping == "request" else grouping_buckets(grouping)
    groups: dict[object, list[LogEvent]] = {}
    for event in events:
        key = zlib.crc32(event.request_id.encode()) % buckets if buckets else event.request_id
        groups.setdefault(key, []).append(event)
    return list(groups.values())


def grouping_buckets(grouping: str) -> int:
    """B of ``buckets-<B>``; ``ValueError`` for a grouping that is none of ``GROUPINGS``."""
    name, _, count = grouping.partition("-")
    if name != "buckets" or not count.isdigit() or int(count) < 1:
        raise ValueError(f"grouping must be one of {', '.join(GROUPINGS)}; got {grouping!r}")
    return int(count)


def grouping_argument(value: str) -> str:
    """An argparse ``type`` for a grouping."""
    if value not in ("flush", "request"):
        try:
            grouping_buckets(value)
        except ValueError as error:
            raise argparse.ArgumentTypeError(str(error)) from None
    return value


def first_request_tokens(slot: int, requests_per_worker: int, output_len: int) -> int:
    """Tokens of a slot's first request: starts are staggered, so that requests end (and new
    channels are subscribed) evenly over time rather than all at once."""
    return output_len - (slot * output_len) // requests_per_worker


def slots_of(subscriber: int, subscribers: int, workers: int, requests_per_worker: int) -> list[tuple[int, int]]:
    """The (worker, slot) pairs that subscriber process ``subscriber`` follows."""
    every = [(w, r) for w in range(workers) for r in range(requests_per_worker)]
    return every[subscriber::subscribers]


@dataclass
class Counts:
    """Cumulative counters of one process."""

    flushes: int = 0
    events: int = 0
    tokens: int = 0
    requests_ended: int = 0
    skipped: int = 0
    """Publisher: events the log refused (must stay 0). Subscriber: gaps in a request's seq."""
    resyncs: int = 0

    def minus(self, earlier: Counts) -> Counts:
        return Counts(**{name: getattr(self, name) - getattr(earlier, name) for name in asdict(self)})


@dataclass
class Window:
    """When the measurement starts and ends (``time.time()``), shared by every process."""

    start: float
    end: float
    stop: float
    """When to stop sending (publishers) or following (subscribers): after ``end``."""


async def snapshot_at(counts: Counts, window: Window) -> tuple[Counts, Counts]:
    """Copies of ``counts`` at the window's start and end."""
    await asyncio.sleep(max(0.0, window.start - time.time()))
    first = Counts(**asdict(counts))
    await asyncio.sleep(max(0.0, window.end - time.time()))
    return first, Counts(**asdict(counts))


class SimulatedWorker:
    """One worker's running requests and its flush loop."""

    def __init__(self, worker: int, args: argparse.Namespace, log: ReplayLog, counts: Counts) -> None:
        self.worker = worker
        self.args = args
        self.log = log
        self.counts = counts
        self.generation = [0] * args.requests_per_worker
        self.seq = [0] * args.requests_per_worker
        self.sent = [0] * args.requests_per_worker
        self.length = [
            first_request_tokens(slot, args.requests_per_worker, args.output_len)
            for slot in range(args.requests_per_worker)
        ]
        self.ready = [-1] * args.requests_per_worker
        """Per slot, the newest request whose channel a subscriber follows: a request starts
        only once it is followed, as a client subscribes before it enqueues."""
        self.ready_key = ready_key(args.run, worker)

    def batch(self) -> tuple[list[LogEvent], int, int]:
        """The next flush: one chunk per running request; a request that reaches its length
        gets its final event too and its slot moves to the next request."""
        k, events, tokens, ended = self.args.tokens_per_event, [], 0, 0
        for slot in range(self.args.requests_per_worker):
            if self.generation[slot] > self.ready[slot]:
                continue
            rid = request_id(self.args.run, self.worker, slot, self.generation[slot])
            n = min(k, self.length[slot] - self.sent[slot])
            self.sent[slot] += n
            tokens += n
            done = self.sent[slot] >= self.length[slot]
            first_id = 100 + (self.seq[slot] * k) % 30000
            chunk = ChunkEvent(
                request_id=rid,
                seq=self.seq[slot],
                text=TOKEN_TEXT * n,
                token_ids=list(range(first_id, first_id + n)),
                finish_reason="length" if done else None,
            )
            events.append(LogEvent(rid, self.seq[slot], 1, encode_event(chunk)))
            self.seq[slot] += 1
            if done:
                final = FinalEvent(
                    request_id=rid,
                    seq=self.seq[slot],
                    finish_reasons=["length"],
                    prompt_tokens=PROMPT_TOKENS,
                    completion_tokens=self.length[slot],
                )
                events.append(LogEvent(rid, self.seq[slot], 1, encode_event(final), terminal=True))
                self.generation[slot] += 1
                self.seq[slot] = self.sent[slot] = 0
                self.length[slot] = self.args.output_len
                ended += 1
        return events, tokens, ended

    async def take_ready(self, redis: Redis) -> None:
        """Read which requests the subscribers follow now."""
        popped = await redis.lpop(self.ready_key, 100_000)  # type: ignore[misc]
        for entry in popped or ():
            slot, generation = (int(x) for x in entry.split(b":"))
            self.ready[slot] = max(self.ready[slot], generation)

    async def run(self, redis: Redis, window: Window) -> None:
        flushes = 0
        while time.time() < window.stop:
            blocked = any(g > r for g, r in zip(self.generation, self.ready, strict=True))
            if blocked or flushes % 8 == 0:
                await self.take_ready(redis)
            flushes += 1
            events, tokens, ended = self.batch()
            if not events:
                await asyncio.sleep(0.001)
                continue
            if self.args.grouping == "flush":
                appended = await self.log.append(events)
            else:
                appended = await self.log.append_groups(group_by(events, self.args.grouping))
            self.counts.flushes += 1
            self.counts.events += len(events)
            self.counts.tokens += tokens
            self.counts.requests_ended += ended
            self.counts.skipped += appended.skipped + len(appended.superseded)


async def data_plane(args: argparse.Namespace, control: Redis) -> DataRedis:
    """Where the logs and channels are: the cluster of ``--events-url``, else ``control``."""
    return control if args.events_url is None else await connect_cluster(args.events_url)


async def publish(args: argparse.Namespace, window: Window) -> dict[str, object]:
    counts = Counts()
    connections = [Redis.from_url(args.redis_url) for _ in range(args.workers)]
    planes = [await data_plane(args, connection) for connection in connections]
    try:
        workers = [
            SimulatedWorker(args.first_worker + i, args, ReplayLog(plane), counts) for i, plane in enumerate(planes)
        ]
        await asyncio.gather(*(connection.ping() for connection in connections))
        await asyncio.sleep(max(0.0, window.start - args.warmup - time.time()))
        sampler = asyncio.create_task(snapshot_at(counts, window))
        await asyncio.gather(*(w.run(c, window) for w, c in zip(workers, connections, strict=True)))
        first, last = await sampler
    finally:
        await asyncio.gather(*(plane.aclose() for plane in planes if plane not in connections))
        await asyncio.gather(*(connection.aclose() for connection in connections))
    return asdict(last.minus(first))


Subscriber = EventSubscriber | ShardedEventSubscriber


async def follow_slot(
    subscriber: Subscriber,
    redis: Redis,
    log: ReplayLog,
    args: argparse.Namespace,
    worker: int,
    slot: int,
    counts: Counts,
    subscribed: list[int],
) -> None:
    """Follow a slot's requests one after another, each subscribed two requests ahead
    (``subscribed`` counts the subscriptions confirmed)."""
    generation = 0
    names = log.names

    async def subscribe(n: int) -> Inbox:
        queue = await subscriber.subscribe(names.events(request_id(args.run, worker, slot, n)))
        subscribed[0] += 1
        await redis.rpush(ready_key(args.run, worker), f"{slot}:{n}")  # type: ignore[misc]
        return queue

    queues = deque([await subscribe(0), await subscribe(1)])
    while True:
        queue, expected = queues[0], 0
        while True:
            item = await queue.get()  # no silence bound: never None
            if isinstance(item, BaseException):
                raise item
            if not isinstance(item, bytes):
                counts.resyncs += 1
                continue
            event = decode_event(item)
            if event.seq != expected:
                counts.skipped += 1
            expected = event.seq + 1
            counts.events += 1
            if isinstance(event, ChunkEvent):
                counts.tokens += len(event.token_ids)
            elif isinstance(event, (FinalEvent, ErrorEvent)):
                break
        counts.requests_ended += 1
        channel = names.events(request_id(args.run, worker, slot, generation))
        await subscriber.unsubscribe(channel, queue)
        queues.popleft()
        queues.append(await subscribe(generation + 2))
        generation += 1


async def subscribe(args: argparse.Namespace) -> dict[str, object]:
    counts = Counts()
    redis = Redis.from_url(args.redis_url)
    plane = await data_plane(args, redis)
    log = ReplayLog(plane)
    subscriber: Subscriber = (
        EventSubscriber(redis) if not names_of(plane).sharded else ShardedEventSubscriber(plane)  # type: ignore[arg-type]
    )
    slots = slots_of(args.index, args.subscribers, args.total_workers, args.requests_per_worker)
    subscribed = [0]
    try:
        followers = [
            asyncio.create_task(follow_slot(subscriber, redis, log, args, w, r, counts, subscribed)) for w, r in slots
        ]
        # Every slot's first two channels are subscribed before the publishers are told to start.
        while subscribed[0] < 2 * len(slots):
            await asyncio.sleep(0.05)
        print("ready", flush=True)
        line = await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
        window = Window(**json.loads(line))
        first, last = await snapshot_at(counts, window)
        await asyncio.sleep(max(0.0, window.stop - time.time()))
        pending = set(followers)
        while pending:
            # Cancelled again until done: on Python 3.11, a cancel that lands as a subscription
            # is confirmed can be lost inside asyncio.wait_for.
            for follower in pending:
                follower.cancel()
            _, pending = await asyncio.wait(pending, timeout=1)
        failures = [
            r
            for r in await asyncio.gather(*followers, return_exceptions=True)
            if isinstance(r, BaseException) and not isinstance(r, asyncio.CancelledError)
        ]
        for failure in failures[:3]:
            print(f"follower failed: {failure!r}", flush=True)
    finally:
        await subscriber.close()
        if plane is not redis:
            await plane.aclose()
        await redis.aclose()
    result = asdict(last.minus(first))
    result["failures"] = len(failures)
    return result


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("role", choices=["publish", "subscribe"])
    parser.add_argument("--redis-url", required=True)
    parser.add_argument("--events-url", help="a Redis Cluster carrying the logs and channels (redis+cluster://)")
    parser.add_argument("--run", required=True, help="prefix of the request ids")
    parser.add_argument("--requests-per-worker", type=int, required=True)
    parser.add_argument("--tokens-per-event", type=int, required=True)
    parser.add_argument("--output-len", type=int, required=True)
    parser.add_argument("--grouping", type=grouping_argument, default="flush", help="one of " + ", ".join(GROUPINGS))
    parser.add_argument("--out", type=Path, required=True)
    group = parser.add_argument_group("publish")
    group.add_argument("--workers", type=int, default=1, help="simulated workers in this process")
    group.add_argument("--first-worker", type=int, default=0)
    group.add_argument("--window", help="JSON of Window")
    group.add_argument("--warmup", type=float, default=0.0)
    group = parser.add_argument_group("subscribe")
    group.add_argument("--index", type=int, default=0)
    group.add_argument("--subscribers", type=int, default=1)
    group.add_argument("--total-workers", type=int, default=1)
    return parser


def main() -> None:
    args = build_parser().parse_args()
    if args.role == "publish":
        window = Window(**json.loads(args.window))
        print("ready", flush=True)
        result = asyncio.run(publish(args, window))
    else:
        result = asyncio.run(subscribe(args))
    args.out.write_text(json.dumps(result))


if __name__ == "__main__":
    main()
