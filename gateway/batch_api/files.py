"""Files: their bytes in the storage (``files/<id>``), their records in Redis, owned by a
tenant (``names.files_of``), bounded in size (``max_file_bytes``) and, per owner, in bytes
kept (``max_stored_bytes``), and deleted when they expire (the sweep).

A record is written only once its bytes are whole in the storage, and removed before
them, so a record always names bytes that are there. A gateway that dies between the two
leaves bytes no record names (and, during an upload, its owner's count of bytes too high by
them) until an operator clears them: never a record without its bytes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterable, AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any, Final

from redis.exceptions import WatchError

from gateway.batch_api import names
from gateway.batch_api.config import BatchApiConfig
from gateway.batch_api.objects import FilePurpose, FileRecord
from gateway.batch_api.storage import Storage
from producer.openai_api.errors import ApiError, ApiErrorType

logger = logging.getLogger("streamq.gateway.files")

SWEEP_EVERY_S: Final = 60.0
"""How often each gateway deletes the files that have expired (and once as it starts)."""
SWEEP_BATCH: Final = 100
"""Expired files one pass of the sweep reads at a time."""
STORED_BYTES_CODE: Final = "stored_bytes_exceeded"
FILE_TOO_LARGE_CODE: Final = "file_too_large"
FILE_IN_USE_CODE: Final = "file_in_use"


class FileTooLarge(Exception):
    """An upload passed ``max_file_bytes``; it was stopped there and nothing was kept."""

    def __init__(self, limit: int) -> None:
        super().__init__(f"the file is larger than {limit} bytes, the limit (the gateway's --batch-max-file-bytes)")
        self.limit = limit

    def api_error(self) -> ApiError:
        return ApiError(413, str(self), code=FILE_TOO_LARGE_CODE, param="file")


class FileInUse(Exception):
    """The file is the input of a batch that has not finished: deleting it is refused."""

    def __init__(self, file_id: str) -> None:
        super().__init__(f"file {file_id} is the input of a batch that has not finished; cancel the batch first")
        self.file_id = file_id

    def api_error(self) -> ApiError:
        return ApiError(400, str(self), code=FILE_IN_USE_CODE, param="file_id")


def stored_bytes_exceeded(owner_limit: int) -> ApiError:
    return ApiError(
        429,
        f"the files kept hold more than {owner_limit} bytes, the limit per API key (the gateway's "
        "--batch-max-stored-bytes); delete files to make room",
        type=ApiErrorType.RATE_LIMIT,
        code=STORED_BYTES_CODE,
    )


@dataclass
class StoredBytes:
    """A file's bytes in the storage, counted against its owner, not yet recorded."""

    file_id: str
    owner: str
    bytes: int
    lines: int


class _Counted:
    """Counts the bytes and the lines holding something of a stream as it passes, and stops
    it past ``limit`` (``FileTooLarge``) or past ``room`` (the owner's 429)."""

    def __init__(self, limit: int, room: int, owner_limit: int) -> None:
        self.limit, self.room, self.owner_limit = limit, room, owner_limit
        self.bytes = 0
        self.lines = 0
        self._open_line = False  # the current line holds something besides whitespace

    async def through(self, chunks: AsyncIterable[bytes]) -> AsyncIterator[bytes]:
        async for chunk in chunks:
            self.bytes += len(chunk)
            if self.bytes > self.limit:
                raise FileTooLarge(self.limit)
            if self.bytes > self.room:
                raise stored_bytes_exceeded(self.owner_limit)
            self._count(chunk)
            yield chunk
        if self._open_line:
            self.lines += 1

    def _count(self, chunk: bytes) -> None:
        pieces = chunk.split(b"\n")
        for piece in pieces[:-1]:
            if self._open_line or piece.strip():
                self.lines += 1
            self._open_line = False
        if pieces[-1].strip():
            self._open_line = True


def new_file_id() -> str:
    return f"file-{uuid.uuid4().hex}"


def storage_name(file_id: str) -> str:
    return f"files/{file_id}"


class FileStore:
    """Files' records in Redis and bytes in ``storage``.

    :param redis: the gateway's Redis (``InternalClient.redis``).
    :param storage: where the bytes live.
    :param config: the bounds (``max_file_bytes``, ``max_stored_bytes``).
    """

    def __init__(self, redis: Any, storage: Storage, config: BatchApiConfig) -> None:
        self.redis, self.storage, self.config = redis, storage, config
        self._sweeper: asyncio.Task[None] | None = None

    # --- the sweep ------------------------------------------------------------------------
    def start(self) -> None:
        """Start the sweep of expired files (now, then every ``SWEEP_EVERY_S``)."""
        if self._sweeper is None:
            self._sweeper = asyncio.get_running_loop().create_task(self._sweep_forever(), name="files-sweep")

    async def stop(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sweeper
            self._sweeper = None

    async def _sweep_forever(self) -> None:
        while True:
            try:
                await self.sweep_expired()
            except Exception:
                logger.exception("the sweep of expired files failed; trying again in %g s", SWEEP_EVERY_S)
            await asyncio.sleep(SWEEP_EVERY_S)

    async def sweep_expired(self, now: float | None = None) -> int:
        """Delete every file whose ``expires_at`` has passed (the input of an unfinished
        batch waits for it to finish); the number deleted. Every gateway sweeps: a file is
        deleted by one of them (``_remove`` is one transaction)."""
        now_s = int(time.time() if now is None else now)
        deleted = 0
        skip = 0
        while True:
            due = await self.redis.zrangebyscore(names.FILES_EXPIRY_KEY, "-inf", now_s, start=skip, num=SWEEP_BATCH)
            if not due:
                return deleted
            for raw in due:
                file_id = raw.decode() if isinstance(raw, bytes) else raw
                try:
                    record = await self._remove(file_id, owner=None)
                except FileInUse:
                    skip += 1
                    continue
                if record is None:
                    await self.redis.zrem(names.FILES_EXPIRY_KEY, file_id)
                    continue
                await self.storage.delete(storage_name(file_id))
                deleted += 1

    # --- writing --------------------------------------------------------------------------
    async def upload(
        self, owner: str, filename: str, purpose: FilePurpose, chunks: AsyncIterable[bytes], expires_after_s: int | None
    ) -> FileRecord:
        """Stream ``chunks`` into a new file of ``owner``'s: ``FileTooLarge`` past
        ``max_file_bytes`` and a 429 ``ApiError`` past the owner's ``max_stored_bytes``, both
        raised as soon as the stream passes them, with nothing kept."""
        stored = await self.store(owner, chunks)
        try:
            return await self.record(stored, filename, purpose, expires_after_s)
        except BaseException:
            await asyncio.shield(self.discard(stored))
            raise

    async def store(self, owner: str, chunks: AsyncIterable[bytes]) -> StoredBytes:
        """The first half of an upload: the bytes, in the storage and counted against the
        owner, with no record yet (``record`` or ``discard`` finishes it). An upload's form
        may name its purpose after its file: the route decides once the form has ended."""
        limit = self.config.max_stored_bytes
        held = int(await self.redis.hget(names.STORED_BYTES_KEY, owner) or 0)
        if held >= limit:
            raise stored_bytes_exceeded(limit)
        file_id = new_file_id()
        counted = _Counted(self.config.max_file_bytes, limit - held, limit)
        size = await self.storage.write(storage_name(file_id), counted.through(chunks))
        if await self.redis.hincrby(names.STORED_BYTES_KEY, owner, size) > limit:  # another upload beat it
            await self.redis.hincrby(names.STORED_BYTES_KEY, owner, -size)
            await self.storage.delete(storage_name(file_id))
            raise stored_bytes_exceeded(limit)
        return StoredBytes(file_id, owner, size, counted.lines)

    async def discard(self, stored: StoredBytes) -> None:
        """Undo ``store``: the bytes deleted and no longer counted."""
        await self.redis.hincrby(names.STORED_BYTES_KEY, stored.owner, -stored.bytes)
        await self.storage.delete(storage_name(stored.file_id))

    async def record(
        self, stored: StoredBytes, filename: str, purpose: FilePurpose, expires_after_s: int | None
    ) -> FileRecord:
        """The second half of an upload: the file's record, listed under its owner."""
        created = int(time.time())
        record = FileRecord(
            id=stored.file_id,
            owner=stored.owner,
            bytes=stored.bytes,
            created_at=created,
            filename=filename,
            purpose=purpose,
            expires_at=None if expires_after_s is None else created + expires_after_s,
            lines=stored.lines,
        )
        async with self.redis.pipeline(transaction=True) as pipe:
            self._add(pipe, record)
            await pipe.execute()
        return record

    def _add(self, pipe: Any, record: FileRecord) -> None:
        pipe.hset(names.file_key(record.id), mapping=record.to_hash())
        pipe.zadd(names.files_of(record.owner), {record.id: time.time_ns() // 1_000_000})
        if record.expires_at is not None:
            pipe.zadd(names.FILES_EXPIRY_KEY, {record.id: record.expires_at})

    async def create_output(
        self, owner: str, file_id: str, filename: str, parts: Sequence[str], expires_after_s: int
    ) -> FileRecord:
        """A batch's output (or error) file: ``parts`` concatenated into ``files/<file_id>``,
        purpose ``batch_output``. Idempotent for one ``file_id``: called again (the runner
        after a crash) it answers the record already made, or makes it. Counted against the
        owner's stored bytes, never refused: the batch's results are kept."""
        key = names.file_key(file_id)
        if existing := await self._read(file_id):
            return existing
        counted = _Counted(1 << 62, 1 << 62, 0)
        size = await self.storage.write(storage_name(file_id), counted.through(self.storage.chain(parts)))
        created = int(time.time())
        record = FileRecord(
            id=file_id,
            owner=owner,
            bytes=size,
            created_at=created,
            filename=filename,
            purpose="batch_output",
            expires_at=created + expires_after_s,
            lines=counted.lines,
        )
        async with self.redis.pipeline(transaction=True) as pipe:
            while True:
                try:
                    await pipe.watch(key)
                    if await pipe.exists(key):  # another owner of the batch made it meanwhile
                        await pipe.reset()
                        found = await self._read(file_id)
                        assert found is not None
                        return found
                    pipe.multi()
                    self._add(pipe, record)
                    pipe.hincrby(names.STORED_BYTES_KEY, owner, size)
                    await pipe.execute()
                    return record
                except WatchError:
                    continue

    # --- reading --------------------------------------------------------------------------
    async def _read(self, file_id: str) -> FileRecord | None:
        raw = await self.redis.hgetall(names.file_key(file_id))
        return FileRecord.from_hash(raw) if raw else None

    async def get(self, file_id: str, owner: str) -> FileRecord | None:
        """The owner's file; ``None`` for an unknown id, another owner's, or one expired
        (unless a batch that has not finished reads it: it stays until the batch ends)."""
        record = await self._read(file_id)
        if record is None or record.owner != owner:
            return None
        if _expired(record, time.time()) and not await self.redis.scard(names.file_users_key(file_id)):
            return None
        return record

    async def list(
        self, owner: str, *, after: str | None, limit: int, order: str, purpose: str | None
    ) -> tuple[list[FileRecord], bool]:
        """The owner's files in creation order (``asc``/``desc``), from the one after
        ``after``; at most ``limit`` and whether more follow. An ``after`` that is not (or no
        longer) the owner's gives an empty page."""
        key = names.files_of(owner)
        descending = order == "desc"
        start = 0
        if after is not None:
            rank = await (self.redis.zrevrank(key, after) if descending else self.redis.zrank(key, after))
            if rank is None:
                return [], False
            start = rank + 1
        found: list[FileRecord] = []
        now = time.time()
        while len(found) <= limit:
            window = limit + 1 - len(found)
            ids = await self.redis.zrange(key, start, start + window - 1, desc=descending)
            if not ids:
                break
            start += len(ids)
            async with self.redis.pipeline(transaction=False) as pipe:
                for file_id in ids:
                    pipe.hgetall(names.file_key(file_id.decode() if isinstance(file_id, bytes) else file_id))
                raws = await pipe.execute()
            for raw in raws:
                if not raw:
                    continue  # deleted since the range was read
                record = FileRecord.from_hash(raw)
                if (purpose is None or record.purpose == purpose) and not _expired(record, now):
                    found.append(record)
        return found[:limit], len(found) > limit

    def read_lines(self, record: FileRecord, offset: int = 0) -> AsyncIterator[tuple[int, bytes]]:
        """The file's lines from ``offset`` (``Storage.read_lines``)."""
        return self.storage.read_lines(storage_name(record.id), offset)

    def content(self, record: FileRecord) -> AsyncIterator[bytes]:
        """The file's bytes, a chunk at a time."""
        return self.storage.read_chunks(storage_name(record.id))

    # --- deleting -------------------------------------------------------------------------
    async def delete(self, file_id: str, owner: str) -> bool:
        """Delete the owner's file; ``False`` when it has none by that id. ``FileInUse``
        while a batch that has not finished reads it."""
        if await self.get(file_id, owner) is None:
            return False
        record = await self._remove(file_id, owner)
        if record is None:
            return False
        await self.storage.delete(storage_name(file_id))
        return True

    async def _remove(self, file_id: str, owner: str | None) -> FileRecord | None:
        """Remove the file's record (of ``owner``, or anyone's for ``None``) and its count,
        in one transaction that fails if a batch starts using it meanwhile; the record
        removed, ``None`` if there was none. ``FileInUse`` while a batch uses it."""
        key, users = names.file_key(file_id), names.file_users_key(file_id)
        async with self.redis.pipeline(transaction=True) as pipe:
            while True:
                try:
                    await pipe.watch(key, users)
                    raw = await pipe.hgetall(key)
                    if not raw:
                        return None
                    record = FileRecord.from_hash(raw)
                    if owner is not None and record.owner != owner:
                        return None
                    if await pipe.scard(users):
                        raise FileInUse(file_id)
                    pipe.multi()
                    pipe.delete(key)
                    pipe.zrem(names.files_of(record.owner), file_id)
                    pipe.zrem(names.FILES_EXPIRY_KEY, file_id)
                    pipe.hincrby(names.STORED_BYTES_KEY, record.owner, -record.bytes)
                    await pipe.execute()
                    return record
                except WatchError:
                    continue


def _expired(record: FileRecord, now: float) -> bool:
    return record.expires_at is not None and record.expires_at <= now
