"""A Redis full at its ``maxmemory`` (``noeviction``: it answers writes with ``OOM``) under a
running worker: the worker lives, says so, and claims again once memory is freed.

A real Redis whose limit is set just above what it holds, then filled by the harness; a
real worker on the scripted engine (what is under test is the worker's loop and its Redis
calls, not the model); the library's client as a user runs it.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import urllib.error
import urllib.request
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis.asyncio as aioredis
from redis.exceptions import OutOfMemoryError

from devkit.gateway_process import GatewayProcess
from devkit.redis_server import RedisServer, free_port
from devkit.worker_process import SCRIPTED_MODEL, WorkerProcess, scripted_worker
from producer.client import StreamqClient
from producer.errors import RedisFull
from streamq.protocol import ChunkEvent, FinalEvent
from tests.support.metrics import scrape, value
from tests.support.worker_faults import paused

TOKENS_PER_S = 100
REFUSED_LINE = "Redis refuses the worker's writes"


@pytest.fixture
def redis_server() -> Iterator[RedisServer]:
    with RedisServer() as server:
        yield server


@pytest.fixture
async def admin(redis_server: RedisServer) -> AsyncIterator[aioredis.Redis]:
    client = aioredis.Redis.from_url(redis_server.url)
    yield client
    await client.aclose()


async def fill(admin: aioredis.Redis) -> None:
    """Make Redis full: ``noeviction`` and a limit below what it holds, a Redis that filled
    up as far as every write goes (one nearly full refuses only the writes that would take
    it past its limit; small ones pass)."""
    await admin.config_set("maxmemory-policy", "noeviction")
    used = int((await admin.info("memory"))["used_memory"])
    await admin.config_set("maxmemory", used // 2)
    with pytest.raises(OutOfMemoryError):
        await admin.set("test:refused", b"x")


async def free(admin: aioredis.Redis) -> None:
    await admin.config_set("maxmemory", 0)


def ready(worker: WorkerProcess) -> tuple[int, str]:
    """What the worker's ``/ready`` answers: status and body."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{worker.metrics_port}/ready", timeout=5) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


async def until_ready_is(worker: WorkerProcess, status: int, timeout_s: float = 30) -> str:
    async with asyncio.timeout(timeout_s):
        while (answer := await asyncio.to_thread(ready, worker))[0] != status:
            assert worker.process is not None and worker.process.poll() is None, worker.log_tail()
            await asyncio.sleep(0.1)
    return answer[1]


class BatchFile:
    """A batch of 2-token completions for ``streamq batch``, 8 in flight: its command, its
    output and the command's stderr."""

    def __init__(self, tmp_path: Path, redis_url: str, *, lines: int) -> None:
        in_path, self.out_path, self.err_path = tmp_path / "in.jsonl", tmp_path / "out.jsonl", tmp_path / "batch.err"
        body = {"model": SCRIPTED_MODEL, "max_tokens": 2}
        self.rows: list[dict[str, Any]] = [
            {"custom_id": f"c{i}", "method": "POST", "url": "/v1/completions", "body": {**body, "prompt": f"p{i}"}}
            for i in range(lines)
        ]
        in_path.write_text("".join(json.dumps(row) + "\n" for row in self.rows))
        self.command = [sys.executable, "-m", "producer", "batch", str(in_path), str(self.out_path), "--no-progress"]
        self.command += ["--redis-url", redis_url, "--max-in-flight", "8"]

    def answered(self) -> list[str]:
        """The ``custom_id`` of each line in the output, in its order."""
        return [json.loads(line)["custom_id"] for line in self.out_path.read_text().splitlines()]


async def test_a_worker_lives_through_a_full_redis_and_its_stream_ends_once_with_every_token(
    redis_server: RedisServer, admin: aioredis.Redis, tmp_path: Path
) -> None:
    """A request streams (300 tokens at 100/s) when Redis fills up: the worker stays up, stops
    claiming, says so once (log, ``streamq_redis_refusing_writes``, ``/ready`` 503 with
    Redis's reply; its loops that retry each second log their failure once too) for as long
    as writes are refused; memory freed, the stream goes on and
    ends once with every token, and the worker takes new requests."""
    worker = scripted_worker(
        redis_server.url, tmp_path / "worker.log", tokens_per_s=TOKENS_PER_S, metrics_port=free_port()
    )
    worker.start().wait_ready(timeout_s=120)
    try:
        async with await StreamqClient.connect(redis_server.url) as client:
            handle = await client.submit("fill me up", max_tokens=300, ignore_eos=True)
            events: list[ChunkEvent | FinalEvent] = []
            async with asyncio.timeout(60):
                async for event in handle:
                    events.append(event)  # type: ignore[arg-type]
                    if len(events) == 3:
                        break
            await fill(admin)
            reason = await until_ready_is(worker, 503)
            assert "Redis refuses writes" in reason and "OOM" in reason, reason
            assert value(await asyncio.to_thread(scrape, worker), "streamq_redis_refusing_writes") == 1
            await asyncio.sleep(3)  # dozens of refused claims, a refused flush and lease renewal or two
            assert worker.process is not None and worker.process.poll() is None, worker.log_tail()
            await free(admin)

            async with asyncio.timeout(90):
                events += [event async for event in handle]  # type: ignore[misc]
            assert [event.seq for event in events] == list(range(len(events))), "a gap or a repeat"
            assert sum(len(e.token_ids) for e in events if isinstance(e, ChunkEvent)) == 300
            final = events[-1]
            assert isinstance(final, FinalEvent) and final.finish_reasons == ["length"]
            assert [type(e) for e in events].count(FinalEvent) == 1
            assert {e.attempt for e in events} == {1}, "the worker kept its request"

            await until_ready_is(worker, 200)
            assert value(await asyncio.to_thread(scrape, worker), "streamq_redis_refusing_writes") == 0
            after = await (await client.submit("after the refusal", max_tokens=5, ignore_eos=True)).result()
            assert after.completion_tokens == 5
        log = worker.log_path.read_text()
        assert log.count(REFUSED_LINE) == 1, worker.log_tail(60)
        assert "Redis takes the worker's writes again" in log
        for loop in ("could not renew", "not logged, sent again", "could not write the worker's stats report"):
            assert log.count(loop) <= 1, f"{loop!r} said more than once an episode:\n{worker.log_tail(60)}"
    finally:
        assert worker.stop() == 0, worker.log_tail()


async def test_the_front_door_refuses_clearly_and_a_batch_says_why_it_waits_and_resumes(
    redis_server: RedisServer, admin: aioredis.Redis, tmp_path: Path
) -> None:
    """Redis fills mid-batch while its requests are in flight: ``streamq batch`` says it
    waits because Redis is full (its ``maxmemory``); an enqueue through the library raises
    ``RedisFull`` and the gateway answers 503 with ``Retry-After`` in OpenAI's error shape.
    Memory freed, the batch goes on and answers every line once. Started on a full Redis,
    a batch stops at once with one line naming it, and a rerun does it all."""
    worker = scripted_worker(redis_server.url, tmp_path / "worker.log", tokens_per_s=1000)
    worker.start().wait_ready(timeout_s=120)
    gateway = GatewayProcess(redis_server.url, tmp_path / "gateway.log").wait_ready()
    batch_file = BatchFile(tmp_path, redis_server.url, lines=300)
    command, out_path, err_path, rows = batch_file.command, batch_file.out_path, batch_file.err_path, batch_file.rows
    answered = batch_file.answered

    try:
        with err_path.open("w") as err:
            batch = subprocess.Popen(command, stdout=err, stderr=subprocess.STDOUT, text=True)
        async with asyncio.timeout(60):
            while not out_path.exists() or len(answered()) < 50:
                assert batch.poll() is None, err_path.read_text()
                await asyncio.sleep(0.02)
        with paused(worker):  # its 8 requests in flight: nothing ends, nothing new is sent
            await asyncio.sleep(0.5)
            await fill(admin)
            async with asyncio.timeout(30):
                while "waiting: Redis is full" not in err_path.read_text():
                    assert batch.poll() is None, err_path.read_text()
                    await asyncio.sleep(0.05)
            assert "maxmemory" in err_path.read_text()

            async with await StreamqClient.connect(redis_server.url) as client:
                with pytest.raises(RedisFull, match="maxmemory"):
                    await client.submit("refused", max_tokens=2)
            async with httpx.AsyncClient(base_url=gateway.url, timeout=30) as http:
                response = await http.post(
                    "/v1/completions", json={"model": SCRIPTED_MODEL, "prompt": "refused", "max_tokens": 2}
                )
            assert response.status_code == 503, response.text
            assert int(response.headers["Retry-After"]) > 0
            error = response.json()["error"]
            assert (error["code"], error["type"]) == ("redis_full", "service_unavailable_error")
            assert "maxmemory" in error["message"]
            await free(admin)
        assert await asyncio.to_thread(batch.wait, 120) == 0, err_path.read_text()
        assert sorted(answered()) == sorted(row["custom_id"] for row in rows), "each line once"

        out_path.unlink()
        await fill(admin)
        stopped = await asyncio.to_thread(subprocess.run, command, capture_output=True, text=True, timeout=120)
        assert stopped.returncode == 1, stopped.stderr
        assert "Redis is full" in stopped.stderr and "maxmemory" in stopped.stderr and "run again" in stopped.stderr
        assert not out_path.exists() or answered() == []
        await free(admin)
        rerun = await asyncio.to_thread(subprocess.run, command, capture_output=True, text=True, timeout=120)
        assert rerun.returncode == 0, rerun.stderr
        assert sorted(answered()) == sorted(row["custom_id"] for row in rows), "each line once"
        assert worker.process is not None and worker.process.poll() is None, worker.log_tail()
    finally:
        gateway.stop()
        assert worker.stop() == 0, worker.log_tail()


FILL_LINES = 1000
FILL_BUDGET = 400_000
"""Bytes of Redis a batch may add before Redis is full: about 250 finished lines' keys
(docs/operations/redis.md sizes one at 1.4 KB), so Redis fills a quarter of the way in."""


async def fill_for_real(admin: aioredis.Redis) -> None:
    """``noeviction``, with a limit ``FILL_BUDGET`` above what Redis holds: the requests
    fill it themselves."""
    await admin.config_set("maxmemory-policy", "noeviction")
    used = int((await admin.info("memory"))["used_memory"])
    await admin.config_set("maxmemory", used + FILL_BUDGET)


async def until_said(batch: subprocess.Popen[str], err_path: Path, words: str, timeout_s: float = 120) -> None:
    """Until the batch's output says ``words`` (or the batch ended: its output then says all)."""
    async with asyncio.timeout(timeout_s):
        while words not in err_path.read_text() and batch.poll() is None:
            await asyncio.sleep(0.05)


async def test_a_batch_that_fills_redis_says_so_and_a_rerun_answers_every_line_once(
    redis_server: RedisServer, admin: aioredis.Redis, tmp_path: Path
) -> None:
    """Redis fills for real, from the batch's own requests, a quarter of the way in: the
    batch says Redis is full (it stops sending, or waits on the requests in flight) naming
    its maxmemory; the worker stays up. Memory freed, the batch ends (status 1 when an
    enqueue was refused: the rest is left to a rerun), and a rerun answers the rest: every
    line once, each with its completion."""
    worker = scripted_worker(redis_server.url, tmp_path / "worker.log", tokens_per_s=1000, metrics_port=free_port())
    worker.start().wait_ready(timeout_s=120)
    batch_file = BatchFile(tmp_path, redis_server.url, lines=FILL_LINES)
    command, out_path, err_path = batch_file.command, batch_file.out_path, batch_file.err_path
    try:
        await fill_for_real(admin)
        with err_path.open("w") as err:
            batch = subprocess.Popen(command, stdout=err, stderr=subprocess.STDOUT, text=True)
        await until_said(batch, err_path, "Redis is full")
        said = err_path.read_text()
        assert "Redis is full" in said and "maxmemory" in said, said
        answered_when_full = len(batch_file.answered()) if out_path.exists() else 0
        assert answered_when_full < FILL_LINES, "Redis never filled"
        assert worker.process is not None and worker.process.poll() is None, worker.log_tail()

        await free(admin)
        status = await asyncio.to_thread(batch.wait, 120)
        said = err_path.read_text()
        if status == 1:  # an enqueue was refused: the lines after it are left to the rerun
            assert "run again" in said, said
        else:
            assert status == 0, said
        first_run = batch_file.answered()
        assert len(first_run) == len(set(first_run)), "a line answered twice"
        rerun = await asyncio.to_thread(subprocess.run, command, capture_output=True, text=True, timeout=120)
        assert rerun.returncode == 0, rerun.stderr
        written = [json.loads(line) for line in out_path.read_text().splitlines()]
        assert sorted(row["custom_id"] for row in written) == sorted(row["custom_id"] for row in batch_file.rows)
        assert all(row["response"]["status_code"] == 200 for row in written), "each line with its completion"
        assert worker.process.poll() is None, worker.log_tail()
        await until_ready_is(worker, 200)
    finally:
        await free(admin)
        assert worker.stop() == 0, worker.log_tail()


async def test_requests_that_fill_redis_through_the_gateway_are_answered_or_refused_with_nothing_queued(
    redis_server: RedisServer, admin: aioredis.Redis, tmp_path: Path
) -> None:
    """The same through the gateway, 8 clients at once: each request is answered (200) or
    refused (503 ``redis_full``, ``Retry-After``) while Redis is full from the requests'
    own keys, and a refused one left nothing in Redis to run later. Memory freed, every
    refused one sent again is answered: each prompt once."""
    worker = scripted_worker(redis_server.url, tmp_path / "worker.log", tokens_per_s=1000)
    worker.start().wait_ready(timeout_s=120)
    gateway = GatewayProcess(redis_server.url, tmp_path / "gateway.log").wait_ready()
    ids = [f"fill-{i}-{uuid.uuid4().hex[:8]}" for i in range(FILL_LINES)]
    answered: dict[str, int] = {}
    refused: list[str] = []
    try:
        await fill_for_real(admin)
        async with httpx.AsyncClient(base_url=gateway.url, timeout=120) as http:

            async def send(request_id: str) -> None:
                body = {"model": SCRIPTED_MODEL, "prompt": request_id, "max_tokens": 2}
                response = await http.post("/v1/completions", json=body, headers={"x-streamq-request-id": request_id})
                if response.status_code == 503:
                    error = response.json()["error"]
                    assert error["code"] == "redis_full" and "maxmemory" in error["message"], error
                    assert int(response.headers["Retry-After"]) > 0
                    refused.append(request_id)
                else:
                    assert response.status_code == 200, response.text
                    answered[request_id] = answered.get(request_id, 0) + 1

            async def client(mine: list[str]) -> None:
                for request_id in mine:
                    await send(request_id)
                    if len(refused) >= 20 and refused[-1] == request_id:  # full: let memory be freed
                        await asyncio.sleep(0.01)

            async def free_once_refused() -> None:
                while len(refused) < 20:
                    await asyncio.sleep(0.05)
                assert worker.process is not None and worker.process.poll() is None, worker.log_tail()
                for request_id in refused:  # nothing of it was stored, nothing to run later
                    assert not await admin.exists(f"arq:job:{request_id}", f"streamq:events:{request_id}")
                await free(admin)

            freeing = asyncio.ensure_future(free_once_refused())
            await asyncio.gather(*(client(ids[i::8]) for i in range(8)))
            await asyncio.wait_for(freeing, 60)
            assert refused, "Redis never filled"
            for request_id in list(refused):
                await send(request_id)
        assert sorted(answered) == sorted(ids) and set(answered.values()) == {1}, "each prompt answered once"
        assert worker.process is not None and worker.process.poll() is None, worker.log_tail()
    finally:
        await free(admin)
        gateway.stop()
        assert worker.stop() == 0, worker.log_tail()


async def test_a_batch_whose_worker_died_says_it_waits_for_one_and_goes_on_with_the_next(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    """The only worker is SIGKILLed mid-batch: ``streamq batch`` says that no worker is
    alive (instead of waiting in silence), and finishes once a new worker takes the queue:
    every line once."""
    worker = scripted_worker(redis_server.url, tmp_path / "worker.log", tokens_per_s=1000)
    worker.start().wait_ready(timeout_s=120)
    batch_file = BatchFile(tmp_path, redis_server.url, lines=200)
    command, out_path, err_path, rows = batch_file.command, batch_file.out_path, batch_file.err_path, batch_file.rows
    successor = scripted_worker(redis_server.url, tmp_path / "successor.log", tokens_per_s=1000)
    try:
        with err_path.open("w") as err:
            batch = subprocess.Popen(command, stdout=err, stderr=subprocess.STDOUT, text=True)
        async with asyncio.timeout(60):
            while not out_path.exists() or len(out_path.read_text().splitlines()) < 20:
                assert batch.poll() is None, err_path.read_text()
                await asyncio.sleep(0.02)
        worker.kill()
        async with asyncio.timeout(60):  # its registration lapses (10 s), then a stall check
            while "waiting: no worker is alive" not in err_path.read_text():
                assert batch.poll() is None, err_path.read_text()
                await asyncio.sleep(0.1)
        successor.start().wait_ready(timeout_s=120)
        assert await asyncio.to_thread(batch.wait, 120) == 0, err_path.read_text()
        written = [json.loads(line) for line in out_path.read_text().splitlines()]
        assert sorted(row["custom_id"] for row in written) == sorted(row["custom_id"] for row in rows), "each once"
        assert all(row["response"]["status_code"] == 200 for row in written)
    finally:
        worker.kill()
        successor.kill()


@pytest.mark.parametrize(
    ("policy", "flags", "starts", "said"),
    [
        ("allkeys-lru", (), False, "Refusing to start"),
        ("allkeys-lru", ("--allow-evicting-redis",), True, "maxmemory-policy is allkeys-lru"),
        ("volatile-lru", (), True, "maxmemory-policy is volatile-lru"),
        ("noeviction", (), True, "Redis: maxmemory-policy noeviction"),
    ],
)
async def test_a_worker_reads_what_redis_does_when_full_before_it_starts(
    redis_server: RedisServer,
    admin: aioredis.Redis,
    tmp_path: Path,
    policy: str,
    flags: tuple[str, ...],
    starts: bool,
    said: str,
) -> None:
    """As Sidekiq and BullMQ: under an evicting policy the worker warns that a full Redis
    deletes its keys, and under one that deletes any key it refuses to start unless told."""
    await admin.config_set("maxmemory-policy", policy)
    worker = scripted_worker(redis_server.url, tmp_path / "worker.log", *flags)
    try:
        if starts:
            worker.start().wait_ready(timeout_s=120)
        else:
            worker.start()
            assert worker.process is not None
            assert await asyncio.to_thread(worker.process.wait, 120) == 1, worker.log_tail()
        log = worker.log_path.read_text()
        assert said in log, worker.log_tail()
        if policy != "noeviction":
            assert "Set maxmemory-policy noeviction" in log
    finally:
        worker.kill()
