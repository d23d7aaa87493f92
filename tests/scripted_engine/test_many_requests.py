"""Many requests from code and from a batch file: as many in flight as the live workers'
engines hold twice over (each slot that frees finds a request waiting), results as they
end, every one answered once, none of them streamed.

Real worker processes on the scripted engine (this is about the queue, not the model) and
a Redis of the module's own, so that the live workers are exactly these.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import urllib.request
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as aioredis

from devkit.redis_server import RedisServer, free_port
from devkit.worker_process import SCRIPTED_MODEL, WorkerProcess, scripted_worker
from producer.client import MIN_IN_FLIGHT, Completion, StreamqClient
from producer.errors import InvalidParameter, RequestError, StreamqError
from streamq.broker.replay_log import ReplayLog
from streamq.env_vars import SCRIPTED_MAX_NUM_SEQS_ENV
from streamq.protocol import ChunkEvent, FinalEvent, decode_event
from tests.support.worker_faults import paused

SLOTS = 40
"""The scripted worker's engine batch: twice it is past ``MIN_IN_FLIGHT``."""
CHECKPOINT_TOKENS = 4


@pytest.fixture(scope="module")
def own_redis() -> Iterator[RedisServer]:
    with RedisServer() as server:
        yield server


@pytest.fixture(scope="module")
def worker(own_redis: RedisServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[WorkerProcess]:
    log_path = tmp_path_factory.mktemp("many") / "worker.log"
    port = free_port()
    flags = ["--checkpoint-tokens", str(CHECKPOINT_TOKENS), "--metrics-port", str(port)]  # the last flag wins
    process = scripted_worker(own_redis.url, log_path, *flags, tokens_per_s=200)
    process.env[SCRIPTED_MAX_NUM_SEQS_ENV] = str(SLOTS)
    process.metrics_port = port
    process.start().wait_ready()
    yield process
    assert process.stop() == 0, process.log_tail()


@pytest.fixture
async def client(own_redis: RedisServer, worker: WorkerProcess) -> AsyncIterator[StreamqClient]:
    async with await StreamqClient.connect(own_redis.url, queue=worker.queue) as client:
        yield client


@pytest.fixture
async def raw(own_redis: RedisServer) -> AsyncIterator[aioredis.Redis]:
    client = aioredis.Redis.from_url(own_redis.url)
    yield client
    await client.aclose()


def _events_of_whole_requests(worker: WorkerProcess) -> tuple[float, float]:
    """The worker's ``streamq_request_events`` sum and count for requests not streamed."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{worker.metrics_port}/metrics", timeout=10).read().decode()
    values = {}
    for line in text.splitlines():
        for part in ("sum", "count"):
            if line.startswith(f'streamq_request_events_{part}{{streamed="false"}}'):
                values[part] = float(line.split()[-1])
    return values.get("sum", 0.0), values.get("count", 0.0)


async def _earlier_requests_acknowledged(raw: aioredis.Redis, queue: str) -> None:
    """Wait until the queue holds no job of an earlier test: a worker takes a job off its
    queue when it acknowledges its end, a moment after its client has the end."""
    async with asyncio.timeout(20):
        while await raw.zcard(queue):
            await asyncio.sleep(0.01)


async def test_generate_many_keeps_twice_the_live_slots_in_flight_and_yields_each_as_it_ends(
    client: StreamqClient, worker: WorkerProcess, raw: aioredis.Redis
) -> None:
    count = 3 * SLOTS * 2
    prompts = [{"prompt": f"prompt {i}", "request_id": f"many-{uuid.uuid4().hex}"} for i in range(count)]
    results = client.generate_many(prompts, max_tokens=3)
    await _earlier_requests_acknowledged(raw, worker.queue)
    with paused(worker):  # nothing ends: generate_many fills its window and waits
        first = asyncio.ensure_future(anext(results))
        async with asyncio.timeout(20):
            while await raw.zcard(worker.queue) < 2 * SLOTS:
                await asyncio.sleep(0.01)
        await asyncio.sleep(0.5)
        assert await raw.zcard(worker.queue) == 2 * SLOTS == max(MIN_IN_FLIGHT, 2 * SLOTS)
    done: list[Completion] = [await first]
    async with asyncio.timeout(60):
        done += [completion async for completion in results]
    assert sorted(c.request_id for c in done) == sorted(p["request_id"] for p in prompts), "each once"
    assert all(c.completion_tokens == 3 and c.finish_reasons == ["length"] for c in done)


async def test_a_request_that_is_not_streamed_writes_checkpoints_then_one_final(
    client: StreamqClient, worker: WorkerProcess, own_redis: RedisServer
) -> None:
    before = _events_of_whole_requests(worker)
    completion = await client.generate("a long answer", max_tokens=10)
    assert completion.completion_tokens == 10 and len(completion.token_ids[0]) == 10
    async with aioredis.Redis.from_url(own_redis.url) as raw:
        events = [decode_event(raw_event) for raw_event in await ReplayLog(raw).read(completion.request_id)]
    assert [e.seq for e in events] == list(range(len(events))), "contiguous from 0"
    # The engine's outputs: token 1 at once (held), then every 4, then the last: 5 + 4 + 1.
    assert [len(e.token_ids) for e in events if isinstance(e, ChunkEvent)] == [5, 4, 1]
    assert [type(e) for e in events].count(FinalEvent) == 1 and isinstance(events[-1], FinalEvent)
    after = _events_of_whole_requests(worker)
    assert (after[0] - before[0], after[1] - before[1]) == (4, 1)


async def test_generate_many_yields_each_failure_naming_its_request_or_raises_it(client: StreamqClient) -> None:
    requests: list[dict[str, Any]] = [
        {"prompt": "fine", "request_id": "good-" + uuid.uuid4().hex},
        {"prompt": "cold", "request_id": "cold-" + uuid.uuid4().hex, "temperature": -1.0},
        {"prompt": "typo", "request_id": "typo-" + uuid.uuid4().hex, "max_tokenz": 3},
    ]
    outcomes = {result.request_id: result async for result in client.generate_many(requests, return_exceptions=True)}
    assert set(outcomes) == {r["request_id"] for r in requests}
    good, cold, typo = (outcomes[r["request_id"]] for r in requests)
    assert isinstance(good, Completion)
    assert isinstance(cold, RequestError) and cold.code == "invalid_request"
    assert isinstance(typo, InvalidParameter) and typo.param == "max_tokenz"
    with pytest.raises(StreamqError) as raised:
        async for _ in client.generate_many(requests[1:2]):
            pass
    assert raised.value.request_id == requests[1]["request_id"]


async def test_leaving_generate_many_early_cancels_what_it_had_in_flight(
    client: StreamqClient, worker: WorkerProcess
) -> None:
    ids = [f"early-{uuid.uuid4().hex}" for _ in range(20)]
    requests = [{"prompt": "x", "request_id": i, "max_tokens": 2 if n == 0 else 2000} for n, i in enumerate(ids)]
    results = client.generate_many(requests, max_in_flight=5)
    first = await anext(results)
    await results.aclose()
    assert first.request_id == ids[0]
    for request_id in ids[1:5]:
        async with asyncio.timeout(10):  # the cancel goes out as the loop is left; the worker ends it
            while (status := await client.status(request_id)).state != "finished":
                await asyncio.sleep(0.05)
        assert status.finish_reasons == ["cancelled"], status
    for request_id in ids[5:]:
        assert (await client.status(request_id)).state == "unknown", "never sent"


async def test_a_batch_file_is_answered_once_a_line_with_twice_the_slots_in_flight(
    own_redis: RedisServer, worker: WorkerProcess, raw: aioredis.Redis, tmp_path: Path
) -> None:
    lines = 600
    in_path, out_path = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    body = {"model": SCRIPTED_MODEL, "max_tokens": 2}
    rows: list[dict[str, Any]] = [
        {"custom_id": f"c{i}", "method": "POST", "url": "/v1/completions", "body": {**body, "prompt": f"p{i}"}}
        for i in range(lines)
    ]
    in_path.write_text("\n".join(json.dumps(row) for row in rows) + "\n")
    command = [sys.executable, "-m", "producer", "batch", str(in_path), str(out_path), "--no-progress"]
    command += ["--redis-url", own_redis.url]
    await _earlier_requests_acknowledged(raw, worker.queue)
    batch: subprocess.Popen[str] | None = None
    try:
        with paused(worker):  # nothing ends: the command fills its window and waits
            batch = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            async with asyncio.timeout(30):
                while await raw.zcard(worker.queue) < 2 * SLOTS:
                    await asyncio.sleep(0.01)
            await asyncio.sleep(0.5)
            assert await raw.zcard(worker.queue) == 2 * SLOTS, "twice the live worker's slots in flight"
        output, _ = await asyncio.to_thread(batch.communicate, timeout=120)
    finally:
        if batch is not None and batch.poll() is None:  # a failed check: the command is not left running
            batch.kill()
            batch.communicate()
    assert batch.returncode == 0, output
    written = [json.loads(line) for line in out_path.read_text().splitlines()]
    assert sorted(row["custom_id"] for row in written) == sorted(row["custom_id"] for row in rows), "each once"
    assert all(row["response"]["status_code"] == 200 for row in written)


async def test_a_request_that_is_not_streamed_ends_at_its_deadline_with_every_token_it_generated(
    client: StreamqClient,
) -> None:
    """The deadline passes between checkpoints: what was generated since the last one is
    logged with the final event, so the tokens sent match the count it reports."""
    completion = await client.generate("slow", max_tokens=10_000, ignore_eos=True, deadline_s=0.5)
    assert completion.finish_reasons == ["timeout"]
    assert 0 < completion.completion_tokens == len(completion.token_ids[0]) < 10_000
    assert completion.text == " tok" * completion.completion_tokens


def _round_trips(worker: WorkerProcess) -> dict[str, float]:
    """The worker's ``streamq_redis_round_trips_total``, by purpose."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{worker.metrics_port}/metrics", timeout=10).read().decode()
    found = {}
    for line in text.splitlines():
        if line.startswith("streamq_redis_round_trips_total{"):
            found[line.split('purpose="')[1].split('"')[0]] = float(line.split()[-1])
    return found


async def test_waves_that_end_in_one_step_are_answered_once_each_and_acknowledged_together(
    client: StreamqClient, worker: WorkerProcess, own_redis: RedisServer
) -> None:
    """The engine runs SLOTS requests at once and the worker keeps SLOTS more waiting in it:
    requests of one length end together, a wave in one engine step, so their jobs end in
    one pass of the worker's loop and share their round trips, and the next wave starts."""
    before = _round_trips(worker)
    requests = [{"prompt": f"wave {i}", "request_id": f"wave-{uuid.uuid4().hex}"} for i in range(4 * SLOTS)]
    done = [c async for c in client.generate_many(requests, max_tokens=CHECKPOINT_TOKENS, max_in_flight=4 * SLOTS)]
    assert sorted(c.request_id for c in done) == sorted(r["request_id"] for r in requests), "each once"
    async with aioredis.Redis.from_url(own_redis.url) as raw:
        log = ReplayLog(raw)
        for completion in done:
            events = [decode_event(e) for e in await log.read(completion.request_id)]
            assert [type(e) for e in events] == [ChunkEvent, FinalEvent], "its tokens, then one end"
            assert [e.seq for e in events] == [0, 1] and completion.completion_tokens == CHECKPOINT_TOKENS
    after = _round_trips(worker)
    acknowledged = after["acknowledge"] - before.get("acknowledge", 0)
    claimed = after["claim"] - before.get("claim", 0)
    assert 1 <= acknowledged <= len(requests) / 4, f"{acknowledged:.0f} acknowledgements for {len(requests)} ends"
    assert 1 <= claimed <= len(requests) / 4, f"{claimed:.0f} claims for {len(requests)} requests"
