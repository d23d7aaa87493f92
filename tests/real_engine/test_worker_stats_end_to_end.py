"""A real worker's reports for the dashboard: what it runs now with its tokens so far,
its counters moving by what its requests did, the ends it writes at the head of the
recent ends, and a last report when it is stopped with SIGTERM."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import TypeVar

import pytest
import redis.asyncio as aioredis

from devkit.worker_process import WorkerProcess, scripted_worker
from producer.client import StreamqClient
from streamq.broker.worker_stats import WorkerStatsStore
from streamq.protocol import ChunkEvent, ErrorEvent, Event, FinalEvent
from streamq.protocol.worker_stats import RecentEnd, WorkerStats
from tests.support.session import MAX_MODEL_LEN

TIMEOUT_S = 60.0
T = TypeVar("T")


async def report_of(redis: aioredis.Redis, worker: WorkerProcess) -> WorkerStats | None:
    """The latest report of ``worker``'s process, if any."""
    assert worker.process is not None
    reports = [s for s in await WorkerStatsStore(redis).read() if s.pid == worker.process.pid]
    return reports[-1] if reports else None


async def until(probe: Callable[[], Awaitable[T | None]], what: str) -> T:
    """Poll ``probe`` until it returns something (reports come every second)."""
    deadline = time.monotonic() + TIMEOUT_S
    while time.monotonic() < deadline:
        found = await probe()
        if found is not None:
            return found
        await asyncio.sleep(0.1)
    raise AssertionError(f"not within {TIMEOUT_S:.0f}s: {what}")


async def settled_report(redis: aioredis.Redis, worker: WorkerProcess) -> WorkerStats:
    """The shared session worker's report once it runs nothing and two reports in a row agree
    on what it has finished: an earlier test's requests ending meanwhile would count here."""
    previous: list[WorkerStats] = []

    async def idle_twice() -> WorkerStats | None:
        report = await report_of(redis, worker)
        if report is None or report.in_flight:
            previous.clear()
            return None
        if previous and previous[-1].reported_ms != report.reported_ms:
            if previous[-1].requests_finished == report.requests_finished and previous[-1].errors == report.errors:
                return report
            previous.clear()
        if not previous:
            previous.append(report)
        return None

    return await until(idle_twice, "the session worker idle through two reports")


async def head_of_recent_ends(redis: aioredis.Redis) -> RecentEnd:
    ends = await WorkerStatsStore(redis).recent_ends(limit=1)
    assert ends, "streamq:recent-ends is empty"
    return ends[0]


async def test_a_running_request_is_reported_and_its_end_counted(
    client: StreamqClient, worker: WorkerProcess, raw_redis: aioredis.Redis
) -> None:
    before = await settled_report(raw_redis, worker)
    assert before.stopped_ms is None and before.host and before.started_ms > 0
    # Eight completions of a whole context: seconds of work for the tiny model, so that
    # reports (one a second) see it running at least twice.
    handle = await client.submit(
        "Once upon a time", n=8, max_tokens=MAX_MODEL_LEN - 24, ignore_eos=True, tenant="team-a", priority=3
    )
    events: list[Event] = []

    async def follow() -> None:
        async for event in handle:
            events.append(event)

    follower = asyncio.create_task(follow())
    counts: list[int] = []

    async def tokens_reported() -> list[int] | None:
        report = await report_of(raw_redis, worker)
        mine = [r for r in report.in_flight if r.request_id == handle.request_id] if report else []
        if mine:
            assert (mine[0].tenant, mine[0].priority, mine[0].attempt) == ("team-a", 3, 1)
            if not counts or mine[0].completion_tokens != counts[-1]:
                counts.append(mine[0].completion_tokens)
        return counts if len(counts) >= 2 and counts[-1] > counts[0] > 0 else None

    try:
        await until(tokens_reported, "the request in the worker's in_flight with its tokens rising")
    finally:
        await handle.cancel()  # enough seen: end it early (a cancelled request finishes)
        await asyncio.wait_for(follower, TIMEOUT_S)
    assert counts == sorted(counts), "tokens so far never go back"
    final = events[-1]
    assert isinstance(final, FinalEvent) and len(final.finish_reasons) == 8
    assert set(final.finish_reasons) <= {"cancelled", "length"}
    assert final.completion_tokens >= counts[-1]
    assert sum(len(e.token_ids) for e in events if isinstance(e, ChunkEvent)) == final.completion_tokens

    async def counted() -> WorkerStats | None:
        report = await report_of(raw_redis, worker)
        if report is None or report.requests_finished == before.requests_finished:
            return None
        return report if not any(r.request_id == handle.request_id for r in report.in_flight) else None

    after = await until(counted, "the ended request counted and gone from in_flight")
    assert after.requests_finished == before.requests_finished + 1
    assert after.generated_tokens == before.generated_tokens + final.completion_tokens
    assert after.ttft_count == before.ttft_count + 1
    assert after.itl_count > before.itl_count
    assert after.errors == before.errors
    end = await head_of_recent_ends(raw_redis)
    assert end.request_id == handle.request_id and end.event == final


async def test_a_refused_request_is_counted_by_its_code_and_ends_in_recent_ends(
    client: StreamqClient, worker: WorkerProcess, raw_redis: aioredis.Redis
) -> None:
    before = await settled_report(raw_redis, worker)
    handle = await client.submit("Too cold", temperature=-1.0)  # vLLM refuses it on the worker
    [error] = [event async for event in handle]
    assert isinstance(error, ErrorEvent) and error.code == "invalid_request"

    async def counted() -> WorkerStats | None:
        report = await report_of(raw_redis, worker)
        seen = report.errors.get("invalid_request", 0) if report else 0
        return report if seen > before.errors.get("invalid_request", 0) else None

    after = await until(counted, "errors[invalid_request] counting the refused request")
    assert after.errors["invalid_request"] == before.errors.get("invalid_request", 0) + 1
    assert after.requests_finished == before.requests_finished
    end = await head_of_recent_ends(raw_redis)
    assert end.request_id == handle.request_id and end.event == error


@pytest.fixture
def stopping_worker(worker_url: str, tmp_path: Path) -> Iterator[WorkerProcess]:
    """A worker of its own (on the scripted engine: this is about shutting down, not
    generating) on a queue of its own, that the test stops."""
    queue = f"streamq:queue:stats-{uuid.uuid4().hex[:8]}"
    process = scripted_worker(worker_url, tmp_path / "worker.log", tokens_per_s=100, queue=queue)
    process.start().wait_ready()
    yield process
    process.kill()


async def test_a_worker_stopped_with_sigterm_leaves_a_last_report_after_its_requests(
    stopping_worker: WorkerProcess, producer_url: str, raw_redis: aioredis.Redis
) -> None:
    await until(lambda: report_of(raw_redis, stopping_worker), "the worker's first report")
    async with await StreamqClient.connect(producer_url, queue=stopping_worker.queue) as client:
        handle = await client.submit("Drain me", max_tokens=150, ignore_eos=True)
        events = aiter(handle)
        first = await anext(events)
        assert isinstance(first, ChunkEvent)
        stopped = asyncio.create_task(asyncio.to_thread(stopping_worker.stop))
        rest = [event async for event in events]  # the drain lets it finish
        assert await stopped == 0, stopping_worker.log_tail()
    final = rest[-1]
    assert isinstance(final, FinalEvent) and final.finish_reasons == ["length"]
    last = await report_of(raw_redis, stopping_worker)
    assert last is not None, "the last report outlives the worker"
    assert last.stop_reason == "shutdown"
    assert last.stopped_ms is not None and last.stopped_ms >= last.started_ms
    assert last.in_flight == [], "written after the running request drained"
    assert last.requests_finished == 1 and last.generated_tokens == 150
    end = await head_of_recent_ends(raw_redis)
    assert end.request_id == handle.request_id and end.event == final
