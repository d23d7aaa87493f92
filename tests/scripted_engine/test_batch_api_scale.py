"""The Batch API at scale and beside its neighbours, on the scripted engine: real gateway
processes, a real scripted worker, a Redis of the module's own (and, for the gateway on S3,
another with its own worker: every gateway on one Redis runs its batches, so shares one
storage), the openai SDK.

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
import threading
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any, Final

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
from producer.client import StreamqClient
from tests.support.key_commands import create_key, streamq_keys
from tests.support.worker_faults import paused

SLOTS = 32
TOKENS_PER_S = 1000
STATIC_KEY = "sq-static-" + uuid.uuid4().hex
CHAT: Final = "/v1/chat/completions"
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
def files_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("files")


@pytest.fixture(scope="module")
def gateway(
    scale_worker: WorkerProcess, files_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[GatewayProcess]:
    """One gateway, with files in a directory of its own and a static key (stored keys, which
    the tests create, close a gateway without one); it runs every batch of the module."""
    log = tmp_path_factory.mktemp("gateway") / "gateway.log"
    args = ("--api-key", STATIC_KEY, "--files-url", str(files_dir))
    process = GatewayProcess(scale_worker.redis_url, log, *args).wait_ready()
    yield process
    assert process.stop() == 0, process.log_tail()


@pytest.fixture
async def admin(scale_redis: RedisServer) -> AsyncIterator[aioredis.Redis]:
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


S3_PREFIX = "streamq-batches"
S3_LINES = 3 * PART_LINES + 100
"""Lines of the S3 batch: four output parts, the last one short."""
S3_SLOTS = 8
S3_TOKENS_PER_S = 100
S3_MAX_TOKENS = 2
"""The S3 batch's worker runs 8 lines at a time, 20 ms each: at least 2.75 s for the 1,100
lines after the first two parts, however fast the gateway, while the test looks for them."""


@pytest.fixture(scope="module")
def s3() -> Iterator[S3Server]:
    with S3Server(bucket="scale") as server:
        yield server


@pytest.fixture(scope="module")
def s3_worker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[WorkerProcess]:
    """A worker on a Redis of its own: a gateway runs any batch of its Redis, and every gateway
    on one Redis must share one storage (the module's other gateway keeps its files in a
    directory)."""
    with RedisServer() as server:
        log = tmp_path_factory.mktemp("s3-worker") / "worker.log"
        worker = scripted_worker(server.url, log, "--max-jobs", str(S3_SLOTS), tokens_per_s=S3_TOKENS_PER_S)
        worker.start().wait_ready(timeout_s=120)
        yield worker
        assert worker.stop() == 0, worker.log_tail()


@pytest.fixture(scope="module")
def s3_gateway(
    s3: S3Server, s3_worker: WorkerProcess, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[GatewayProcess]:
    process = GatewayProcess(
        s3_worker.redis_url,
        tmp_path_factory.mktemp("s3-gateway") / "gateway.log",
        "--api-key",
        STATIC_KEY,
        "--files-url",
        f"s3://{s3.bucket}/{S3_PREFIX}",
        "--s3-endpoint-url",
        s3.url,
        env={"AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY},
    ).wait_ready()
    yield process
    assert process.stop() == 0, process.log_tail()


def objects_under(storage: Storage, name: str) -> list[str]:
    """The objects under the folder ``name``, by their names in the storage: S3's own listing
    of keys (SeaweedFS keeps a folder whose objects are gone, as an empty prefix; S3 has no
    folders, and nothing is stored under it)."""
    bucket, _, root = storage.root.partition("/")
    listed = storage.fs.call_s3("list_objects_v2", Bucket=bucket, Prefix=f"{root}/{name}/")
    assert not listed.get("IsTruncated"), "more objects than one page"
    return sorted(item["Key"].removeprefix(root + "/") for item in listed.get("Contents", []))


def test_a_batch_on_s3_writes_its_output_in_parts_and_leaves_none(
    s3: S3Server, s3_worker: WorkerProcess, s3_gateway: GatewayProcess, tmp_path: Path
) -> None:
    storage = Storage.from_url(f"s3://{s3.bucket}/{S3_PREFIX}", s3.options())
    client = sdk(s3_gateway)
    custom_ids = [f"s3-{n}" for n in range(S3_LINES)]
    batch = create_batch(client, write_input(tmp_path / "input.jsonl", custom_ids, max_tokens=S3_MAX_TOKENS))
    assert objects_under(storage, "files") == [f"files/{batch.input_file_id}"]

    # Two parts written: the worker held still while the bucket is read (the parts stay
    # there until the batch completes, and the batch cannot complete meanwhile).
    until(client, batch.id, lambda b: b.request_counts is not None and b.request_counts.completed >= 2 * PART_LINES)
    with paused(s3_worker):
        deadline = time.monotonic() + 30
        while len(parts := objects_under(storage, f"batches/{batch.id}/out")) < 2:
            assert time.monotonic() < deadline, parts
            time.sleep(0.1)
    assert all(part.endswith(".jsonl") for part in parts), parts

    batch = until_final(client, batch.id)
    assert batch.status == "completed" and batch.error_file_id is None, batch
    lines = output_lines(client, batch)
    assert_each_once(lines, custom_ids)
    # In parts order: each line within a window of its place in the input.
    places = {custom_id: place for place, custom_id in enumerate(custom_ids)}
    offsets = [abs(places[line["custom_id"]] - place) for place, line in enumerate(lines)]
    assert max(offsets) < PARTS_ORDER_SLACK, max(offsets)
    # The output file is one object in the bucket, read back as the SDK read it; no part is left.
    assert batch.output_file_id is not None
    assert objects_under(storage, f"batches/{batch.id}") == []
    assert storage.fs.cat_file(storage.path(f"files/{batch.output_file_id}")) == (
        client.files.content(batch.output_file_id).content
    )
    assert objects_under(storage, "files") == sorted([f"files/{batch.input_file_id}", f"files/{batch.output_file_id}"])


def key_listing(redis_url: str, name: str) -> str:
    """The key's line of ``streamq keys list``."""
    listed = streamq_keys(redis_url, "list")
    assert listed.returncode == 0, listed.stderr
    [line] = [line for line in listed.stdout.splitlines() if line.split("\t")[0] == name]
    return line


def test_a_keys_usage_counts_its_batchs_tokens(
    gateway: GatewayProcess, scale_redis: RedisServer, tmp_path: Path
) -> None:
    name, secret = create_key(scale_redis.url)
    client = sdk(gateway, secret)
    lines, max_tokens = 10, 3
    custom_ids = [f"usage-{n}" for n in range(lines)]
    batch = until_final(
        client, create_batch(client, write_input(tmp_path / "in.jsonl", custom_ids, max_tokens=max_tokens)).id
    )
    assert batch.status == "completed", batch
    assert_each_once(output_lines(client, batch), custom_ids)
    assert batch.usage is not None
    assert (batch.usage.input_tokens, batch.usage.output_tokens) == (PROMPT_TOKENS * lines, max_tokens * lines)
    tokens = batch.usage.input_tokens + batch.usage.output_tokens
    assert key_listing(scale_redis.url, name).endswith(f"requests={lines} tokens={tokens}")


async def seconds_into_the_minute(redis: aioredis.Redis) -> float:
    seconds, micros = await redis.time()
    return float(seconds % 60 + micros / 1e6)


async def test_a_key_with_a_low_rpm_completes_its_batch(
    gateway: GatewayProcess, scale_redis: RedisServer, admin: aioredis.Redis, tmp_path: Path
) -> None:
    """Twice the key's rpm in lines: half wait for the next minute (the rate windows are
    minutes of Redis's clock), then run; none fails. The batch is created 8-25 s before a
    minute ends, so that its lines are all sent within that minute and the limit bites: the
    last line's reply is made in a later minute than the batch was created (with the limit,
    whenever the lines are sent: the fourth is admitted a minute after the first)."""
    rpm = 3
    name, secret = create_key(scale_redis.url, "--rpm", str(rpm))
    custom_ids = [f"rpm-{n}" for n in range(2 * rpm)]
    path = write_input(tmp_path / "in.jsonl", custom_ids, max_tokens=2)
    while not 35 <= (now := await seconds_into_the_minute(admin)) < 52:
        await asyncio.sleep((35 - now) % 60)
    client = sdk(gateway, secret)
    batch = await asyncio.to_thread(create_batch, client, path)
    batch = await asyncio.to_thread(until_final, client, batch.id)
    assert batch.status == "completed" and batch.error_file_id is None, batch
    assert batch.request_counts is not None and (batch.request_counts.completed, batch.request_counts.failed) == (
        2 * rpm,
        0,
    )
    lines = await asyncio.to_thread(output_lines, client, batch)
    assert_each_once(lines, custom_ids)
    assert max(line["response"]["body"]["created"] for line in lines) // 60 > batch.created_at // 60
    assert f"requests={2 * rpm} " in key_listing(scale_redis.url, name)


def chat(client: openai.OpenAI, request_id: str) -> Any:
    """An online chat request, at the gateway's priority for them (0), under ``request_id``."""
    return client.chat.completions.create(
        model=SCRIPTED_MODEL,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=2,
        extra_headers={"x-streamq-request-id": request_id},
    )


async def started_ms(streamq: StreamqClient, request_id: str) -> int:
    """When the request's job started (arq's result: stored as the worker acknowledges the
    job, just after the request's final event)."""
    async with asyncio.timeout(30):
        while (started := (await streamq.status(request_id)).started_ms) is None:
            await asyncio.sleep(0.02)
    return started


async def test_a_batch_leaves_slots_free_and_an_online_request_starts_at_once(
    gateway: GatewayProcess, scale_worker: WorkerProcess, tmp_path: Path
) -> None:
    """With the default reserve (4 slots a worker), a batch keeps its lines to the worker's
    slots less 4 (none waiting in the engine's queue, where they would take a freed slot
    ahead of an online request), and an online chat request starts while every batch line that was
    running when it came still runs: it waits for no batch line to end."""
    lines = 2 * SLOTS
    custom_ids = [f"reserve-{n}" for n in range(lines)]
    path = write_input(tmp_path / "in.jsonl", custom_ids, max_tokens=4 * TOKENS_PER_S)  # 4 s each
    client = sdk(gateway)
    batch = await asyncio.to_thread(create_batch, client, path)
    line_ids = [f"{batch.id}-{number}" for number in range(1, lines + 1)]
    async with StreamqClient.connect(scale_worker.redis_url) as streamq:

        async def states() -> dict[str, Any]:
            return {request_id: await streamq.status(request_id) for request_id in line_ids}

        deadline = time.monotonic() + 120
        while True:
            found = await states()
            running = [request_id for request_id, s in found.items() if s.state == "running"]
            assert len(running) <= SLOTS - 4, found
            if len(running) == SLOTS - 4:
                break
            assert time.monotonic() < deadline, found
            await asyncio.sleep(0.05)
        online_id = f"online-{uuid.uuid4().hex}"
        reply = await asyncio.to_thread(chat, client, online_id)
        assert reply.choices[0].message.content == " tok" * 2
        started = await started_ms(streamq, online_id)
        ended = [(await streamq.status(request_id)).ended_ms for request_id in running]
        batch = await asyncio.to_thread(until_final, client, batch.id)
        assert batch.status == "completed", batch
    assert all(ms is None or ms > started for ms in ended), (started, ended)
    assert_each_once(await asyncio.to_thread(output_lines, client, batch), custom_ids)


async def test_a_second_batch_gets_its_share_of_a_full_worker(
    gateway: GatewayProcess, scale_worker: WorkerProcess, tmp_path: Path
) -> None:
    """A batch fills the worker (its slots less the reserve); a second batch created then
    does not wait for the first to end: while the first still has lines it has not sent,
    each batch runs about half of the slots, and both complete with every line once."""
    client = sdk(gateway)
    sizes = {"first": 6 * SLOTS, "second": 3 * SLOTS}
    batches: dict[str, Batch] = {}
    ids: dict[str, list[str]] = {}
    for name, lines in sizes.items():
        ids[name] = [f"{name}-{n}" for n in range(lines)]
        path = write_input(tmp_path / f"{name}.jsonl", ids[name], max_tokens=2 * TOKENS_PER_S)  # 2 s each
        if name == "second":  # once the first fills the worker
            await until_running(scale_worker, batches["first"].id, sizes["first"], SLOTS - 4)
        batches[name] = await asyncio.to_thread(create_batch, client, path)
    share = (SLOTS - 4) // 2
    async with StreamqClient.connect(scale_worker.redis_url) as streamq:
        deadline = time.monotonic() + 120
        while True:
            running = {name: await running_lines(streamq, batches[name].id, sizes[name]) for name in sizes}
            unsent = await lines_in(streamq, batches["first"].id, sizes["first"], "unknown")
            assert unsent, running  # the first batch sent its last line before the second got its share
            if all(count >= share - 2 for count in running.values()):
                break
            assert time.monotonic() < deadline, running
            await asyncio.sleep(0.1)
    for name in sizes:
        done = await asyncio.to_thread(until_final, client, batches[name].id)
        assert done.status == "completed", done
        assert_each_once(await asyncio.to_thread(output_lines, client, done), ids[name])


async def lines_in(streamq: StreamqClient, batch_id: str, lines: int, state: str) -> int:
    """How many of the batch's lines are in ``state`` now (each line's request is
    ``<batch id>-<line>``; one not sent yet is ``unknown``)."""
    found = [await streamq.status(f"{batch_id}-{number}") for number in range(1, lines + 1)]
    return sum(1 for status in found if status.state == state)


async def running_lines(streamq: StreamqClient, batch_id: str, lines: int) -> int:
    return await lines_in(streamq, batch_id, lines, "running")


async def until_running(worker: WorkerProcess, batch_id: str, lines: int, count: int) -> None:
    async with StreamqClient.connect(worker.redis_url) as streamq:
        deadline = time.monotonic() + 120
        while (running := await running_lines(streamq, batch_id, lines)) < count:
            assert time.monotonic() < deadline, running
            await asyncio.sleep(0.1)
