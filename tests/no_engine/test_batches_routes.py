"""The Batch API's batches over HTTP with the openai SDK, no engine and no runner: a gateway
served in-process, each test with two API keys of its own (stored ones: two tenants). A
batch is created ``validating`` from its owner's input file, read back and listed to the
end, cancelled as OpenAI's state rules say; what OpenAI refuses is a 400 naming the param,
another tenant's batch a 404, a tenant past its bound of unfinished batches a 429; and
``/metrics`` counts the batches by state.

The input files are written here as the files' records (``FileRecord`` in Redis) and
bytes, as ``/v1/files`` stores them: these tests are about batches, not uploads.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import redis.asyncio as aioredis

from devkit.redis_server import RedisServer
from gateway.batch_api import names
from gateway.batch_api.config import BatchApiConfig
from gateway.batch_api.objects import BatchRecord, FileRecord
from streamq.broker.api_keys import ApiKeyStore, KeyRecord
from tests.support.gateway_in_process import gateway_client

OPERATOR_KEY = "operator-secret"
MAX_RUNNING = 5
CHAT = "/v1/chat/completions"


@dataclass
class Tenant:
    name: str
    sdk: openai.AsyncOpenAI
    http: httpx.AsyncClient


@dataclass
class Setup:
    admin: aioredis.Redis
    files_dir: Path
    one: Tenant
    other: Tenant

    async def input_file(self, owner: Tenant, lines: int = 2, *, purpose: str = "batch") -> FileRecord:
        """A file of ``lines`` chat requests, stored as ``/v1/files`` stores an upload."""
        data = "".join(
            json.dumps({"custom_id": f"c{i}", "method": "POST", "url": CHAT, "body": {"messages": []}}) + "\n"
            for i in range(lines)
        ).encode()
        record = FileRecord(
            id=f"file-{uuid.uuid4().hex}",
            owner=owner.name,
            bytes=len(data),
            created_at=int(time.time()),
            filename="input.jsonl",
            purpose=purpose,  # type: ignore[arg-type]
            lines=lines,
        )
        (self.files_dir / "files").mkdir(parents=True, exist_ok=True)
        (self.files_dir / "files" / record.id).write_bytes(data)
        await self.admin.hset(names.file_key(record.id), mapping=record.to_hash())
        await self.admin.zadd(names.files_of(owner.name), {record.id: time.time_ns() // 1_000_000})
        return record

    async def batch(self, owner: Tenant, **fields: Any) -> Any:
        file = await self.input_file(owner)
        return await owner.sdk.batches.create(input_file_id=file.id, endpoint=CHAT, completion_window="24h", **fields)

    async def set_status(self, batch_id: str, status: str) -> None:
        """Play the runner: move the batch on."""
        await self.admin.hset(names.batch_key(batch_id), "status", status)


@pytest.fixture
async def setup(redis_server: RedisServer, admin: aioredis.Redis, tmp_path: Path) -> AsyncIterator[Setup]:
    keys = ApiKeyStore(admin)
    tenants = [f"batches-{uuid.uuid4().hex[:8]}" for _ in range(2)]
    secrets = [await keys.create(KeyRecord(name)) for name in tenants]
    # No runner: the tests play it (set_status), so nothing moves a batch behind their back.
    config = BatchApiConfig(files_url=str(tmp_path), max_running_batches=MAX_RUNNING, run_batches=False)
    try:
        async with gateway_client(redis_server.url, api_keys=[OPERATOR_KEY], batch_api=config) as (_, http):
            base = str(http.base_url)
            clients = [
                (
                    openai.AsyncOpenAI(base_url=base + "/v1", api_key=secret, max_retries=0),
                    httpx.AsyncClient(base_url=base, headers={"Authorization": f"Bearer {secret}"}),
                )
                for secret in secrets
            ]
            one, other = (Tenant(name, sdk, h) for name, (sdk, h) in zip(tenants, clients, strict=True))
            yield Setup(admin, tmp_path, one, other)
            for sdk, h in clients:
                await sdk.close()
                await h.aclose()
    finally:
        for name in tenants:
            for batch_id in await admin.zrange(names.batches_of(name), 0, -1):
                await admin.srem(names.ACTIVE_BATCHES_KEY, batch_id)  # no runner here to end them
            await keys.revoke(name)


async def test_a_batch_is_created_validating_from_its_owners_file_and_read_back(setup: Setup) -> None:
    file = await setup.input_file(setup.one, lines=3)
    before = int(time.time())
    batch = await setup.one.sdk.batches.create(
        input_file_id=file.id, endpoint=CHAT, completion_window="24h", metadata={"run": "nightly"}
    )
    assert re.fullmatch(r"batch_[0-9a-f]{32}", batch.id)
    assert (batch.status, batch.endpoint, batch.input_file_id, batch.completion_window) == (
        "validating",
        CHAT,
        file.id,
        "24h",
    )
    assert batch.request_counts is not None
    assert (batch.request_counts.total, batch.request_counts.completed, batch.request_counts.failed) == (3, 0, 0)
    assert batch.metadata == {"run": "nightly"} and batch.errors is None and batch.output_file_id is None
    assert before <= batch.created_at <= int(time.time()) and batch.expires_at == batch.created_at + 24 * 3600
    again = await setup.one.sdk.batches.retrieve(batch.id)
    assert again.model_dump() == batch.model_dump()
    assert await setup.admin.sismember(names.ACTIVE_BATCHES_KEY, batch.id)
    assert await setup.admin.sismember(names.file_users_key(file.id), batch.id)
    stored = BatchRecord.from_hash(await setup.admin.hgetall(names.batch_key(batch.id)))
    assert (stored.owner, stored.queue_tenant, stored.priority) == (setup.one.name, setup.one.name, 10)
    assert stored.key_digest and stored.output_expires_after_s == 30 * 24 * 3600


async def test_output_expires_after_is_kept_for_the_runner(setup: Setup) -> None:
    batch = await setup.batch(setup.one, extra_body={"output_expires_after": {"anchor": "created_at", "seconds": 7200}})
    stored = BatchRecord.from_hash(await setup.admin.hgetall(names.batch_key(batch.id)))
    assert stored.output_expires_after_s == 7200


async def test_the_list_is_newest_first_and_its_pages_end(setup: Setup) -> None:
    created = [(await setup.batch(setup.one)).id for _ in range(5)]
    page = await setup.one.sdk.batches.list(limit=2)
    assert [b.id for b in page.data] == created[::-1][:2] and page.has_more
    assert [b.id async for b in await setup.one.sdk.batches.list(limit=2)] == created[::-1]
    body = (await setup.one.http.get("/v1/batches", params={"after": created[1], "limit": 10})).json()
    assert (body["object"], [b["id"] for b in body["data"]], body["has_more"]) == ("list", [created[0]], False)
    assert (body["first_id"], body["last_id"]) == (created[0], created[0])
    empty = (await setup.one.http.get("/v1/batches", params={"after": created[0]})).json()
    assert (empty["data"], empty["first_id"], empty["last_id"], empty["has_more"]) == ([], None, None, False)


async def test_another_tenants_batch_is_not_found_and_not_listed(setup: Setup) -> None:
    batch = await setup.batch(setup.one)
    with pytest.raises(openai.NotFoundError):
        await setup.other.sdk.batches.retrieve(batch.id)
    with pytest.raises(openai.NotFoundError):
        await setup.other.sdk.batches.cancel(batch.id)
    assert [b.id async for b in setup.other.sdk.batches.list()] == []
    assert (await setup.one.sdk.batches.retrieve(batch.id)).status == "validating"
    with pytest.raises(openai.NotFoundError):
        await setup.one.sdk.batches.retrieve(f"batch_{uuid.uuid4().hex}")


async def test_another_tenants_file_is_not_found(setup: Setup) -> None:
    theirs = await setup.input_file(setup.other)
    with pytest.raises(openai.NotFoundError) as caught:
        await setup.one.sdk.batches.create(input_file_id=theirs.id, endpoint=CHAT, completion_window="24h")
    assert caught.value.body["param"] == "input_file_id"  # type: ignore[index]


def bad_create_bodies(file_id: str, output_file_id: str) -> list[tuple[dict[str, Any], str, int]]:
    good = {"input_file_id": file_id, "endpoint": CHAT, "completion_window": "24h"}
    return [
        ({**good, "endpoint": "/v1/moderations"}, "endpoint", 400),
        ({**good, "endpoint": "/v1/responses"}, "endpoint", 400),
        ({**good, "completion_window": "1h"}, "completion_window", 400),
        ({**good, "metadata": {f"k{i}": "v" for i in range(17)}}, "metadata", 400),
        ({**good, "metadata": {"k" * 65: "v"}}, "metadata", 400),
        ({**good, "metadata": {"tags": ["a", "b"]}}, "metadata.tags", 400),
        ({**good, "metadata": {"k": "v" * 513}}, "metadata.k", 400),
        ({**good, "metadata": "text"}, "metadata", 400),
        (
            {**good, "output_expires_after": {"anchor": "created_at", "seconds": 60}},
            "output_expires_after.seconds",
            400,
        ),
        ({**good, "output_expires_after": {"anchor": "now", "seconds": 3600}}, "output_expires_after.anchor", 400),
        ({**good, "unknown": 1}, "unknown", 400),
        ({k: v for k, v in good.items() if k != "input_file_id"}, "input_file_id", 400),
        ({**good, "input_file_id": f"file-{uuid.uuid4().hex}"}, "input_file_id", 404),
        ({**good, "input_file_id": output_file_id}, "input_file_id", 400),
    ]


async def test_what_openai_refuses_is_a_400_naming_the_param_and_stores_nothing(setup: Setup) -> None:
    file = await setup.input_file(setup.one)
    output = await setup.input_file(setup.one, purpose="batch_output")
    for body, param, status in bad_create_bodies(file.id, output.id):
        response = await setup.one.http.post("/v1/batches", json=body)
        assert response.status_code == status, (body, response.text)
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["param"] == param, (body, error)
    assert await setup.admin.zcard(names.batches_of(setup.one.name)) == 0
    limits = [await setup.one.http.get("/v1/batches", params={"limit": limit}) for limit in ("0", "101", "x")]
    assert [(r.status_code, r.json()["error"]["param"]) for r in limits] == [(400, "limit")] * 3


async def test_past_its_bound_of_unfinished_batches_a_tenant_gets_429_and_another_does_not(setup: Setup) -> None:
    for _ in range(MAX_RUNNING):
        await setup.batch(setup.one)
    with pytest.raises(openai.RateLimitError):
        await setup.batch(setup.one)
    assert await setup.admin.zcard(names.batches_of(setup.one.name)) == MAX_RUNNING
    await setup.batch(setup.other)
    finished = (await setup.one.sdk.batches.list()).data[0]
    await setup.set_status(finished.id, "completed")  # a batch that ended no longer counts
    await setup.batch(setup.one)


async def test_cancel_moves_a_running_batch_to_cancelling_once(setup: Setup) -> None:
    batch = await setup.batch(setup.one)
    cancelling = await setup.one.sdk.batches.cancel(batch.id)
    assert cancelling.status == "cancelling" and cancelling.cancelling_at is not None
    again = await setup.one.sdk.batches.cancel(batch.id)
    assert again.model_dump() == cancelling.model_dump()
    assert (await setup.one.sdk.batches.retrieve(batch.id)).model_dump() == cancelling.model_dump()
    running = await setup.batch(setup.one)
    await setup.set_status(running.id, "in_progress")
    assert (await setup.one.sdk.batches.cancel(running.id)).status == "cancelling"


@pytest.mark.parametrize("status", ["finalizing", "completed", "failed", "expired"])
async def test_a_batch_past_cancelling_cannot_be_cancelled(setup: Setup, status: str) -> None:
    batch = await setup.batch(setup.one)
    await setup.set_status(batch.id, status)
    with pytest.raises(openai.ConflictError) as caught:
        await setup.one.sdk.batches.cancel(batch.id)
    assert status in caught.value.message
    assert (await setup.one.sdk.batches.retrieve(batch.id)).status == status


async def test_a_cancelled_batch_is_answered_as_it_is(setup: Setup) -> None:
    batch = await setup.batch(setup.one)
    await setup.set_status(batch.id, "cancelled")
    assert (await setup.one.sdk.batches.cancel(batch.id)).status == "cancelled"


def validating_on(text: str) -> int:
    (count,) = re.findall(r'^streamq_batches\{state="validating"\} (\d+(?:\.\d+)?)$', text, re.MULTILINE)
    return int(float(count))


async def test_metrics_count_the_unfinished_batches_by_state(setup: Setup) -> None:
    http = setup.one.http
    before = validating_on((await http.get("/metrics")).text)
    batch = await setup.batch(setup.one)
    text = (await http.get("/metrics")).text
    assert validating_on(text) == before + 1
    assert 'streamq_batch_lines_total{result="completed"}' in text
    await setup.one.sdk.batches.cancel(batch.id)
    text = (await http.get("/metrics")).text
    assert validating_on(text) == before and re.search(r'^streamq_batches\{state="cancelling"\} [1-9]', text, re.M)
