"""The Batch API at scale and beside its neighbours, on the scripted engine: real gateway
processes, a real scripted worker, a Redis of the module's own, the openai SDK.

- a 20,000-line file runs with the gateway's memory (its RSS, read with psutil before, every
  few ms while it runs, and after) growing by a bound that does not scale with the file,
  and by no more than a 2,000-line batch on the same gateway makes it grow, give or take
  the validation's digests;
- a batch whose files live on a real S3 server (``weed mini``) writes its output in parts of
  ``PART_LINES``, concatenates them in order into its output file, and leaves no part behind;
- a stored API key's usage counts its batch's tokens, and a key with a low rpm completes its
  batch: its lines wait for the next minute, none fails;
- an online request arriving while a batch fills the worker starts ahead of every batch
  line waiting in the queue.

The worker runs ``SLOTS`` requests at once (``--max-jobs``: none held waiting in its engine),
``TOKENS_PER_S`` steps a second; the scripted engine counts 4 prompt tokens for any prompt
and makes ``max_tokens`` tokens, so token counts below are exact. The whole flow against the
real engine (cancel, expiry, a gateway or worker killed, tenants):
tests/real_engine/test_batch_api.py.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import openai
import psutil
import pytest
import redis.asyncio as aioredis
from openai.types import Batch

from devkit.gateway_process import GatewayProcess
from devkit.redis_server import RedisServer
from devkit.s3_server import ACCESS_KEY, SECRET_KEY, S3Server
from devkit.worker_process import SCRIPTED_MODEL, WorkerProcess, scripted_worker
from gateway.batch_api.runner import PART_LINES
from gateway.batch_api.storage import Storage
from producer.client import MIN_IN_FLIGHT, StreamqClient

SLOTS = 32
TOKENS_PER_S = 1000
STATIC_KEY = "sq-static-" + uuid.uuid4().hex
CHAT = "/v1/chat/completions"
PROMPT_TOKENS = 4
"""What the scripted engine counts for any prompt."""
FINAL = ("completed", "failed", "cancelled", "expired")
MiB = 1024 * 1024

LARGE_LINES = 20_000
SMALL_LINES = 2_000
PADDING = 2_000
"""Characters of each large line's message: about 2 KB a line, 4 prompt tokens all the same,
so that the file (~40 MiB) is larger than the bound on the gateway's memory: a gateway that
held the file, or its lines, could not stay under it."""
GROWTH_BOUND = 24 * MiB
"""The most the gateway's RSS may grow over a batch, whatever its size. What it holds at
once: the lines in flight (``MIN_IN_FLIGHT`` (64) here, twice the worker's 32 slots: each
line's ~2 KB, its request, reply and task, some tens of KB in all per line: ~3 MB), one part
of ``PART_LINES`` (1000) recorded output lines read back from Redis and written (~0.5 MB),
the 1 MiB chunk a file is read in, the upload's multipart buffers, and the validation's
custom_id digests (16 bytes, ~100 with Python's set: 2 MB at 20,000 lines, 5 MB at the
50,000 a batch may have), with the allocator's slack. About 10 MiB, measured."""
SCALING_BOUND = 8 * MiB
"""The most a batch of 10x the lines (and ~36 MiB more file) may raise the peak over a
2,000-line batch's: 18,000 more digests (~2 MB) and the allocator's slack. A gateway that
held anything per line would grow by tens of MiB here."""
PARTS_ORDER_SLACK = PART_LINES // 2
"""How far an output line may sit from its input line's place: lines are sent in order,
a window (64) in flight, so a line lands within that of its place; parts concatenated out
of order would put it about ``PART_LINES`` off."""


@pytest.fixture(scope="module")
def scale_redis() -> Iterator[RedisServer]:
    """The module's own Redis: no other gateway of the session takes its batches."""
    with RedisServer() as server:
        yield server


@pytest.fixture(scope="module")
def scale_worker(scale_redis: RedisServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[WorkerProcess]:
    log = tmp_path_factory.mktemp("worker") / "worker.log"
    worker = scripted_worker(scale_redis.url, log, "--max-jobs", str(SLOTS), tokens_per_s=TOKENS_PER_S)
    worker.start().wait_ready(timeout_s=120)
    yield worker
    assert worker.stop() == 0, worker.log_tail()


@pytest.fixture(scope="module")
def gateway(scale_worker: WorkerProcess, tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayProcess]:
    """One gateway, with files in a directory of its own and a static key (stored keys, which
    the tests create, close a gateway without one)."""
    files = tmp_path_factory.mktemp("files")
    log = tmp_path_factory.mktemp("gateway") / "gateway.log"
    args = ("--api-key", STATIC_KEY, "--files-url", str(files))
    process = GatewayProcess(scale_worker.redis_url, log, *args).wait_ready()
    yield process
    assert process.stop() == 0, process.log_tail()


@pytest.fixture
async def admin(scale_redis: RedisServer) -> Iterator[aioredis.Redis]:  # type: ignore[misc]
    client = aioredis.Redis.from_url(scale_redis.url)
    yield client
    await client.aclose()


def sdk(gateway: GatewayProcess, key: str = STATIC_KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=gateway.url + "/v1", api_key=key, max_retries=0, timeout=120)


def chat_line(custom_id: str, *, max_tokens: int = 1, padding: int = 0) -> str:
    body = {
        "model": SCRIPTED_MODEL,
        "messages": [{"role": "user", "content": "Say something" + " x" * (padding // 2)}],
        "max_tokens": max_tokens,
    }
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": CHAT, "body": body}) + "\n"


def write_input(path: Path, custom_ids: list[str], **line: Any) -> Path:
    with path.open("w") as file:
        for custom_id in custom_ids:
            file.write(chat_line(custom_id, **line))
    return path


def create_batch(client: openai.OpenAI, path: Path) -> Batch:
    uploaded = client.files.create(file=path, purpose="batch")
    return client.batches.create(input_file_id=uploaded.id, endpoint=CHAT, completion_window="24h")


def until_final(client: openai.OpenAI, batch_id: str, timeout_s: float = 300) -> Batch:
    deadline = time.monotonic() + timeout_s
    while (batch := client.batches.retrieve(batch_id)).status not in FINAL:
        assert time.monotonic() < deadline, batch
        time.sleep(0.2)
    return batch


def until(client: openai.OpenAI, batch_id: str, done: Any, timeout_s: float = 300) -> Batch:
    """Until ``done(batch)``; fails if the batch ends first."""
    deadline = time.monotonic() + timeout_s
    while not done(batch := client.batches.retrieve(batch_id)):
        assert batch.status not in FINAL and time.monotonic() < deadline, batch
        time.sleep(0.05)
    return batch


def output_lines(client: openai.OpenAI, batch: Batch) -> list[dict[str, Any]]:
    assert batch.output_file_id is not None, batch
    return [json.loads(line) for line in client.files.content(batch.output_file_id).text.splitlines()]


def assert_each_once(lines: list[dict[str, Any]], custom_ids: list[str]) -> None:
    seen = [line["custom_id"] for line in lines]
    assert len(seen) == len(custom_ids) and set(seen) == set(custom_ids), "a custom_id missing or twice"
    assert all(line["response"]["status_code"] == 200 and line["error"] is None for line in lines)


@contextmanager
def paused(worker: WorkerProcess) -> Iterator[None]:
    """The worker SIGSTOPped: it claims nothing, and its requests stand still, until the
    block ends. Kept short: a job's lease lapses after 3 s."""
    assert worker.process is not None
    os.kill(worker.process.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(worker.process.pid, signal.SIGCONT)


class PeakRss:
    """A process's resident memory, read every few ms in a thread while the block runs."""

    def __init__(self, pid: int) -> None:
        self.process = psutil.Process(pid)
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def now(self) -> int:
        return int(self.process.memory_info().rss)

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.now())
            self._stop.wait(0.005)

    def __enter__(self) -> PeakRss:
        self.peak = self.now()
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.now())


def run_measured(
    client: openai.OpenAI, gateway: GatewayProcess, path: Path, custom_ids: list[str]
) -> tuple[Batch, int]:
    """Upload ``path``, run it as a batch to its end and read its output back; the batch and
    the gateway's peak RSS over all of it."""
    with PeakRss(gateway.process.pid) as rss:
        batch = until_final(client, create_batch(client, path).id)
        assert batch.status == "completed", batch
        assert_each_once(output_lines(client, batch), custom_ids)
    return batch, rss.peak


def test_a_large_file_runs_with_the_gateway_memory_bounded(gateway: GatewayProcess, tmp_path: Path) -> None:
    client = sdk(gateway)
    warm = write_input(tmp_path / "warm.jsonl", ["warm-0", "warm-1"])  # the batch path's imports and pools
    assert until_final(client, create_batch(client, warm).id).status == "completed"
    before = PeakRss(gateway.process.pid).now()

    small_ids = [f"small-{n}" for n in range(SMALL_LINES)]
    small, small_peak = run_measured(
        client, gateway, write_input(tmp_path / "small.jsonl", small_ids, padding=PADDING), small_ids
    )
    large_ids = [f"large-{n}" for n in range(LARGE_LINES)]
    large_path = write_input(tmp_path / "large.jsonl", large_ids, padding=PADDING)
    assert large_path.stat().st_size > GROWTH_BOUND + 16 * MiB, "the file must not fit the bound"
    large, large_peak = run_measured(client, gateway, large_path, large_ids)

    after = PeakRss(gateway.process.pid).now()
    growth = {"small": small_peak - before, "large": large_peak - before, "after": after - before}
    report = {name: f"{value / MiB:.1f} MiB" for name, value in growth.items()}
    assert large_peak - before < GROWTH_BOUND, report
    assert large_peak - small_peak < SCALING_BOUND, report
    assert large.request_counts is not None and large.request_counts.completed == LARGE_LINES
    assert large.usage is not None and large.usage.input_tokens == PROMPT_TOKENS * LARGE_LINES
    assert small.request_counts is not None and small.request_counts.failed == 0
