"""The API key store and the per-key limit scripts against a real Redis: what a gateway
decides for each request, without a gateway."""

from __future__ import annotations

import argparse
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import redis.asyncio as aioredis

from gateway.auth import ApiKeyAuth, Tenant, static_keys
from gateway.key_limits import KeyLimiter, KeyRevoked
from producer.cli import build_parser, with_default_subcommand
from producer.openai_api.errors import ApiError
from streamq.broker.api_keys import ApiKeyError, ApiKeyStore, KeyRecord, secret_hash
from streamq.protocol.names import API_KEY_NAMES_KEY, API_KEYS_KEY


@pytest.fixture
async def redis(redis_url: str) -> AsyncIterator[aioredis.Redis]:
    """The session's Redis; emptied of keys afterwards, since a gateway started on a Redis
    that holds any key requires keys (every later test's gateway would answer 401)."""
    client = aioredis.Redis.from_url(redis_url)
    yield client
    await client.delete(API_KEYS_KEY, API_KEY_NAMES_KEY)
    await client.aclose()


def unique(prefix: str = "k") -> str:
    return f"{prefix}-{uuid.uuid4().hex[:10]}"


async def stored_tenant(store: ApiKeyStore, **limits: object) -> tuple[Tenant, str]:
    record = KeyRecord(unique(), **limits)  # type: ignore[arg-type]
    secret = await store.create(record)
    return Tenant(record.name, secret_hash(secret), record), secret


async def test_the_store_keeps_only_a_hash_of_each_secret(redis: aioredis.Redis) -> None:
    store = ApiKeyStore(redis)
    name = unique()
    secret = await store.create(KeyRecord(name, rpm=10, models=["m"]))
    everything = b"".join(k + v for k, v in (await redis.hgetall(API_KEYS_KEY)).items())  # type: ignore[misc]
    everything += b"".join(k + v for k, v in (await redis.hgetall(API_KEY_NAMES_KEY)).items())  # type: ignore[misc]
    assert secret.encode() not in everything and secret_hash(secret).encode() in everything
    assert await store.lookup(secret_hash(secret)) == KeyRecord(name, rpm=10, models=["m"])
    with pytest.raises(ApiKeyError):
        await store.create(KeyRecord(name))
    await store.update(KeyRecord(name, tpm=5))
    assert await store.lookup(secret_hash(secret)) == KeyRecord(name, tpm=5)
    await store.revoke(name)
    assert await store.lookup(secret_hash(secret)) is None and await store.get(name) is None
    with pytest.raises(ApiKeyError):
        await store.revoke(name)
    with pytest.raises(ApiKeyError):
        await store.create(KeyRecord("bad name"))


async def test_requests_per_minute(redis: aioredis.Redis) -> None:
    limiter = KeyLimiter(redis)
    tenant, _ = await stored_tenant(ApiKeyStore(redis), rpm=2)
    for _ in range(2):
        await limiter.finish(await limiter.admit(tenant, "m"))
    with pytest.raises(ApiError) as caught:
        await limiter.admit(tenant, "m")
    assert caught.value.status == 429 and caught.value.param == "rpm"
    assert caught.value.headers is not None and 1 <= int(caught.value.headers["Retry-After"]) <= 60


async def test_tokens_per_minute_are_charged_at_the_end(redis: aioredis.Redis) -> None:
    limiter = KeyLimiter(redis)
    tenant, _ = await stored_tenant(ApiKeyStore(redis), tpm=100)
    admission = await limiter.admit(tenant, "m")
    second = await limiter.admit(tenant, "m")  # nothing spent yet
    admission.prompt_tokens, admission.completion_tokens = 40, 60
    await limiter.finish(admission)
    await limiter.finish(second)
    with pytest.raises(ApiError) as caught:
        await limiter.admit(tenant, "m")
    assert caught.value.status == 429 and "tpm" in caught.value.message


async def test_open_streams_are_held_until_finished(redis: aioredis.Redis) -> None:
    limiter = KeyLimiter(redis)
    tenant, _ = await stored_tenant(ApiKeyStore(redis), max_streams=2)
    first, second = await limiter.admit(tenant, "m"), await limiter.admit(tenant, "m")
    with pytest.raises(ApiError) as caught:
        await limiter.admit(tenant, "m")
    assert caught.value.param == "max_streams"
    await limiter.finish(first)
    await limiter.finish(await limiter.admit(tenant, "m"))
    await limiter.finish(second)


async def test_the_model_allow_list_and_revocation(redis: aioredis.Redis) -> None:
    store = ApiKeyStore(redis)
    limiter = KeyLimiter(redis)
    tenant, _ = await stored_tenant(store, models=["a", "b"])
    await limiter.finish(await limiter.admit(tenant, "b"))
    with pytest.raises(ApiError) as caught:
        await limiter.admit(tenant, "c")
    assert caught.value.status == 404 and caught.value.code == "model_not_found"
    await store.revoke(tenant.name)
    with pytest.raises(KeyRevoked):
        await limiter.admit(tenant, "a")


async def test_usage_is_counted_by_model(redis: aioredis.Redis) -> None:
    store = ApiKeyStore(redis)
    limiter = KeyLimiter(redis)
    tenant, _ = await stored_tenant(store)
    for model, prompt, completion in (("a", 3, 7), ("a", 1, 1), ("b", 2, 0)):
        admission = await limiter.admit(tenant, model)
        admission.prompt_tokens, admission.completion_tokens = prompt, completion
        await limiter.finish(admission)
    usage = (await store.usage([tenant.name]))[tenant.name]
    assert (usage["a"].requests, usage["a"].prompt_tokens, usage["a"].completion_tokens) == (2, 4, 8)
    assert (usage["b"].requests, usage["b"].prompt_tokens, usage["b"].completion_tokens) == (1, 2, 0)


async def test_authentication_of_command_line_and_stored_keys(redis: aioredis.Redis) -> None:
    auth = ApiKeyAuth(["sq-one", "sq-two"])
    await auth.start(redis)
    try:
        assert (await auth.authenticate("Bearer sq-two")) == Tenant("static-2", secret_hash("sq-two"))
        tenant, secret = await stored_tenant(ApiKeyStore(redis))
        assert (await auth.authenticate(f"bearer {secret}")) == tenant
        for header in (None, "", "Bearer", "Basic sq-one", "Bearer sq-three", "sq-one"):
            with pytest.raises(ApiError) as caught:
                await auth.authenticate(header)
            assert caught.value.status == 401
    finally:
        await auth.stop()


def test_static_keys_from_flags_files_and_environment(tmp_path: Path) -> None:
    path = tmp_path / "keys"
    path.write_text("# comment\nsq-b\n\n  sq-c  \nsq-a\n")
    assert static_keys(["sq-a"], [path], " sq-d ,sq-e,") == ["sq-a", "sq-b", "sq-c", "sq-d", "sq-e"]
    with pytest.raises(ValueError):
        static_keys([" "], [], None)


def test_keys_command_line() -> None:
    parse = build_parser().parse_args
    created = parse(with_default_subcommand(["keys", "create", "t", "--rpm", "5", "--models", "a,b"]))
    assert (created.rpm, created.tpm, created.models) == (5, None, ["a", "b"])
    changed = parse(["keys", "set", "t", "--tpm", "none"])
    assert changed.tpm is None and not hasattr(changed, "rpm")
    for bad in (["keys", "create", "t", "--rpm", "0"], ["keys", "create", "t", "--rpm", "x"], ["keys"]):
        with pytest.raises(SystemExit):
            parse(bad)
    assert isinstance(parse(["keys", "list"]), argparse.Namespace)
