"""``python -m worker --front-ends 2``: one engine core fed by two front-end processes.

As deployed: the worker is one real process (it starts the engine core and the front
ends), on its own queue of the session's Redis, with real clients; the faults are
signals to the real processes. Two workers serve the module: one shares its work and
drains on SIGTERM; the other loses a front end mid-stream and then its engine core. A
third never finishes starting.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
import redis.asyncio as aioredis

from devkit.worker_process import WorkerProcess, tiny_engine_flags
from producer.client import RequestHandle, StreamqClient
from streamq.broker.registry import WorkerRegistry
from streamq.broker.replay_log import ReplayLog
from streamq.protocol import IN_PROGRESS_PREFIX, JOB_KEY_PREFIX
from streamq.protocol.names import WORKER_STATS_KEY, running_key
from tests.support.events import assert_well_formed
from tests.support.session import MAX_MODEL_LEN

SHARING_QUEUE = "streamq:queue:front-ends"
FAULTS_QUEUE = "streamq:queue:front-end-faults"
SLOTS = 6
"""``--max-jobs`` of the sharing worker: the engine's slots both front ends share."""
LONG = 900
"""Tokens of a request still streaming when its fault comes (the model runs to its length)."""


def front_ends_worker(worker_url: str, tiny_model: Path, log_path: Path, queue: str, *extra: str) -> WorkerProcess:
    flags = tiny_engine_flags(tiny_model, max_model_len=MAX_MODEL_LEN) + ["--front-ends", "2", *extra]
    return WorkerProcess(worker_url, flags, queue=queue, log_path=log_path)


def wait_for_log(worker: WorkerProcess, text: str, timeout_s: float = 300.0) -> None:
    deadline = time.monotonic() + timeout_s
    while text not in worker.log_path.read_text(errors="replace"):
        assert worker.process is not None and worker.process.poll() is None, worker.log_tail()
        if time.monotonic() > deadline:
            worker.kill()
            raise AssertionError(f"no {text!r} after {timeout_s:.0f}s:\n{worker.log_tail()}")
        time.sleep(0.2)


def serving(worker: WorkerProcess) -> WorkerProcess:
    worker.start()
    wait_for_log(worker, "front ends serving one engine core")
    return worker


def children(worker: WorkerProcess) -> list[psutil.Process]:
    assert worker.process is not None
    return psutil.Process(worker.process.pid).children()


def front_end_pids(worker: WorkerProcess) -> list[int]:
    """The front ends' pids: the worker's children that multiprocessing spawned."""
    return sorted(p.pid for p in children(worker) if "spawn_main" in " ".join(p.cmdline()))


def engine_core(worker: WorkerProcess) -> psutil.Process:
    (core,) = [p for p in children(worker) if "EngineCore" in " ".join(p.cmdline())]
    return core


def decoded(raw: bytes) -> dict[str, Any]:
    value: dict[str, Any] = json.loads(raw)
    return value


async def finished_per_front_end(raw_redis: aioredis.Redis, pids: list[int], expected: int) -> dict[int, int]:
    """Requests each front end reports finished (its stats report), once they add up."""
    counts: dict[int, int] = {}
    async with asyncio.timeout(30):
        while sum(counts.values()) < expected:
            reports = [decoded(raw) for raw in (await raw_redis.hgetall(WORKER_STATS_KEY)).values()]
            # A report leaves out a count that is still 0.
            counts = {r["pid"]: r.get("requests_finished", 0) for r in reports if r["pid"] in pids}
            await asyncio.sleep(0.2)
    return counts


class Streaming:
    """Requests submitted at once, each streaming: their ids, and their handles once
    submitted. The requests are enqueued together and awaited by their logs, not by the
    handles: a handle returns only once its subscription is confirmed, and a fault must
    come while every request still streams."""

    def __init__(self, client: StreamqClient, prompt: str, *, count: int, max_tokens: int) -> None:
        self.request_ids = [uuid.uuid4().hex for _ in range(count)]
        self._submits = [
            asyncio.ensure_future(client.submit(prompt, request_id=rid, max_tokens=max_tokens, ignore_eos=True))
            for rid in self.request_ids
        ]

    async def started(self, raw_redis: aioredis.Redis) -> Streaming:
        """Once every request has streamed tokens."""
        log = ReplayLog(raw_redis)
        async with asyncio.timeout(120):
            for request_id in self.request_ids:
                while len(await log.read(request_id)) < 2:
                    await asyncio.sleep(0.05)
        return self

    async def handles(self) -> list[RequestHandle]:
        return list(await asyncio.gather(*self._submits))


async def holders(raw_redis: aioredis.Redis, request_ids: list[str]) -> dict[str, str]:
    """Each running request's lease holder (a worker id, which names its process's pid)."""
    held = {rid: await raw_redis.get(IN_PROGRESS_PREFIX + rid) for rid in request_ids}
    return {rid: holder.decode() for rid, holder in held.items() if holder is not None}


def pid_of(holder: str) -> int:
    """The pid in a lease holder (``host-pid-suffix[:attempt]``)."""
    return int(holder.split(":")[0].rsplit("-", 2)[1])


async def tokens_streamed(raw_redis: aioredis.Redis, request_id: str) -> list[int]:
    """The token ids a subscriber assembles from the request's events, once it ended;
    the events are checked well formed (one terminal event, contiguous seq)."""
    events = [decoded(raw) for raw in await ReplayLog(raw_redis).read(request_id)]
    assert_well_formed(events, request_id)
    assert events[-1]["type"] == "final", events[-1]
    return [t for e in events if e["type"] == "chunk" for t in e["token_ids"]]


@pytest.fixture(scope="module")
def sharing_worker(
    worker_url: str, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[WorkerProcess]:
    log = tmp_path_factory.mktemp("front-ends") / "worker.log"
    worker = serving(front_ends_worker(worker_url, tiny_model, log, SHARING_QUEUE, "--max-jobs", str(SLOTS)))
    yield worker
    worker.kill()


@pytest.fixture(scope="module")
def faulted_worker(
    worker_url: str, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[WorkerProcess]:
    log = tmp_path_factory.mktemp("front-end-faults") / "worker.log"
    worker = serving(front_ends_worker(worker_url, tiny_model, log, FAULTS_QUEUE))
    yield worker
    worker.kill()


async def test_both_front_ends_take_work_and_together_never_run_more_than_the_engine_slots(
    sharing_worker: WorkerProcess, producer_url: str, raw_redis: aioredis.Redis
) -> None:
    async with await StreamqClient.connect(producer_url, queue=SHARING_QUEUE) as client:
        handles = [await client.submit("The key to happiness is", max_tokens=48, ignore_eos=True) for _ in range(16)]
        results = asyncio.gather(*(h.result(timeout=180) for h in handles))
        most_running = 0
        while not results.done():
            most_running = max(most_running, await raw_redis.zcard(running_key(SHARING_QUEUE)))
            await asyncio.sleep(0.01)
        completions = await results
    assert [c.completion_tokens for c in completions] == [48] * 16
    assert most_running == SLOTS, f"at most {most_running} requests ran at once, with {SLOTS} slots and 16 queued"
    finished = await finished_per_front_end(raw_redis, front_end_pids(sharing_worker), expected=16)
    assert len(finished) == 2 and all(count > 0 for count in finished.values()), finished


async def test_sigterm_drains_every_front_end_then_stops_the_engine(
    sharing_worker: WorkerProcess, producer_url: str, raw_redis: aioredis.Redis
) -> None:
    core = engine_core(sharing_worker)
    async with await StreamqClient.connect(producer_url, queue=SHARING_QUEUE) as client:
        streams = await Streaming(client, "Once upon a time", count=4, max_tokens=300).started(raw_redis)
        held = await holders(raw_redis, streams.request_ids)
        assert len({pid_of(holder) for holder in held.values()}) == 2, f"both front ends stream: {held}"
        assert sharing_worker.stop() == 0, sharing_worker.log_tail()
        for request_id in streams.request_ids:
            assert len(await tokens_streamed(raw_redis, request_id)) == 300
        await streams.handles()
    assert not core.is_running(), "the engine core outlived its worker"
    log = sharing_worker.log_path.read_text(errors="replace")
    assert log.index("SIGTERM: stopping the front ends") < log.rindex("engine core shut down")


async def test_a_front_end_killed_mid_stream_loses_nothing_and_its_requests_stop_in_the_engine(
    faulted_worker: WorkerProcess, producer_url: str, raw_redis: aioredis.Redis
) -> None:
    async with await StreamqClient.connect(producer_url, queue=FAULTS_QUEUE) as client:
        streams = await Streaming(client, "The key to happiness is", count=8, max_tokens=LONG).started(raw_redis)
        held = await holders(raw_redis, streams.request_ids)
        victim = min(pid_of(holder) for holder in held.values())
        orphans = [rid for rid, holder in held.items() if pid_of(holder) == victim]
        os.kill(victim, signal.SIGKILL)
        for handle in await streams.handles():  # each ends once, with every token, taken over by the sibling
            await handle.result(timeout=180)
            assert len(await tokens_streamed(raw_redis, handle.request_id)) == LONG
        after = await (await client.submit("Hello", max_tokens=5, ignore_eos=True)).result(timeout=60)
    assert after.completion_tokens == 5, "the surviving front end serves on"
    assert faulted_worker.process is not None and faulted_worker.process.poll() is None
    log = faulted_worker.log_path.read_text(errors="replace")
    dropped = " ".join(line for line in log.splitlines() if "the engine dropped its request(s)" in line)
    assert orphans and all(f"{rid}-" in dropped for rid in orphans), (orphans, dropped)
    assert "still ran after their abort" not in log


async def test_the_engine_core_dying_hands_every_request_back_and_fails_the_worker(
    faulted_worker: WorkerProcess, producer_url: str, raw_redis: aioredis.Redis
) -> None:
    async with await StreamqClient.connect(producer_url, queue=FAULTS_QUEUE) as client:
        streams = await Streaming(client, "Once upon a time", count=3, max_tokens=LONG).started(raw_redis)
        front_ends = [psutil.Process(pid) for pid in front_end_pids(faulted_worker)]
        engine_core(faulted_worker).kill()
        assert faulted_worker.process is not None
        assert faulted_worker.process.wait(timeout=120) == 3, faulted_worker.log_tail()
        await streams.handles()
    _, alive = psutil.wait_procs(front_ends, timeout=30)
    assert not alive, f"front ends outlived their worker: {alive}"
    for request_id in streams.request_ids:  # handed back to the queue for another worker, not ended
        events = [decoded(raw) for raw in await ReplayLog(raw_redis).read(request_id)]
        assert all(e["type"] == "chunk" for e in events), events[-1]
        assert await raw_redis.zscore(FAULTS_QUEUE, request_id) is not None
        assert await raw_redis.exists(IN_PROGRESS_PREFIX + request_id) == 0
        await raw_redis.zrem(FAULTS_QUEUE, request_id)  # no worker serves this queue any more
        await raw_redis.delete(JOB_KEY_PREFIX + request_id)


async def test_a_front_end_that_dies_while_starting_fails_the_whole_worker(
    worker_url: str, tiny_model: Path, tmp_path: Path, raw_redis: aioredis.Redis
) -> None:
    queue = "streamq:queue:front-end-start"
    worker = front_ends_worker(worker_url, tiny_model, tmp_path / "worker.log", queue).start()
    assert worker.process is not None
    parent = psutil.Process(worker.process.pid)
    try:
        deadline = time.monotonic() + 120
        while not (pids := front_end_pids(worker)):
            assert time.monotonic() < deadline, worker.log_tail()
            time.sleep(0.05)
        os.kill(pids[0], signal.SIGKILL)
        everything = [parent, *parent.children(recursive=True)]
        code = worker.process.wait(timeout=180)
        _, alive = psutil.wait_procs(everything, timeout=30)
    finally:
        worker.kill()
    assert code == 1, worker.log_tail()
    assert "the worker failed to start" in worker.log_tail(200)
    assert not alive, f"left running: {alive}"
    routes = await WorkerRegistry(raw_redis).routes()
    assert queue not in routes.live_models().values(), "a front end is still registered"
