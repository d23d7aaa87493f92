"""The dashboard's batches panel: the Batch API's batches, every owner's (the dashboard is an
operator's view behind its own keys), read-only, from their Redis records.

Shown: every unfinished batch (``names.ACTIVE_BATCHES_KEY``), and those that reached a final
state in the last ``RECENT_S``, found among the newest ``NEWEST_PER_OWNER`` batches of each
owner the sampler knows: the open namespace's, and every owner it has seen an unfinished
batch of (remembered, up to ``REMEMBERED_OWNERS``). So a batch of an owner whose batches all
ended before this gateway watched is not listed: no reading scans the keyspace for owners.
A reading is two pipelined round trips, whatever the batches' sizes.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import msgspec

from gateway.batch_api import names
from gateway.batch_api.objects import FINAL_STATES, BatchRecord, BatchStatus

RECENT_S = 3600
"""A finished batch stays listed this long after its end."""
NEWEST_PER_OWNER = 10
"""Batches of each known owner read for the recently finished ones."""
MAX_ACTIVE_ROWS = 200
"""Unfinished batches listed at most (the oldest first: those an operator looks for)."""
MAX_RECENT_ROWS = 20
REMEMBERED_OWNERS = 1000


class BatchRow(msgspec.Struct):
    id: str
    owner: str
    status: BatchStatus
    endpoint: str
    model: str | None
    total: int
    """Lines holding a request (0 while the input is being validated)."""
    completed: int
    failed: int
    created_at: int
    """Seconds, as the API's ``created_at``."""
    ended_at: int | None
    """When it reached its final state (completed, failed, expired or cancelled)."""
    expires_at: int


def ended_at(record: BatchRecord) -> int | None:
    return {
        "completed": record.completed_at,
        "failed": record.failed_at,
        "expired": record.expired_at,
        "cancelled": record.cancelled_at,
    }.get(record.status)


def batch_rows(records: list[BatchRecord], now_ms: int) -> list[BatchRow]:
    """Unfinished batches oldest first, then those that ended within ``RECENT_S``, newest
    end first; each batch once."""
    by_id = {record.id: record for record in records}
    active = sorted((r for r in by_id.values() if r.status not in FINAL_STATES), key=lambda r: (r.created_at, r.id))
    since = now_ms // 1000 - RECENT_S
    ended = [r for r in by_id.values() if r.status in FINAL_STATES and (ended_at(r) or r.created_at) >= since]
    ended.sort(key=lambda r: (-(ended_at(r) or r.created_at), r.id))
    return [_row(r) for r in active[:MAX_ACTIVE_ROWS] + ended[:MAX_RECENT_ROWS]]


def _row(record: BatchRecord) -> BatchRow:
    return BatchRow(
        id=record.id,
        owner=record.owner,
        status=record.status,
        endpoint=record.endpoint,
        model=record.model,
        total=record.total,
        completed=record.completed,
        failed=record.failed,
        created_at=record.created_at,
        ended_at=ended_at(record),
        expires_at=record.expires_at,
    )


class BatchReader:
    """Reads the batches a snapshot shows, remembering the owners it has seen."""

    def __init__(self) -> None:
        self._owners: OrderedDict[str, None] = OrderedDict({names.OPEN_NAMESPACE: None})

    async def read(self, redis: Any) -> list[BatchRecord]:
        owners = list(self._owners)
        async with redis.pipeline(transaction=False) as pipe:
            pipe.smembers(names.ACTIVE_BATCHES_KEY)
            for owner in owners:
                pipe.zrange(names.batches_of(owner), 0, NEWEST_PER_OWNER - 1, desc=True)
            replies = await pipe.execute()
        ids = sorted({_text(i) for reply in replies for i in reply})
        if not ids:
            return []
        async with redis.pipeline(transaction=False) as pipe:
            for batch_id in ids:
                pipe.hgetall(names.batch_key(batch_id))
            hashes = await pipe.execute()
        records = []
        for raw in hashes:
            if not raw:  # deleted between the two reads
                continue
            try:
                record = BatchRecord.from_hash(raw)
            except (msgspec.ValidationError, ValueError):
                continue  # a record of another version: not the dashboard's to judge
            records.append(record)
            self._remember(record.owner)
        return records

    def _remember(self, owner: str) -> None:
        self._owners[owner] = None
        self._owners.move_to_end(owner)
        while len(self._owners) > REMEMBERED_OWNERS:
            oldest = next(iter(self._owners))
            if oldest == names.OPEN_NAMESPACE:
                self._owners.move_to_end(oldest)
                continue
            del self._owners[oldest]


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
