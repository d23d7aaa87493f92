"""The batches' records in Redis (``objects.BatchRecord``, a hash each), their owners'
lists, and the moves a client makes (create, cancel); the runner makes the others.

A batch is created in one transaction with everything that points at it: its owner's list
(``names.batches_of``), the set of unfinished batches every gateway's runner scans
(``names.ACTIVE_BATCHES_KEY``), and its input file's users (``names.file_users_key``: the
file cannot be deleted under it). Creating and cancelling check and write under ``WATCH``,
so that two gateways deciding at once cannot both pass a bound, nor undo a runner's move.
"""

from __future__ import annotations

import builtins
import time
from collections.abc import Awaitable, Callable
from typing import Any, Final, TypeVar

from redis.exceptions import WatchError

from gateway.batch_api import names
from gateway.batch_api.config import BatchApiConfig
from gateway.batch_api.objects import FINAL_STATES, RUNNING_STATES, BatchRecord
from producer.openai_api.errors import ApiError, ApiErrorCode, ApiErrorType

CANCELLABLE: Final = frozenset({"validating", "in_progress"})
"""States a cancel moves to ``cancelling``; in ``cancelling`` and ``cancelled`` a cancel
answers the batch as it is (as OpenAI's does), in any other state it is a 409."""
WATCH_TRIES: Final = 50
"""Tries of a watched check-and-write before it gives up (each retry means another
gateway or the runner wrote meanwhile: a few at most in practice)."""

T = TypeVar("T")


class TooManyRunning(ApiError):
    """The owner has ``max_running_batches`` unfinished already: a 429, as OpenAI answers
    past its own limits."""

    def __init__(self, bound: int) -> None:
        message = f"this key has {bound} batches unfinished, as many as it may: wait for one to end, or cancel one"
        super().__init__(429, message, type=ApiErrorType.RATE_LIMIT, code=ApiErrorCode.RATE_LIMIT_EXCEEDED)


def batch_not_found(batch_id: str) -> ApiError:
    return ApiError(404, f"No batch found with id {batch_id!r}.", type=ApiErrorType.NOT_FOUND, param="batch_id")


class BatchStore:
    def __init__(self, redis: Any, config: BatchApiConfig) -> None:
        self.redis, self.config = redis, config

    async def create(self, record: BatchRecord) -> None:
        """Store ``record`` and what points at it, at once; raises ``TooManyRunning`` when
        its owner has ``config.max_running_batches`` unfinished (checked in the same
        transaction)."""

        async def attempt(pipe: Any) -> None:
            await pipe.watch(names.ACTIVE_BATCHES_KEY)
            if await self._running(pipe, record.owner) >= self.config.max_running_batches:
                raise TooManyRunning(self.config.max_running_batches)
            pipe.multi()
            pipe.hset(names.batch_key(record.id), mapping=record.to_hash())
            pipe.zadd(names.batches_of(record.owner), {record.id: _ms_now()})
            pipe.sadd(names.ACTIVE_BATCHES_KEY, record.id)
            pipe.sadd(names.file_users_key(record.input_file_id), record.id)
            await pipe.execute()

        await self._watched(attempt)

    async def get(self, batch_id: str, owner: str | None) -> BatchRecord | None:
        """The batch, if it is ``owner``'s (``None``: anyone's, for the runner)."""
        raw = await self.redis.hgetall(names.batch_key(batch_id))
        if not raw:
            return None
        record = BatchRecord.from_hash(raw)
        return record if owner is None or record.owner == owner else None

    async def list(self, owner: str, *, after: str | None, limit: int) -> tuple[builtins.list[BatchRecord], bool]:
        """The owner's batches newest first, from the one after ``after`` (an id it listed
        before; an id not its own lists nothing), at most ``limit``; and whether more follow."""
        key = names.batches_of(owner)
        start = 0
        if after is not None:
            rank = await self.redis.zrevrank(key, after)
            if rank is None:
                return [], False
            start = rank + 1
        ids = await self.redis.zrange(key, start, start + limit, desc=True)
        more = len(ids) > limit
        async with self.redis.pipeline(transaction=False) as pipe:
            for batch_id in ids[:limit]:
                pipe.hgetall(names.batch_key(_text(batch_id)))
            hashes = await pipe.execute()
        return [BatchRecord.from_hash(raw) for raw in hashes if raw], more

    async def running(self, owner: str) -> int:
        """The owner's unfinished batches, against ``config.max_running_batches``."""
        return await self._running(self.redis, owner)

    async def request_cancel(self, batch_id: str, owner: str) -> BatchRecord:
        """Move the batch to ``cancelling`` (the runner cancels its lines in flight and
        ends it ``cancelled``); the batch as it is then. Raises a 404 ``ApiError`` for a
        batch not the owner's, a 409 for one past cancelling (finalizing or final)."""
        key = names.batch_key(batch_id)

        async def attempt(pipe: Any) -> BatchRecord:
            await pipe.watch(key)
            raw = await pipe.hgetall(key)
            record = BatchRecord.from_hash(raw) if raw else None
            if record is None or record.owner != owner:
                raise batch_not_found(batch_id)
            if record.status not in CANCELLABLE:
                if record.status in ("cancelling", "cancelled"):
                    return record
                raise ApiError(409, f"Cannot cancel a batch with status {record.status!r}.")
            record.status, record.cancelling_at = "cancelling", int(time.time())
            pipe.multi()
            pipe.hset(key, mapping={"status": record.status, "cancelling_at": str(record.cancelling_at)})
            await pipe.execute()
            return record

        return await self._watched(attempt)

    async def counts_by_state(self) -> dict[str, int]:
        """The unfinished batches of every owner by state (``/metrics``); read from the set
        of unfinished batches, so it costs one read per unfinished batch, never a scan of
        every batch kept."""
        counts = dict.fromkeys(sorted(RUNNING_STATES), 0)
        for _, status in await self._active(self.redis):
            if status in counts:
                counts[status] += 1
        return counts

    async def _running(self, redis: Any, owner: str) -> int:
        return sum(1 for who, status in await self._active(redis) if who == owner and status not in FINAL_STATES)

    async def _active(self, redis: Any) -> builtins.list[tuple[str, str]]:
        """``(owner, status)`` of each batch in the set of unfinished ones."""
        ids = await redis.smembers(names.ACTIVE_BATCHES_KEY)
        if not ids:
            return []
        async with self.redis.pipeline(transaction=False) as pipe:
            for batch_id in ids:
                pipe.hmget(names.batch_key(_text(batch_id)), ["owner", "status"])
            replies = await pipe.execute()
        return [(_text(who), _text(status)) for who, status in replies if who is not None and status is not None]

    async def _watched(self, attempt: Callable[[Any], Awaitable[T]]) -> T:
        """``attempt`` on a transaction pipeline, again while a watched key changed under it."""
        for _ in range(WATCH_TRIES - 1):
            async with self.redis.pipeline(transaction=True) as pipe:
                try:
                    return await attempt(pipe)
                except WatchError:
                    continue
        async with self.redis.pipeline(transaction=True) as pipe:
            return await attempt(pipe)


def _ms_now() -> int:
    return time.time_ns() // 1_000_000


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
