"""A batch through Redis faults: a Redis SIGKILLed and started again on its append-only
file, and a Sentinel failover, in the middle of a batch of a few hundred lines.

Real parts: one ``python -m gateway`` (which runs the batch: the openai SDK uploads the
file, creates the batch, polls it and reads its files), one ``python -m worker`` on the
scripted engine (every line takes ``LINE_TOKENS`` tokens at ``TOKENS_PER_S`` a second,
``MAX_JOBS`` at a time, so the batch lasts long enough for the fault to land in it), and real
Redis processes. What is under test is the batch's record, lines in flight and results in
Redis, and every Redis connection of both processes, not the model.

The fault comes once ``FAULT_AFTER`` lines are answered, and the test reads Redis just
before it to check that it did land mid-batch: lines in flight and lines not read yet.
Then the batch must complete with every ``custom_id`` once across its output and error
files, every line a success (no line answered with an error because Redis was away), as
one run of its request.

Persistence: ``RedisServer(persistent=True)`` runs ``appendonly yes`` with ``appendfsync
always``. Under ``always`` every write Redis acknowledged is on disk before its reply, so
the restart gives back everything any process was told was written, whatever kills the
server: that is the configuration the claim "nothing lost" is made for (docs/reliability.md).
``everysec`` would pass the same test here (a SIGKILLed server's writes are in the OS's page
cache, which outlives it), so it would prove nothing more; it differs only on a host crash.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
import redis.asyncio as aioredis
from openai.types import Batch

from devkit.chaos import restart_redis
from devkit.gateway_process import GatewayProcess
from devkit.redis_server import RedisServer, SentinelServer
from devkit.worker_process import SCRIPTED_MODEL, scripted_worker
from gateway.batch_api.names import batch_inflight_key, batch_key
from tests.support.sentinels import replicated_redis_with_sentinels

LINES = 240
TOKENS_PER_S = 20
LINE_TOKENS = 10
"""Half a second a line, whatever the machine's speed: the scripted engine's clock."""
MAX_JOBS = 8
"""Lines the worker runs at once: the batch lasts ``LINES / MAX_JOBS`` half seconds."""
FAULT_AFTER = 40
"""Lines answered before the fault: about a sixth of the batch."""
WAIT_S = 180.0
"""How long the batch may take to end (a bound on a hang, not a timing the test checks)."""
FINAL = frozenset({"completed", "failed", "expired", "cancelled"})

Fault = Callable[[], Awaitable[str]]
"""Breaks Redis (and waits until it serves again); says what it did, in words."""


def batch_input() -> tuple[bytes, list[str]]:
    """The batch's JSONL file and its custom ids."""
    ids = [f"line-{i}-{uuid.uuid4().hex[:6]}" for i in range(LINES)]
    lines = [
        {
            "custom_id": custom_id,
            "method": "POST",
            "url": "/v1/completions",
            "body": {"model": SCRIPTED_MODEL, "prompt": f"prompt {i}", "max_tokens": LINE_TOKENS},
        }
        for i, custom_id in enumerate(ids)
    ]
    return b"".join(json.dumps(line).encode() + b"\n" for line in lines), ids


async def file_lines(sdk: openai.AsyncOpenAI, file_id: str | None) -> list[dict[str, Any]]:
    if file_id is None:
        return []
    text = (await sdk.files.content(file_id)).text
    return [json.loads(x) for x in text.splitlines() if x.strip()]


async def wait_until(sdk: openai.AsyncOpenAI, batch_id: str, done: Callable[[Batch], bool], what: str) -> Batch:
    async with asyncio.timeout(WAIT_S):
        while True:
            batch = await sdk.batches.retrieve(batch_id)
            if done(batch):
                return batch
            assert batch.status not in FINAL, f"ended {batch.status} before {what}: {batch}"
            await asyncio.sleep(0.2)


def answered(batch: Batch) -> int:
    counts = batch.request_counts
    return 0 if counts is None else counts.completed + counts.failed


@pytest.fixture
def files_dir(tmp_path: Path) -> Path:
    """The batch's own file storage."""
    directory = tmp_path / "files"
    directory.mkdir()
    return directory


async def run_batch_through(fault: Fault, url: str, inspect_url: str, tmp_path: Path, files_dir: Path) -> None:
    """Run a batch through a gateway and a worker on ``url``, break Redis with ``fault`` once
    ``FAULT_AFTER`` lines are answered, and check that the batch completes with each line
    answered once, successfully. ``inspect_url``: the master itself, where the test reads what
    the batch holds just before the fault."""
    worker = scripted_worker(
        url, tmp_path / "worker.log", "--max-jobs", str(MAX_JOBS), tokens_per_s=TOKENS_PER_S, ready_url=inspect_url
    )
    worker.start().wait_ready(timeout_s=120)
    gateway = GatewayProcess(url, tmp_path / "gateway.log", "--files-url", str(files_dir)).wait_ready()
    logs = lambda: f"gateway:\n{gateway.log_tail(60)}\n\nworker:\n{worker.log_tail()}"  # noqa: E731
    try:
        async with openai.AsyncOpenAI(base_url=gateway.url + "/v1", api_key="unused", timeout=60) as sdk:
            data, custom_ids = batch_input()
            uploaded = await sdk.files.create(file=("input.jsonl", data), purpose="batch")
            created = await sdk.batches.create(
                input_file_id=uploaded.id, endpoint="/v1/completions", completion_window="24h"
            )
            await wait_until(sdk, created.id, lambda b: answered(b) >= FAULT_AFTER, f"{FAULT_AFTER} lines answered")

            inspect = aioredis.Redis.from_url(inspect_url)
            try:
                in_flight = await inspect.hlen(batch_inflight_key(created.id))
                next_line = int(await inspect.hget(batch_key(created.id), "next_line") or 0)
            finally:
                await inspect.aclose()
            what = await fault()
            assert in_flight > 0 and next_line < LINES, (
                f"the fault ({what}) did not land mid-batch: {in_flight} lines in flight, {next_line} read"
            )

            batch = await wait_until(sdk, created.id, lambda b: b.status in FINAL, "its end")
            output = await file_lines(sdk, batch.output_file_id)
            errors = await file_lines(sdk, batch.error_file_id)
    finally:
        gateway_code = gateway.stop()
        worker_code = worker.stop()
    assert batch.status == "completed", f"{batch}\n{logs()}"
    assert errors == [], f"lines answered with an error after {what}: {errors[:5]}\n{logs()}"
    every = Counter(result["custom_id"] for result in output + errors)
    assert every == Counter(custom_ids), (
        f"after {what}: missing {sorted(set(custom_ids) - set(every))[:10]},"
        f" more than once {[i for i, n in every.items() if n > 1][:10]}\n{logs()}"
    )
    for result in output:
        assert result["error"] is None and result["response"]["status_code"] == 200, result
        body = result["response"]["body"]
        assert body["usage"]["completion_tokens"] == LINE_TOKENS, result  # one run, to its end
        assert body["choices"][0]["finish_reason"] == "length", result
    assert batch.request_counts is not None
    assert (batch.request_counts.completed, batch.request_counts.failed) == (LINES, 0), batch
    assert batch.usage is not None and batch.usage.output_tokens == LINES * LINE_TOKENS, batch
    assert (gateway_code, worker_code) == (0, 0), logs()


@pytest.fixture
def restartable_redis() -> Iterator[RedisServer]:
    with RedisServer(persistent=True) as server:
        yield server


@pytest.mark.parametrize(
    "down_s",
    [0.5, 5.0, 25.0],
    ids=["a short restart", "an outage longer than the batch's lease", "an outage longer than the retries"],
)
async def test_a_batch_completes_each_line_once_across_a_redis_killed_and_restarted_on_its_aof(
    restartable_redis: RedisServer, tmp_path: Path, files_dir: Path, down_s: float
) -> None:
    """Redis SIGKILLed (nothing more written) and started on its append-only file and port.
    Past the lease (3 s), the batch's lease has lapsed when Redis is back: its gateway stops
    its run, takes the batch again and follows the lines that were in flight."""

    async def kill_and_restart() -> str:
        await restart_redis(restartable_redis, down_s, crash=True)
        return f"Redis SIGKILLed and restarted after {down_s} s"

    await run_batch_through(kill_and_restart, restartable_redis.url, restartable_redis.url, tmp_path, files_dir)


async def test_a_batch_completes_each_line_once_across_a_sentinel_failover(tmp_path: Path, files_dir: Path) -> None:
    """The master SIGKILLed; the Sentinels promote the replica; the gateway and the worker,
    given only the Sentinels' addresses, follow it."""
    with replicated_redis_with_sentinels() as (url, master, replica, sentinels):

        async def fail_over() -> str:
            await asyncio.to_thread(master.kill)
            await asyncio.to_thread(wait_promoted, sentinels, replica)
            return f"master {master.port} SIGKILLed, replica {replica.port} promoted"

        await run_batch_through(fail_over, url, master.url, tmp_path, files_dir)


def wait_promoted(sentinels: list[SentinelServer], replica: RedisServer) -> None:
    for sentinel in sentinels:
        sentinel.wait_until(lambda state: int(state["port"]) == replica.port)
