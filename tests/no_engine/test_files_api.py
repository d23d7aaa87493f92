"""``/v1/files`` through the openai SDK against a real gateway process and real Redis: upload,
retrieve, list to the end, content, delete; uploads bounded (413 before the body is read
whole), checked (400), kept per API key (404 for another key, invisible in its lists) and
bounded per key in bytes kept (429); expired files swept away. No engine, no worker."""

from __future__ import annotations

import asyncio
import socket
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import redis.asyncio as aioredis

from devkit.gateway_process import GatewayProcess
from gateway.batch_api import names
from gateway.batch_api.config import BatchApiConfig
from gateway.batch_api.files import FileStore
from gateway.batch_api.storage import Storage
from streamq.broker.api_keys import ApiKeyStore, KeyRecord

MAX_FILE_BYTES = 16_384
MAX_STORED_BYTES = 65_536
LINES = b'{"custom_id": "a", "method": "POST"}\n\n{"custom_id": "b", "method": "POST"}\n'


class Keys:
    """API keys stored in Redis under names of their own, so that each test's files live in
    a namespace no other test (nor an earlier run against the same Redis) shares."""

    def __init__(self, redis_url: str) -> None:
        self.redis_url = redis_url
        self.names: list[str] = []

    def _run(self, call: object) -> object:
        async def run() -> object:
            redis = aioredis.Redis.from_url(self.redis_url)
            try:
                return await call(ApiKeyStore(redis))  # type: ignore[operator]
            finally:
                await redis.aclose()

        return asyncio.run(run())

    def new(self) -> tuple[str, str]:
        """A new key: its name (its files' owner) and its secret."""
        name = f"files-{uuid.uuid4().hex[:10]}"
        secret = self._run(lambda store: store.create(KeyRecord(name)))
        self.names.append(name)
        return name, str(secret)

    def revoke_all(self) -> None:
        for name in self.names:
            self._run(lambda store, name=name: store.revoke(name))


@pytest.fixture(scope="module")
def keys(redis_url: str) -> Iterator[Keys]:
    keys = Keys(redis_url)
    keys.new()  # a key in Redis before the gateway starts: it requires keys from the start
    yield keys
    keys.revoke_all()  # later modules' gateways are open again


@pytest.fixture(scope="module")
def files_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("files")


@pytest.fixture(scope="module")
def gateway(
    redis_url: str, keys: Keys, files_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[GatewayProcess]:
    process = GatewayProcess(
        redis_url,
        tmp_path_factory.mktemp("gateway") / "gateway.log",
        "--files-url",
        str(files_dir),
        "--batch-max-file-bytes",
        str(MAX_FILE_BYTES),
        "--batch-max-stored-bytes",
        str(MAX_STORED_BYTES),
        "--no-run-batches",
    ).wait_ready()
    yield process
    assert process.stop() == 0, process.log_tail()


def sdk_for(gateway: GatewayProcess, secret: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=gateway.url + "/v1", api_key=secret, max_retries=0, timeout=30)


@pytest.fixture
def tenant(gateway: GatewayProcess, keys: Keys) -> Iterator[tuple[str, openai.OpenAI]]:
    """A fresh API key's name and the SDK on the gateway with it."""
    name, secret = keys.new()
    with sdk_for(gateway, secret) as sdk:
        yield name, sdk


def stored_files(files_dir: Path) -> list[Path]:
    return sorted(path for path in files_dir.rglob("*") if path.is_file())


def test_the_sdk_uploads_retrieves_reads_and_deletes_a_file(tenant: tuple[str, openai.OpenAI], files_dir: Path) -> None:
    _, sdk = tenant
    created = sdk.files.create(file=("input.jsonl", LINES), purpose="batch")
    assert created.object == "file" and created.id.startswith("file-")
    assert (created.bytes, created.filename, created.purpose, created.status) == (
        len(LINES),
        "input.jsonl",
        "batch",
        "processed",
    )
    assert created.expires_at is None and abs(created.created_at - time.time()) < 60
    assert sdk.files.retrieve(created.id) == created
    assert sdk.files.content(created.id).content == LINES
    assert (files_dir / "files" / created.id).read_bytes() == LINES
    deleted = sdk.files.delete(created.id)
    assert (deleted.id, deleted.object, deleted.deleted) == (created.id, "file", True)
    with pytest.raises(openai.NotFoundError):
        sdk.files.retrieve(created.id)
    with pytest.raises(openai.NotFoundError):
        sdk.files.delete(created.id)
    assert not (files_dir / "files" / created.id).exists()


def test_lists_page_to_their_end(tenant: tuple[str, openai.OpenAI]) -> None:
    _, sdk = tenant
    created = [sdk.files.create(file=(f"{n}.jsonl", LINES), purpose="batch").id for n in range(5)]
    newest_first = [file.id for file in sdk.files.list(limit=2)]  # the SDK follows `after` while has_more
    assert sorted(newest_first) == sorted(created) and len(newest_first) == 5
    oldest_first = [file.id for file in sdk.files.list(limit=2, order="asc")]
    assert oldest_first == newest_first[::-1]
    first = sdk.files.list(limit=2)
    assert [file.id for file in first.data] == newest_first[:2] and first.has_more
    last = sdk.files.list(limit=2, after=newest_first[3])
    assert [file.id for file in last.data] == newest_first[4:] and not last.has_more
    assert [file.id for file in sdk.files.list(purpose="batch_output")] == []


def test_another_keys_files_are_not_found_and_not_listed(
    gateway: GatewayProcess, keys: Keys, tenant: tuple[str, openai.OpenAI]
) -> None:
    _, sdk = tenant
    mine = sdk.files.create(file=("mine.jsonl", LINES), purpose="batch")
    _, other_secret = keys.new()
    with sdk_for(gateway, other_secret) as other:
        for call in (other.files.retrieve, other.files.content, other.files.delete):
            with pytest.raises(openai.NotFoundError):
                call(mine.id)
        assert [file.id for file in other.files.list()] == []
        theirs = other.files.create(file=("theirs.jsonl", LINES), purpose="batch")
    assert [file.id for file in sdk.files.list()] == [mine.id]
    with pytest.raises(openai.NotFoundError):
        sdk.files.retrieve(theirs.id)
    assert sdk.files.content(mine.id).content == LINES


def test_a_bad_purpose_or_expiry_is_400_naming_it(tenant: tuple[str, openai.OpenAI], files_dir: Path) -> None:
    _, sdk = tenant
    before = stored_files(files_dir)
    with pytest.raises(openai.BadRequestError) as caught:
        sdk.files.create(file=("x.jsonl", LINES), purpose="fine-tune")
    assert caught.value.param == "purpose"
    with pytest.raises(openai.BadRequestError) as caught:
        sdk.files.create(
            file=("x.jsonl", LINES), purpose="batch", expires_after={"anchor": "created_at", "seconds": 60}
        )
    assert caught.value.param == "expires_after[seconds]" and "3600" in caught.value.message
    with pytest.raises(openai.BadRequestError) as caught:
        sdk.files.create(file=("x.jsonl", LINES), purpose="batch", expires_after={"anchor": "now", "seconds": 3600})  # type: ignore[typeddict-item]
    assert caught.value.param == "expires_after[anchor]"
    assert [file.id for file in sdk.files.list()] == [] and stored_files(files_dir) == before


def multipart(boundary: str, parts: list[tuple[str, str | None, bytes]]) -> bytes:
    body = b""
    for name, filename, value in parts:
        disposition = f'form-data; name="{name}"' + (f'; filename="{filename}"' if filename else "")
        body += f"--{boundary}\r\nContent-Disposition: {disposition}\r\n\r\n".encode() + value + b"\r\n"
    return body + f"--{boundary}--\r\n".encode()


def test_a_purpose_after_the_file_is_checked_once_the_form_ends(
    gateway: GatewayProcess, keys: Keys, files_dir: Path
) -> None:
    """curl sends its form fields in the order given: the file may come first."""
    _, secret = keys.new()
    headers = {"Authorization": f"Bearer {secret}", "Content-Type": "multipart/form-data; boundary=b0undary"}
    before = stored_files(files_dir)
    bad = multipart("b0undary", [("file", "x.jsonl", LINES), ("purpose", None, b"assistants")])
    response = httpx.post(gateway.url + "/v1/files", content=bad, headers=headers)
    assert response.status_code == 400 and response.json()["error"]["param"] == "purpose"
    assert stored_files(files_dir) == before  # the file written before its purpose was read is gone
    good = multipart(
        "b0undary",
        [
            ("file", "x.jsonl", LINES),
            ("purpose", None, b"batch"),
            ("expires_after[anchor]", None, b"created_at"),
            ("expires_after[seconds]", None, b"7200"),
        ],
    )
    response = httpx.post(gateway.url + "/v1/files", content=good, headers=headers)
    assert response.status_code == 200, response.text
    created = response.json()
    assert created["expires_at"] == created["created_at"] + 7200 and created["bytes"] == len(LINES)


def raw_upload(gateway: GatewayProcess, secret: str, head: dict[str, str], chunks: Iterator[bytes]) -> tuple[int, dict]:
    """POST /v1/files over a bare socket, sending ``chunks`` until the gateway stops
    reading; its status and JSON body (httpx would send the whole body first)."""
    lines = [
        "POST /v1/files HTTP/1.1",
        f"Host: 127.0.0.1:{gateway.port}",
        f"Authorization: Bearer {secret}",
        "Content-Type: multipart/form-data; boundary=b0undary",
        *(f"{name}: {value}" for name, value in head.items()),
    ]
    with socket.create_connection(("127.0.0.1", gateway.port), timeout=30) as connection:
        connection.sendall(("\r\n".join(lines) + "\r\n\r\n").encode())
        for chunk in chunks:
            try:
                connection.sendall(chunk)
            except (BrokenPipeError, ConnectionResetError):
                break
        received = b""
        while data := connection.recv(65536):
            received += data
            head_part, _, body = received.partition(b"\r\n\r\n")
            length = next(
                (
                    int(line.split(b":")[1])
                    for line in head_part.split(b"\r\n")
                    if line.lower().startswith(b"content-length")
                ),
                None,
            )
            if length is not None and len(body) >= length:
                break
    head_part, _, body = received.partition(b"\r\n\r\n")
    return int(head_part.split()[1]), httpx.Response(200, content=body).json()


def test_an_upload_past_the_limit_is_413_before_it_is_read_whole(
    gateway: GatewayProcess, keys: Keys, files_dir: Path
) -> None:
    name, secret = keys.new()
    before = stored_files(files_dir)
    status, body = raw_upload(gateway, secret, {"Content-Length": str(100 * MAX_FILE_BYTES)}, iter(()))
    assert status == 413 and body["error"]["code"] == "file_too_large"

    def endless() -> Iterator[bytes]:
        """A chunked form whose file never ends (no last chunk): only a gateway that stops
        reading at the limit answers."""
        start = b'--b0undary\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
        start += b'--b0undary\r\nContent-Disposition: form-data; name="file"; filename="big.jsonl"\r\n\r\n'
        yield f"{len(start):x}\r\n".encode() + start + b"\r\n"
        piece = b'{"custom_id": "x"}\n' * 200
        while True:
            yield f"{len(piece):x}\r\n".encode() + piece + b"\r\n"

    status, body = raw_upload(gateway, secret, {"Transfer-Encoding": "chunked"}, endless())
    assert status == 413 and body["error"]["code"] == "file_too_large"
    assert f"larger than {MAX_FILE_BYTES} bytes" in body["error"]["message"]
    assert stored_files(files_dir) == before
    with sdk_for(gateway, secret) as sdk:
        assert [file.id for file in sdk.files.list()] == []
    assert asyncio.run(_stored_bytes(keys.redis_url, name)) == 0


async def _stored_bytes(redis_url: str, owner: str) -> int:
    redis = aioredis.Redis.from_url(redis_url)
    try:
        return int(await redis.hget(names.STORED_BYTES_KEY, owner) or 0)  # type: ignore[misc]
    finally:
        await redis.aclose()


def test_bytes_kept_per_key_are_bounded_429_and_deleting_makes_room(
    tenant: tuple[str, openai.OpenAI], keys: Keys
) -> None:
    name, sdk = tenant
    content = b"x" * (MAX_FILE_BYTES - 100)
    kept = [
        sdk.files.create(file=("f.jsonl", content), purpose="batch") for _ in range(MAX_STORED_BYTES // len(content))
    ]
    assert asyncio.run(_stored_bytes(keys.redis_url, name)) == len(kept) * len(content)
    with pytest.raises(openai.RateLimitError) as caught:
        sdk.files.create(file=("f.jsonl", content), purpose="batch")
    assert caught.value.code == "stored_bytes_exceeded"
    sdk.files.delete(kept[0].id)
    sdk.files.create(file=("f.jsonl", content), purpose="batch")
    assert len(sdk.files.list().data) == len(kept)


async def test_the_sweep_deletes_files_that_have_expired(
    tenant: tuple[str, openai.OpenAI], redis_url: str, files_dir: Path
) -> None:
    name, sdk = tenant
    expiring = await asyncio.to_thread(
        sdk.files.create,
        file=("e.jsonl", LINES),
        purpose="batch",
        expires_after={"anchor": "created_at", "seconds": 3600},
    )
    kept = await asyncio.to_thread(sdk.files.create, file=("k.jsonl", LINES), purpose="batch")
    assert expiring.expires_at == expiring.created_at + 3600
    redis = aioredis.Redis.from_url(redis_url)
    try:
        files = FileStore(redis, Storage.from_url(str(files_dir), {}), BatchApiConfig(files_url=str(files_dir)))
        await files.sweep_expired(now=expiring.created_at + 3599)
        assert await redis.exists(names.file_key(expiring.id)) == 1  # not yet
        assert await files.sweep_expired(now=expiring.created_at + 3600) >= 1
        assert await redis.exists(names.file_key(expiring.id)) == 0
        assert await redis.zscore(names.FILES_EXPIRY_KEY, expiring.id) is None
        assert int(await redis.hget(names.STORED_BYTES_KEY, name) or 0) == len(LINES)  # type: ignore[misc]
    finally:
        await redis.aclose()
    assert not (files_dir / "files" / expiring.id).exists() and (files_dir / "files" / kept.id).exists()
    with pytest.raises(openai.NotFoundError):
        await asyncio.to_thread(sdk.files.retrieve, expiring.id)


async def test_the_input_of_an_unfinished_batch_is_neither_deleted_nor_swept(
    tenant: tuple[str, openai.OpenAI], redis_url: str, files_dir: Path
) -> None:
    _, sdk = tenant
    expiry = {"anchor": "created_at", "seconds": 3600}
    used = await asyncio.to_thread(sdk.files.create, file=("in.jsonl", LINES), purpose="batch", expires_after=expiry)  # type: ignore[arg-type]
    redis = aioredis.Redis.from_url(redis_url)
    try:
        await redis.sadd(names.file_users_key(used.id), "batch_running")  # type: ignore[misc]
        with pytest.raises(openai.BadRequestError) as caught:
            await asyncio.to_thread(sdk.files.delete, used.id)
        assert caught.value.code == "file_in_use" and caught.value.param == "file_id"
        files = FileStore(redis, Storage.from_url(str(files_dir), {}), BatchApiConfig(files_url=str(files_dir)))
        await files.sweep_expired(now=used.created_at + 3600)
        assert (files_dir / "files" / used.id).exists()
        await redis.delete(names.file_users_key(used.id))  # the batch ended
        assert await files.sweep_expired(now=used.created_at + 3600) >= 1
        assert not (files_dir / "files" / used.id).exists()
    finally:
        await redis.aclose()
