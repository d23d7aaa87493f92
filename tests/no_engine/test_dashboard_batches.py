"""The dashboard's batches panel: which batches a snapshot lists, in what order, with what
progress, read by a real gateway from batch records in a real Redis (as the Batch API's
``BatchStore`` writes them: a hash each, the unfinished ones in the active set, every one in
its owner's sorted set)."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis.asyncio as aioredis

from devkit.redis_server import RedisServer
from gateway.batch_api import names
from gateway.batch_api.config import BatchApiConfig
from gateway.batch_api.objects import BatchRecord
from gateway.dashboard.batches import RECENT_S, batch_rows
from streamq.protocol.roles import GATEWAY
from tests.support.gateway_in_process import gateway_client

NOW_S = 1_800_000_000


def record(batch_id: str, owner: str = names.OPEN_NAMESPACE, **fields: Any) -> BatchRecord:
    base: dict[str, Any] = {
        "id": batch_id,
        "owner": owner,
        "endpoint": "/v1/chat/completions",
        "input_file_id": "file-x",
        "completion_window": "24h",
        "created_at": NOW_S - 600,
        "expires_at": NOW_S + 86_400,
        "priority": 10,
        "output_expires_after_s": 2_592_000,
    }
    return BatchRecord(**(base | fields))


def test_unfinished_batches_come_first_oldest_first_then_those_ended_within_the_hour_newest_first() -> None:
    records = [
        record("b-new-running", status="in_progress", created_at=NOW_S - 10, total=5, completed=2, failed=1),
        record("b-old-validating", status="validating", created_at=NOW_S - 900),
        record("b-done", status="completed", completed_at=NOW_S - 60),
        record("b-cancelled-later", status="cancelled", cancelled_at=NOW_S - 30),
        record("b-failed-long-ago", status="failed", failed_at=NOW_S - RECENT_S - 1),
        record("b-expired", status="expired", expired_at=NOW_S - RECENT_S),
        record("b-cancelling", status="cancelling", created_at=NOW_S - 100, cancelling_at=NOW_S - 5),
    ]
    rows = batch_rows(records, NOW_S * 1000)
    assert [r.id for r in rows] == [
        "b-old-validating",
        "b-cancelling",
        "b-new-running",
        "b-cancelled-later",
        "b-done",
        "b-expired",
    ]
    running = rows[2]
    assert (running.status, running.total, running.completed, running.failed) == ("in_progress", 5, 2, 1)
    assert running.ended_at is None and rows[1].ended_at is None  # cancelling is not an end
    assert [r.ended_at for r in rows[3:]] == [NOW_S - 30, NOW_S - 60, NOW_S - RECENT_S]


@pytest.fixture
async def http(redis_server: RedisServer, tmp_path: Path) -> AsyncIterator[httpx.AsyncClient]:
    # The gateway's own Redis user, as deployed. No runner: these records have no input
    # file, and a runner would move them on.
    config = BatchApiConfig(files_url=str(tmp_path / "files"), run_batches=False)
    async with gateway_client(redis_server.url_for(GATEWAY), batch_api=config) as (_, client):
        yield client


async def store(admin: aioredis.Redis, batch: BatchRecord) -> None:
    """As ``BatchStore`` keeps a batch (one MULTI there)."""
    await admin.hset(names.batch_key(batch.id), mapping=batch.to_hash())  # type: ignore[misc]
    await admin.zadd(names.batches_of(batch.owner), {batch.id: batch.created_at * 1000})
    if batch.status not in {"completed", "failed", "expired", "cancelled"}:
        await admin.sadd(names.ACTIVE_BATCHES_KEY, batch.id)  # type: ignore[misc]


async def batches_of(http: httpx.AsyncClient, ids: set[str]) -> list[dict[str, Any]]:
    response = await http.get("/dashboard/api/snapshot")
    assert response.status_code == 200, response.text
    return [row for row in response.json()["batches"] if row["id"] in ids]


async def test_a_snapshot_lists_every_owners_unfinished_batches_and_recently_ended_ones_with_their_progress(
    http: httpx.AsyncClient, admin: aioredis.Redis
) -> None:
    tag = uuid.uuid4().hex[:8]
    now = int(time.time())
    team = f"team-{tag}"
    batches = [
        record(f"batch_{tag}_open_running", status="in_progress", created_at=now - 50, total=10, completed=4, failed=1),
        record(f"batch_{tag}_open_old", status="failed", created_at=now - 9000, failed_at=now - RECENT_S - 60),
        record(f"batch_{tag}_team_running", team, status="validating", created_at=now - 40),
        record(f"batch_{tag}_team_cancelled", team, status="cancelled", created_at=now - 100, cancelled_at=now - 10),
        record(
            f"batch_{tag}_team_done", team, status="completed", created_at=now - 300, completed_at=now - 20, total=3
        ),
    ]
    ids = {b.id for b in batches}
    try:
        for batch in batches:
            await store(admin, batch)
        first = await batches_of(http, ids)
        # Another owner's ended batches are found once one of its batches was seen unfinished.
        assert [r["id"] for r in first] == [f"batch_{tag}_open_running", f"batch_{tag}_team_running"]
        rows = await batches_of(http, ids)
        assert [r["id"] for r in rows] == [
            f"batch_{tag}_open_running",
            f"batch_{tag}_team_running",
            f"batch_{tag}_team_cancelled",
            f"batch_{tag}_team_done",
        ]
        running, team_running, cancelled, done = rows
        assert running == {
            "id": f"batch_{tag}_open_running",
            "owner": names.OPEN_NAMESPACE,
            "status": "in_progress",
            "endpoint": "/v1/chat/completions",
            "model": None,
            "total": 10,
            "completed": 4,
            "failed": 1,
            "created_at": now - 50,
            "ended_at": None,
            "expires_at": NOW_S + 86_400,
        }
        assert (team_running["owner"], team_running["status"]) == (team, "validating")
        assert (cancelled["status"], cancelled["ended_at"]) == ("cancelled", now - 10)
        assert (done["owner"], done["status"], done["ended_at"], done["total"]) == (team, "completed", now - 20, 3)

        # A batch that moves on shows its new state at the next reading; one deleted is gone.
        await admin.hset(names.batch_key(running["id"]), mapping={"completed": "9"})  # type: ignore[misc]
        await admin.delete(names.batch_key(done["id"]))
        rows = await batches_of(http, ids)
        assert [r["completed"] for r in rows if r["id"] == running["id"]] == [9]
        assert done["id"] not in {r["id"] for r in rows}
    finally:
        for batch in batches:
            await admin.delete(names.batch_key(batch.id))
            await admin.zrem(names.batches_of(batch.owner), batch.id)
            await admin.srem(names.ACTIVE_BATCHES_KEY, batch.id)  # type: ignore[misc]
