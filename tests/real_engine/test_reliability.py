"""Nothing lost: replay, crash recovery, shutdown hand-back, cancellation, deadlines.

Tests that only need a healthy worker come first, the fault-injection tests last.
Fault injection uses real processes: a second worker beside the session's, stopped
with SIGTERM mid-stream or losing its engine, while the session's worker is paused with
SIGSTOP until the fault so the request surely starts on the worker that fails. A worker
SIGKILLed mid-stream: tests/real_engine/test_take_over.py.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from pathlib import Path

import psutil
import pytest
import redis.asyncio as aioredis

from devkit.worker_process import WorkerProcess
from producer.client import StreamqClient
from producer.errors import DuplicateRequest
from streamq.broker.replay_log import ReplayLog
from streamq.protocol import JOB_KEY_PREFIX, FinalEvent, events_channel
from tests.support.events import assert_well_formed, capture_events, job_result
from tests.support.worker_faults import paused, second_worker

LONG = 900  # tokens: seconds of streaming to interrupt, within max_model_len with the prompt


async def wait_for_chunks(redis_url: str, request_id: str, count: int) -> None:
    client = aioredis.Redis.from_url(redis_url)
    try:
        async with asyncio.timeout(60):
            while await client.xlen(events_channel(request_id)) < count:
                await asyncio.sleep(0.005)
    finally:
        await client.aclose()


async def test_late_follower_gets_every_event_from_the_replay_log(client: StreamqClient) -> None:
    done = await (await client.submit("The key to happiness is", max_tokens=20, ignore_eos=True)).result()
    late = await client.follow(done.request_id, from_seq=5)
    events = [event async for event in late]
    assert [e.seq for e in events] == list(range(5, 5 + len(events)))
    assert isinstance(events[-1], FinalEvent)
    all_events = [event async for event in await client.follow(done.request_id)]
    assert "".join(getattr(e, "text", "") for e in all_events) == done.text
    assert all_events[-1].seq == len(all_events) - 1


async def test_cancel_aborts_a_running_request(client: StreamqClient, raw_redis: aioredis.Redis) -> None:
    handle = await client.submit("Tell me everything", max_tokens=LONG, ignore_eos=True)
    events = []
    async for event in handle:
        events.append(event)
        if len(events) == 3:
            assert await handle.cancel() == "running"
    final = events[-1]
    assert final.finish_reasons == ["cancelled"]
    assert final.completion_tokens < LONG
    result = await job_result(raw_redis, handle.request_id)
    assert result["s"] is True and result["r"]["finish_reasons"] == ["cancelled"]


async def test_cancel_removes_a_queued_request(redis_url: str, raw_redis: aioredis.Redis) -> None:
    async with await StreamqClient.connect(redis_url, queue="streamq:nobody-serves-this") as idle:
        handle = await idle.submit("Never run")
        assert await idle.cancel(handle.request_id) == "queued"
        completion = await handle.result()
        assert completion.finish_reasons == ["cancelled"] and completion.completion_tokens == 0
        assert await raw_redis.zcard("streamq:nobody-serves-this") == 0
        assert await raw_redis.exists(JOB_KEY_PREFIX + handle.request_id) == 0
        assert await idle.cancel(handle.request_id) == "unknown"


async def test_the_id_of_a_cancelled_request_is_not_reused(redis_url: str, raw_redis: aioredis.Redis) -> None:
    """Its replay log is still kept: a second request under the same id would splice its
    events into the first's stream, so it is refused."""
    async with await StreamqClient.connect(redis_url, queue="streamq:nobody-serves-this") as idle:
        handle = await idle.submit("Never run")
        assert await idle.cancel(handle.request_id) == "queued"
        with pytest.raises(DuplicateRequest, match=handle.request_id):
            await idle.submit("Again", request_id=handle.request_id)
        assert await raw_redis.zcard("streamq:nobody-serves-this") == 0
        events = [event async for event in await idle.follow(handle.request_id)]
    assert [type(e) for e in events] == [FinalEvent] and events[0].finish_reasons == ["cancelled"]


async def test_a_producer_whose_clock_is_ahead_does_not_defer_its_requests(
    client: StreamqClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Queue scores are Redis's clock: a job scored by a producer an hour ahead would wait
    an hour for a worker."""
    real_time = time.time
    monkeypatch.setattr(time, "time", lambda: real_time() + 3600)
    async with asyncio.timeout(30):
        completion = await (await client.submit("Hello", max_tokens=3, ignore_eos=True)).result()
    assert completion.completion_tokens == 3


async def test_closing_a_handle_can_cancel_its_request(client: StreamqClient, raw_redis: aioredis.Redis) -> None:
    handle = await client.submit("Go on and on", max_tokens=LONG, ignore_eos=True)
    handle.cancel_on_close = True
    async for _ in handle:
        break  # the consumer walks away
    await handle.close()
    assert (await job_result(raw_redis, handle.request_id))["r"]["finish_reasons"] == ["cancelled"]


async def test_deadline_ends_the_request_with_a_timeout(client: StreamqClient) -> None:
    completion = await (await client.submit("Slowly", max_tokens=LONG, ignore_eos=True, deadline_s=0.05)).result()
    assert completion.finish_reasons == ["timeout"]
    assert completion.completion_tokens < LONG


async def test_queue_wait_limit_ends_a_stale_request(worker: WorkerProcess, client: StreamqClient) -> None:
    with paused(worker):
        handle = await client.submit("Too late", max_tokens=8, queue_timeout_s=0.2)
        await asyncio.sleep(0.5)
    completion = await handle.result()
    assert completion.finish_reasons == ["queue_timeout"]
    assert completion.completion_tokens == 0


async def test_a_worker_stalled_past_its_lease_keeps_its_own_job(
    worker: WorkerProcess, client: StreamqClient, redis_url: str
) -> None:
    """A worker frozen for longer than the lease (here SIGSTOP; a stalled loop or a Redis
    outage does the same) finds its lease lapsed when it runs again. With nobody else
    holding it, it takes the lease back: it must not claim its own running job a second
    time, and the stream goes on as one attempt."""
    request_id = f"stalled-{uuid.uuid4().hex}"

    async def submit_and_stall() -> None:
        await client.submit("Tell me everything", request_id=request_id, max_tokens=LONG, ignore_eos=True)
        await wait_for_chunks(redis_url, request_id, 10)
        with paused(worker):
            await asyncio.sleep(4.5)  # the 3 s lease lapses meanwhile

    events = await capture_events(redis_url, request_id, submit_and_stall)

    assert_well_formed(events, request_id)
    assert events[-1]["type"] == "final" and events[-1]["finish_reasons"] == ["length"]
    assert sum(len(e["token_ids"]) for e in events[:-1]) == LONG
    assert {e["attempt"] for e in events} == {1}
    assert f"request {request_id} started (attempt 2)" not in worker.log_tail(400)  # a take-over's start is logged


async def test_an_attempt_taken_over_elsewhere_stops_and_the_newer_attempt_ends_it(
    worker: WorkerProcess, client: StreamqClient, raw_redis: aioredis.Redis, redis_url: str
) -> None:
    """A worker whose lease lapsed while it still ran (cut off from Redis, or starved)
    loses the request to the attempt that takes it over. Here the test takes it over
    as another worker would; once the log refuses the old attempt's events, that
    attempt must stop and leave arq's keys alone, so that the job can run again."""
    request_id = f"fenced-{uuid.uuid4().hex}"

    async def submit_and_take_over() -> None:
        await client.submit("Tell me everything", request_id=request_id, max_tokens=LONG, ignore_eos=True)
        await wait_for_chunks(redis_url, request_id, 3)
        await ReplayLog(raw_redis).take_over(request_id, attempt=2)

    events = await capture_events(redis_url, request_id, submit_and_take_over)

    assert_well_formed(events, request_id)
    chunks, final = events[:-1], events[-1]
    assert final["type"] == "final" and final["finish_reasons"] == ["length"]
    assert sum(len(c["token_ids"]) for c in chunks) == final["completion_tokens"] == LONG
    assert {e["attempt"] for e in events} == {1, 2}  # the job ran again after the old attempt stopped
    assert f"request {request_id}: stopping attempt 1 (superseded)" in worker.log_tail(400)
    result = await job_result(raw_redis, request_id)
    assert result["t"] == 2 and result["r"]["finish_reasons"] == ["length"]


async def test_sigterm_hands_running_requests_back_without_loss(
    worker: WorkerProcess, client: StreamqClient, tiny_model: Path, tmp_path: Path, redis_url: str
) -> None:
    leaving = second_worker(worker, tiny_model, tmp_path, "--drain-seconds", "0")
    request_id = f"drain-{uuid.uuid4().hex}"

    async def submit_and_stop() -> None:
        with paused(worker):
            await client.submit(
                "The future of artificial intelligence is", request_id=request_id, max_tokens=LONG, ignore_eos=True
            )
            await wait_for_chunks(redis_url, request_id, 10)
            assert await asyncio.to_thread(leaving.stop) == 0, leaving.log_tail()

    try:
        events = await capture_events(redis_url, request_id, submit_and_stop)
    finally:
        leaving.kill()

    assert_well_formed(events, request_id)
    assert events[-1]["type"] == "final"
    assert sum(len(e["token_ids"]) for e in events[:-1]) == events[-1]["completion_tokens"] == LONG
    assert {e["attempt"] for e in events} == {1, 2}
    assert "cancelled, will be run again" in leaving.log_tail(400)


async def test_engine_death_stops_the_worker_and_its_job_moves(
    worker: WorkerProcess, client: StreamqClient, tiny_model: Path, tmp_path: Path, redis_url: str
) -> None:
    stricken = second_worker(worker, tiny_model, tmp_path)
    assert stricken.process is not None
    engine_cores = [
        p
        for p in psutil.Process(stricken.process.pid).children(recursive=True)
        if "EngineCore" in " ".join(p.cmdline()) + p.name()
    ]
    assert engine_cores, "no EngineCore process found"
    for process in engine_cores:
        process.kill()
    request_id = f"dead-{uuid.uuid4().hex}"

    async def submit_to_the_stricken_worker() -> None:
        with paused(worker):
            await client.submit("The key to happiness is", request_id=request_id, max_tokens=20, ignore_eos=True)
            assert await asyncio.to_thread(stricken.process.wait, 120) == 3, stricken.log_tail()

    try:
        events = await capture_events(redis_url, request_id, submit_to_the_stricken_worker)
    finally:
        stricken.kill()

    assert_well_formed(events, request_id)
    assert events[-1]["type"] == "final"
    assert sum(len(e["token_ids"]) for e in events[:-1]) == 20
    assert {e["attempt"] for e in events} == {2}  # the first try handed the job back untouched
