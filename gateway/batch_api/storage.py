"""Where the bytes of files live: a local directory, or an S3-compatible store, through fsspec
(s3fs for ``s3://bucket/prefix``).

fsspec rather than obstore: s3fs is the S3 layer pandas, dask and pyarrow already use, its
files can be written as an uncommitted multipart upload that is completed or aborted as a
whole (no partial object after an error), and one interface serves the local directory too.
Its calls block: each runs in a thread, one chunk at a time, so no call holds more than a
chunk (or one S3 part) of a file in memory.
"""

from __future__ import annotations

import asyncio
import contextlib
import posixpath
import uuid
from collections.abc import AsyncIterable, AsyncIterator, Sequence
from typing import Any, Final

import fsspec
from fsspec.implementations.local import LocalFileSystem

CHUNK_BYTES: Final = 1024 * 1024
"""What one read (and one write handed to a thread) moves: a file is never held whole."""
S3_PART_BYTES: Final = 8 * 1024 * 1024
"""The part of an S3 multipart upload buffered before it is sent (S3's least is 5 MiB):
an upload to S3 holds at most this much, plus one chunk."""
S3_CLIENT_OPTIONS: Final = frozenset({"region_name"})
"""``s3_options`` that s3fs takes inside ``client_kwargs`` (the rest it takes itself:
``endpoint_url``, ``key``, ``secret``, ``token``)."""


class Storage:
    """Named objects (``files/<id>``, ``batches/<id>/out/<n>.jsonl``) under one root.

    :param fs: the fsspec file system.
    :param root: the root inside it (a directory, or ``bucket/prefix``).
    """

    def __init__(self, fs: fsspec.AbstractFileSystem, root: str) -> None:
        self.fs = fs
        self.root = root.rstrip("/")
        self._local = isinstance(fs, LocalFileSystem)

    @classmethod
    def from_url(cls, url: str, s3_options: dict[str, str]) -> Storage:
        """``s3://bucket/prefix`` (credentials and endpoint in ``s3_options``, else the usual
        ``AWS_*`` variables), or a local directory (a path or ``file://``), created on the
        first write."""
        if url.startswith("s3://"):
            import s3fs  # the s3 extra: only a deployment on S3 needs it

            options: dict[str, Any] = {k: v for k, v in s3_options.items() if v and k not in S3_CLIENT_OPTIONS}
            client = {k: v for k, v in s3_options.items() if v and k in S3_CLIENT_OPTIONS}
            fs = s3fs.S3FileSystem(
                client_kwargs=client,
                default_block_size=S3_PART_BYTES,
                use_listings_cache=False,  # another gateway writes there too
                skip_instance_cache=True,
                **options,
            )
            return cls(fs, url.removeprefix("s3://"))
        path = url.removeprefix("file://")
        return cls(LocalFileSystem(auto_mkdir=True), posixpath.abspath(path))

    def path(self, name: str) -> str:
        """Where ``name`` lives; names are relative and never climb out of the root."""
        parts = name.split("/")
        if name.startswith("/") or any(part in ("", ".", "..") for part in parts):
            raise ValueError(f"not a storage name: {name!r}")
        return f"{self.root}/{name}"

    async def write(self, name: str, chunks: AsyncIterable[bytes]) -> int:
        """Stream ``chunks`` into ``name`` (replacing it); the bytes written. On any error
        (the chunks' own included) nothing is left: a local file is written under a temporary
        name and renamed, an S3 object is a multipart upload completed only at the end."""
        path = self.path(name)
        staged = f"{path}.{uuid.uuid4().hex}.part" if self._local else path
        handle = await asyncio.to_thread(self.fs.open, staged, "wb", autocommit=self._local)
        size = 0
        pending: list[bytes] = []
        pending_bytes = 0
        try:
            async for chunk in chunks:
                pending.append(chunk)
                pending_bytes += len(chunk)
                if pending_bytes >= CHUNK_BYTES:
                    size += await asyncio.to_thread(handle.write, b"".join(pending))
                    pending, pending_bytes = [], 0
            if pending:
                size += await asyncio.to_thread(handle.write, b"".join(pending))
            await asyncio.to_thread(self._commit, handle, staged, path)
        except BaseException:
            await asyncio.shield(asyncio.to_thread(self._discard, handle, staged))
            raise
        return size

    def _commit(self, handle: Any, staged: str, path: str) -> None:
        handle.close()
        if self._local:
            self.fs.mv(staged, path)
        else:
            handle.commit()

    def _discard(self, handle: Any, staged: str) -> None:
        if self._local:
            handle.close()
            self.fs.rm_file(staged)
        else:
            handle.discard()
            handle.closed = True  # nothing left to flush: the upload was aborted

    async def read_chunks(self, name: str, offset: int = 0) -> AsyncIterator[bytes]:
        """``name``'s bytes from ``offset`` on, ``CHUNK_BYTES`` at a time. A missing object
        raises ``FileNotFoundError``."""
        path = self.path(name)
        # cache_type "none": each read is one ranged GET on S3, nothing read ahead or kept.
        handle = await asyncio.to_thread(self.fs.open, path, "rb", block_size=CHUNK_BYTES, cache_type="none")
        try:
            if offset:
                await asyncio.to_thread(handle.seek, offset)
            while chunk := await asyncio.to_thread(handle.read, CHUNK_BYTES):
                yield chunk
        finally:
            await asyncio.to_thread(handle.close)

    async def read_lines(self, name: str, offset: int = 0) -> AsyncIterator[tuple[int, bytes]]:
        """Every physical line from ``offset`` on (blank ones too), as ``(the offset just
        past the line, the line without its b"\\n")``: resuming at that offset gives the
        lines after it. Holds one line plus one chunk."""
        line_start = offset
        pieces: list[bytes] = []  # the line read so far, when it spans chunks
        async for chunk in self.read_chunks(name, offset):
            start = 0
            while (end := chunk.find(b"\n", start)) != -1:
                line = b"".join([*pieces, chunk[start:end]]) if pieces else chunk[start:end]
                pieces = []
                line_start += len(line) + 1
                yield line_start, line
                start = end + 1
            if start < len(chunk):
                pieces.append(chunk[start:])
        if pieces:
            line = b"".join(pieces)
            yield line_start + len(line), line

    async def concat(self, name: str, parts: Sequence[str]) -> int:
        """Copy ``parts``, in order, into ``name`` (streamed); the bytes written."""
        return await self.write(name, self.chain(parts))

    async def chain(self, parts: Sequence[str]) -> AsyncIterator[bytes]:
        for part in parts:
            async for chunk in self.read_chunks(part):
                yield chunk

    async def delete(self, name: str) -> None:
        """Remove ``name``; a missing one is no error."""
        with contextlib.suppress(FileNotFoundError):
            await asyncio.to_thread(self.fs.rm_file, self.path(name))

    async def delete_prefix(self, prefix: str) -> None:
        """Remove every object under ``prefix`` (a folder name, as ``batches/<id>``)."""
        path = self.path(prefix.rstrip("/"))
        with contextlib.suppress(FileNotFoundError):
            await asyncio.to_thread(self.fs.rm, path, recursive=True)

    async def exists(self, name: str) -> bool:
        return bool(await asyncio.to_thread(self.fs.exists, self.path(name)))
