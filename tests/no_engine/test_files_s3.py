"""Files on an S3-compatible store: a real S3 server process (SeaweedFS's ``weed mini``) and a
gateway with ``--files-url s3://bucket/prefix``; the openai SDK uploads a file larger than one
multipart part and reads it back, and nothing is left of an upload that fails."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import openai
import pytest

from devkit.gateway_process import GatewayProcess
from devkit.s3_server import ACCESS_KEY, SECRET_KEY, S3Server
from gateway.batch_api.storage import S3_PART_BYTES, Storage

PREFIX = "streamq-files"


@pytest.fixture(scope="module")
def s3() -> Iterator[S3Server]:
    with S3Server(bucket="batches") as server:
        yield server


@pytest.fixture(scope="module")
def gateway(redis_url: str, s3: S3Server, tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayProcess]:
    process = GatewayProcess(
        redis_url,
        tmp_path_factory.mktemp("gateway") / "gateway.log",
        "--files-url",
        f"s3://{s3.bucket}/{PREFIX}",
        "--s3-endpoint-url",
        s3.url,
        "--no-run-batches",
        env={"AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY},
    ).wait_ready()
    yield process
    assert process.stop() == 0, process.log_tail()


@pytest.fixture
def storage(s3: S3Server) -> Storage:
    """The same store as the gateway's, seen directly."""
    return Storage.from_url(f"s3://{s3.bucket}/{PREFIX}", s3.options())


async def test_a_file_larger_than_a_part_goes_to_s3_and_back(
    gateway: GatewayProcess, storage: Storage, tmp_path: Path
) -> None:
    lines = b"".join(b'{"custom_id": "%d", "method": "POST"}\n' % n for n in range(S3_PART_BYTES // 30))
    assert len(lines) > S3_PART_BYTES
    path = tmp_path / "input.jsonl"
    path.write_bytes(lines)
    async with openai.AsyncOpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0) as sdk:
        created = await sdk.files.create(file=path, purpose="batch")
        assert created.bytes == len(lines) and created.filename == "input.jsonl"
        assert await storage.exists(f"files/{created.id}")
        assert (await sdk.files.content(created.id)).content == lines
        assert b"".join([chunk async for chunk in storage.read_chunks(f"files/{created.id}")]) == lines
        await sdk.files.delete(created.id)
        assert not await storage.exists(f"files/{created.id}")
        with pytest.raises(openai.NotFoundError):
            await sdk.files.content(created.id)


async def test_an_s3_write_that_fails_leaves_no_object(storage: Storage) -> None:
    async def broken() -> AsyncIterator[bytes]:
        yield b"x" * (S3_PART_BYTES + 1)  # one part sent: a multipart upload is open
        raise RuntimeError("the client went away")

    with pytest.raises(RuntimeError):
        await storage.write("files/broken", broken())
    assert not await storage.exists("files/broken")
    bucket = storage.root.split("/")[0]
    uploads = await asyncio.to_thread(storage.fs.call_s3, "list_multipart_uploads", Bucket=bucket)
    assert uploads.get("Uploads", []) == []  # aborted, not left to hold its parts
