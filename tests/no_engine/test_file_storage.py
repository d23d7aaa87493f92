"""The files' storage on a local directory: lines read from an offset give the rest of the
file, a write that fails leaves nothing, names never leave the root."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from gateway.batch_api.storage import CHUNK_BYTES, Storage


async def pieces(data: bytes, size: int) -> AsyncIterator[bytes]:
    for start in range(0, len(data), size):
        yield data[start : start + size]


async def test_lines_resumed_at_an_offset_are_the_rest_of_the_file(tmp_path: Path) -> None:
    storage = Storage.from_url(str(tmp_path), {})
    long_line = b"y" * (CHUNK_BYTES + 10)  # a line across chunks
    data = b'{"a": 1}\n\n' + long_line + b"\n  \nlast without a newline"
    assert await storage.write("files/f", pieces(data, 4096)) == len(data)
    lines = [item async for item in storage.read_lines("files/f")]
    assert [line for _, line in lines] == [b'{"a": 1}', b"", long_line, b"  ", b"last without a newline"]
    assert lines[-1][0] == len(data)
    for index, (offset, _) in enumerate(lines):
        assert [item async for item in storage.read_lines("files/f", offset)] == lines[index + 1 :]


async def test_a_write_that_fails_leaves_nothing(tmp_path: Path) -> None:
    storage = Storage.from_url(str(tmp_path), {})

    async def broken() -> AsyncIterator[bytes]:
        yield b"x" * (2 * CHUNK_BYTES)
        raise RuntimeError("the client went away")

    with pytest.raises(RuntimeError):
        await storage.write("files/f", broken())
    assert not await storage.exists("files/f")
    assert [path for path in tmp_path.rglob("*") if path.is_file()] == []


async def test_concat_copies_parts_in_order_and_deletes_are_quiet(tmp_path: Path) -> None:
    storage = Storage.from_url(f"file://{tmp_path}", {})
    await storage.write("batches/b/out/1.jsonl", pieces(b"one\n", 2))
    await storage.write("batches/b/out/2.jsonl", pieces(b"two\n", 2))
    assert await storage.concat("files/out", ["batches/b/out/1.jsonl", "batches/b/out/2.jsonl"]) == 8
    assert b"".join([chunk async for chunk in storage.read_chunks("files/out")]) == b"one\ntwo\n"
    await storage.delete_prefix("batches/b")
    await storage.delete_prefix("batches/b")
    await storage.delete("files/never-written")
    assert not await storage.exists("batches/b/out/1.jsonl") and await storage.exists("files/out")


@pytest.mark.parametrize("name", ["../escape", "/abs", "files//x", "files/./x"])
def test_names_never_leave_the_root(tmp_path: Path, name: str) -> None:
    with pytest.raises(ValueError):
        Storage.from_url(str(tmp_path), {}).path(name)
