"""The data plane on a Redis Cluster: a worker and a client started with
``--events-redis-url``/``events_url`` pointing at a local 3-shard cluster (each primary with a
replica) stream as with one Redis, every request's log and channel on its bucket's shard, and
nothing is lost or repeated while a slot migrates or a primary fails over mid-stream.

Real servers (``devkit.redis_cluster``, ``devkit.redis_server``) and a real worker process on
the scripted engine: what is under test is the queue layer across the two planes.
"""

from __future__ import annotations

import asyncio
import gc
import json
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import redis.asyncio as aioredis

from devkit.redis_cluster import RedisCluster
from devkit.redis_server import RedisServer
from devkit.worker_process import WorkerProcess, scripted_worker
from producer.client import RequestHandle, StreamqClient
from producer.errors import ConnectionFailed, DuplicateRequest
from producer.internal_client import InternalClient
from streamq.broker.cluster import ClusterUnusable
from streamq.broker.worker_stats import WorkerStatsStore
from streamq.protocol import ChunkEvent, Event, FinalEvent, StreamqError, events_channel
from streamq.protocol.names import (
    EVENTS_BUCKET_TAGS,
    events_bucket,
    sharded_events_channel,
    sharded_owner_key,
)
from tests.support.callback_receiver import CallbackReceiver

TOKENS_PER_S = 50  # the scripted engine's pace per request


@pytest.fixture(scope="module", autouse=True)
def no_connection_left_open() -> Iterator[None]:
    """Collect the module's garbage as its last test ends: a connection left open (the
    cluster client's replaced nodes were, ``streamq.broker.cluster._NodesClosedForGood``)
    warns here and fails this module, not whichever later test the collector runs in."""
    yield
    gc.collect()


@pytest.fixture(scope="module")
def cluster() -> Iterator[RedisCluster]:
    with RedisCluster(primaries=3, replicas_per_primary=1) as started:
        yield started


@pytest.fixture(scope="module")
def control() -> Iterator[RedisServer]:
    with RedisServer() as server:
        yield server


@pytest.fixture(scope="module")
def cluster_worker(
    cluster: RedisCluster, control: RedisServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[WorkerProcess]:
    log = tmp_path_factory.mktemp("cluster-worker") / "worker.log"
    worker = scripted_worker(control.url, log, "--events-redis-url", cluster.url, tokens_per_s=TOKENS_PER_S)
    worker.start().wait_ready(timeout_s=120)
    try:
        yield worker
    finally:
        assert worker.stop() == 0, worker.log_tail()


@pytest.fixture
async def client(
    cluster_worker: WorkerProcess, cluster: RedisCluster, control: RedisServer
) -> AsyncIterator[InternalClient]:
    async with await InternalClient.connect(control.url, events_url=cluster.url) as connected:
        yield connected


def ids_on_every_shard(cluster: RedisCluster, per_shard: int) -> list[str]:
    """Request ids, ``per_shard`` of them on each primary of ``cluster``."""
    by_port: dict[int, list[str]] = {port: [] for port in cluster.primary_ports()}
    while min(len(ids) for ids in by_port.values()) < per_shard:
        request_id = uuid.uuid4().hex
        by_port[cluster.primary_of(sharded_events_channel(request_id)).port].append(request_id)
    return [request_id for ids in by_port.values() for request_id in ids[:per_shard]]


def ids_in_bucket(bucket: int, count: int) -> list[str]:
    """``count`` request ids of one bucket (so of one slot)."""
    found: list[str] = []
    while len(found) < count:
        request_id = uuid.uuid4().hex
        if events_bucket(request_id) == bucket:
            found.append(request_id)
    return found


async def streamed(handle: RequestHandle) -> list[Event]:
    return [event async for event in handle]


async def submitted(
    client: InternalClient, prompt: str, request_ids: list[str], max_tokens: int
) -> list[RequestHandle]:
    """One request per id, each running to ``max_tokens``."""
    return [
        await client.submit(prompt, request_id=request_id, max_tokens=max_tokens, ignore_eos=True)
        for request_id in request_ids
    ]


def assert_whole(events: list[Event], tokens: int) -> None:
    """Every event once, in order, one final at the end, every token there."""
    assert [event.seq for event in events] == list(range(len(events)))
    assert sum(isinstance(event, FinalEvent) for event in events) == 1
    final = events[-1]
    assert isinstance(final, FinalEvent) and final.finish_reasons == ["length"], final
    assert sum(len(event.token_ids) for event in events if isinstance(event, ChunkEvent)) == tokens


async def test_requests_on_every_shard_stream_whole_and_their_names_live_on_the_cluster(
    client: InternalClient, cluster: RedisCluster, control: RedisServer
) -> None:
    request_ids = ids_on_every_shard(cluster, 3)
    handles = await submitted(client, "prompt", request_ids, 20)
    streams = await asyncio.wait_for(asyncio.gather(*map(streamed, handles)), timeout=60)
    for events in streams:
        assert_whole(events, 20)
    streamed_count = {handle.request_id: len(events) for handle, events in zip(handles, streams, strict=True)}

    async with aioredis.Redis.from_url(control.url) as plain:
        for request_id in request_ids:
            # the log, the owner key and the channel are the shard's; the control plane keeps none
            shard = cluster.primary_of(sharded_events_channel(request_id))
            async with aioredis.Redis(port=shard.port) as node:
                # one entry per event streamed (deltas waiting behind a flush merge: not one per token)
                assert await node.xlen(sharded_events_channel(request_id)) == streamed_count[request_id]
                assert await node.get(sharded_owner_key(request_id)) == b"ended"
            assert not await plain.exists(events_channel(request_id))
            status = await client.status(request_id)
            assert (status.state, status.completion_tokens) == ("finished", 20)
        ends = await WorkerStatsStore(client.redis, client.data).recent_ends()
        assert set(request_ids) <= {end.request_id for end in ends}

    # the id is reserved on the control plane while its log is kept: no second request with it
    with pytest.raises(DuplicateRequest):
        await client.submit("again", request_id=request_ids[0], max_tokens=2)
    # following an ended request replays its log from the shard
    replayed = await streamed(await client.follow(request_ids[-1]))
    assert_whole(replayed, 20)


async def test_a_queued_request_cancelled_ends_on_its_shard(client: InternalClient) -> None:
    handle = await client.submit("later", max_tokens=5, defer_s=60)
    assert await client.cancel(handle.request_id) == "queued"
    [final] = await asyncio.wait_for(streamed(handle), timeout=20)
    assert isinstance(final, FinalEvent) and final.finish_reasons == ["cancelled"]
    assert (await client.status(handle.request_id)).state == "finished"


async def test_callbacks_of_a_finished_and_of_a_queued_request_cancelled_are_delivered(
    client: InternalClient,
) -> None:
    """Both end paths make the callback due on the control plane from an end written on the
    shard: the worker's (owner key read ahead of ``schedule_callback``), and a producer's
    cancel of a queued request (``end_request`` on the shard, then ``schedule_callback``)."""
    with CallbackReceiver() as receiver:
        finished = await client.submit("call back", max_tokens=5, ignore_eos=True, callback={"url": receiver.url("/f")})
        await asyncio.wait_for(streamed(finished), timeout=30)
        queued = await client.submit("later", max_tokens=5, defer_s=60, callback={"url": receiver.url("/q")})
        assert await client.cancel(queued.request_id) == "queued"
        (done,) = await asyncio.to_thread(receiver.wait, "/f")
        (cancelled,) = await asyncio.to_thread(receiver.wait, "/q")
    assert json.loads(done.body)["request_id"] == finished.request_id
    assert json.loads(done.body)["completion_tokens"] == 5
    assert (json.loads(cancelled.body)["request_id"], json.loads(cancelled.body)["finish_reasons"]) == (
        queued.request_id,
        ["cancelled"],
    )


async def test_a_slot_migrated_while_its_requests_stream_loses_and_repeats_nothing(
    client: InternalClient, cluster: RedisCluster
) -> None:
    bucket = 5
    request_ids = ids_in_bucket(bucket, 4)
    slot = cluster.slot_of(sharded_events_channel(request_ids[0]))
    handles = await submitted(client, "migrating", request_ids, 150)
    streams = asyncio.gather(*map(streamed, handles))
    await asyncio.sleep(1.0)
    source = cluster.primary_of(sharded_events_channel(request_ids[0]))
    target = next(cluster.node(port) for port in cluster.primary_ports() if port != source.port)
    await asyncio.to_thread(cluster.migrate_slot, slot, target)
    for events in await asyncio.wait_for(streams, timeout=60):
        assert_whole(events, 150)
    assert cluster.primary_of(sharded_events_channel(request_ids[0])).port == target.port


async def test_a_primary_killed_mid_stream_fails_over_and_every_request_ends_once(
    client: InternalClient, cluster: RedisCluster
) -> None:
    bucket = EVENTS_BUCKET_TAGS.index("0")  # a bucket no other test here moves
    request_ids = ids_in_bucket(bucket, 3) + ids_on_every_shard(cluster, 1)
    handles = await submitted(client, "failing over", request_ids, 200)
    streams = asyncio.gather(*map(streamed, handles))
    await asyncio.sleep(1.0)
    primary = cluster.primary_of(sharded_events_channel(request_ids[0]))
    [replica] = cluster.replicas_of(primary)
    cluster.kill(primary)
    await asyncio.to_thread(cluster.wait_for_primary, replica)
    for events in await asyncio.wait_for(streams, timeout=90):
        assert_whole(events, 200)


async def test_an_events_url_that_is_no_cluster_is_refused_at_connect(control: RedisServer) -> None:
    with pytest.raises(ValueError, match="Redis Cluster"):
        await StreamqClient.connect(control.url, events_url=control.url)
    with pytest.raises(ConnectionFailed, match="without cluster mode") as refused:
        await StreamqClient.connect(control.url, events_url=control.url.replace("redis://", "redis+cluster://"))
    assert isinstance(refused.value.__cause__, ClusterUnusable)


def test_a_worker_whose_events_cluster_does_not_answer_fails_at_start(control: RedisServer, tmp_path: Path) -> None:
    worker = scripted_worker(control.url, tmp_path / "worker.log", "--events-redis-url", "redis+cluster://127.0.0.1:1")
    worker.start()
    assert worker.process is not None
    assert worker.process.wait(timeout=60) != 0
    assert "no seed node answered" in worker.log_tail(), worker.log_tail()


async def test_a_shard_down_for_good_fails_only_its_own_requests(tmp_path: Path) -> None:
    """A primary with no replica SIGKILLed mid-stream: the other shards' requests finish
    whole, and the dead shard's fail with a clear error (the subscription lost for good)
    instead of waiting forever. A deployment of its own: the module's worker must not take
    these requests."""
    with RedisCluster(primaries=3) as bare, RedisServer() as own_control:
        worker = scripted_worker(
            own_control.url, tmp_path / "worker.log", "--events-redis-url", bare.url, tokens_per_s=TOKENS_PER_S
        )
        worker.start().wait_ready(timeout_s=120)
        try:
            async with await StreamqClient.connect(own_control.url, events_url=bare.url) as client:
                request_ids = ids_on_every_shard(bare, 2)
                doomed = bare.primary_of(sharded_events_channel(request_ids[0]))
                on_doomed = {r for r in request_ids if bare.primary_of(sharded_events_channel(r)) is doomed}
                handles = await submitted(client, "shard down", request_ids, 150)
                streams = [asyncio.ensure_future(streamed(handle)) for handle in handles]
                await asyncio.sleep(1.0)
                bare.kill(doomed)
                _, pending = await asyncio.wait(streams, timeout=90)
                stuck = [r for r, stream in zip(request_ids, streams, strict=True) if stream in pending]
                assert not stuck, f"{stuck} never ended (on the dead shard: {on_doomed}):\n{worker.log_tail(60)}"
                outcomes = [stream.exception() or stream.result() for stream in streams]
            for request_id, outcome in zip(request_ids, outcomes, strict=True):
                if request_id in on_doomed:
                    assert isinstance(outcome, StreamqError), outcome
                    assert "connection" in str(outcome) or "sharded subscription" in str(outcome), outcome
                else:
                    assert isinstance(outcome, list), outcome
                    assert_whole(outcome, 150)
        finally:
            worker.kill()  # its jobs on the dead shard could only hand themselves back at length
