"""The producer library refuses what can never run before anything is queued: a job over
``MAX_JOB_BYTES``, a prompt over ``MAX_PROMPT_CHARS``; and it lowers ``max_tokens`` past the model's context
to the context. Real Redis, no worker."""

from __future__ import annotations

import re
import uuid
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis

from producer.client import StreamqClient
from streamq.broker.registry import Routes, WorkerRegistry
from streamq.protocol import (
    JOB_KEY_PREFIX,
    MAX_JOB_BYTES,
    MAX_PROMPT_CHARS,
    InvalidRequest,
    WorkerRegistration,
    deserialize_job,
    events_channel,
)


@pytest.fixture
async def client(redis_url: str) -> AsyncIterator[StreamqClient]:
    queue = f"streamq:queue:nobody-{uuid.uuid4().hex[:8]}"
    async with await StreamqClient.connect(redis_url, queue=queue) as client:
        yield client


async def assert_nothing_queued(raw_redis: aioredis.Redis, queue: str, request_id: str) -> None:
    assert await raw_redis.zcard(queue) == 0
    assert await raw_redis.exists(JOB_KEY_PREFIX + request_id, events_channel(request_id)) == 0


async def test_a_job_over_the_payload_limit_is_refused_before_it_reaches_redis(
    client: StreamqClient, raw_redis: aioredis.Redis
) -> None:
    request_id = f"big-{uuid.uuid4().hex}"
    stop = ["x" * 1_000] * (MAX_JOB_BYTES // 1_000 + 1)  # a short prompt, a job too large all the same
    with pytest.raises(InvalidRequest) as caught:
        await client.submit("Hello", request_id=request_id, stop=stop)
    stated = re.fullmatch(
        rf"the request is (\d+) bytes as a job; the limit is {MAX_JOB_BYTES} bytes", str(caught.value)
    )
    assert stated is not None and int(stated.group(1)) > MAX_JOB_BYTES
    await assert_nothing_queued(raw_redis, client.queue, request_id)
    handle = await client.submit("Hello", request_id=request_id, stop=stop[:100])  # the id was never taken
    assert await handle.cancel() == "queued"
    await handle.close()


async def test_a_prompt_over_the_length_limit_is_refused_before_it_reaches_redis(
    client: StreamqClient, raw_redis: aioredis.Redis
) -> None:
    request_id = f"long-{uuid.uuid4().hex}"
    with pytest.raises(InvalidRequest, match=f"the limit is {MAX_PROMPT_CHARS}"):
        await client.submit("x" * (MAX_PROMPT_CHARS + 1), request_id=request_id)
    await assert_nothing_queued(raw_redis, client.queue, request_id)


@pytest.fixture
async def sized_model(raw_redis: aioredis.Redis) -> AsyncIterator[WorkerRegistration]:
    """A model with two live 'workers' (that never take jobs) of contexts 64 and 128."""
    name = f"sized-{uuid.uuid4().hex[:8]}"
    registry = WorkerRegistry(raw_redis)
    registrations = [
        WorkerRegistration(
            worker_id=f"{name}-{length}", model=name, queue=f"streamq:queue:{name}", max_model_len=length
        )
        for length in (64, 128)
    ]
    for registration in registrations:
        await registry.register(registration, ttl_ms=600_000)
    yield registrations[0]
    for registration in registrations:
        await registry.unregister(registration)
    await raw_redis.delete(registrations[0].queue)


async def test_max_tokens_past_the_smallest_live_context_is_lowered_to_it(
    client: StreamqClient, raw_redis: aioredis.Redis, sized_model: WorkerRegistration
) -> None:
    """As ``vllm serve`` does: generation stops at the context anyway, so the request runs."""
    for asked, queued in ((10_000, 64), (64, 64), (63, 63)):
        request_id = f"ctx-{uuid.uuid4().hex}"
        handle = await client.submit("Hello", model=sized_model.model, request_id=request_id, max_tokens=asked)
        job = deserialize_job(await raw_redis.get(JOB_KEY_PREFIX + request_id))
        assert job["a"][0]["sampling"]["max_tokens"] == queued
        assert await handle.cancel() == "queued"
        await handle.close()


async def test_without_a_model_or_a_known_context_max_tokens_is_left_to_the_worker(
    client: StreamqClient, raw_redis: aioredis.Redis
) -> None:
    name = f"unsized-{uuid.uuid4().hex[:8]}"
    registration = WorkerRegistration(worker_id=name, model=name, queue=f"streamq:queue:{name}")
    registry = WorkerRegistry(raw_redis)
    await registry.register(registration, ttl_ms=600_000)
    try:
        for model in (None, name):
            handle = await client.submit("Hello", model=model, max_tokens=1_000_000)
            assert await handle.cancel() == "queued"
            await handle.close()
    finally:
        await registry.unregister(registration)
        await raw_redis.delete(registration.queue)


async def test_submits_of_a_live_model_reuse_one_registry_read_and_a_new_model_is_found_at_once(
    client: StreamqClient, raw_redis: aioredis.Redis, sized_model: WorkerRegistration, monkeypatch: pytest.MonkeyPatch
) -> None:
    reads = 0
    read_routes = WorkerRegistry.routes

    async def counted(registry: WorkerRegistry) -> Routes:
        nonlocal reads
        reads += 1
        return await read_routes(registry)

    monkeypatch.setattr(WorkerRegistry, "routes", counted)
    for _ in range(3):
        handle = await client.submit("Hello", model=sized_model.model)
        assert await handle.cancel() == "queued"
        await handle.close()
    assert reads == 1  # one round trip before the first enqueue, none before the next two

    name = f"new-{uuid.uuid4().hex[:8]}"
    registration = WorkerRegistration(worker_id=name, model=name, queue=f"streamq:queue:{name}")
    await WorkerRegistry(raw_redis).register(registration, ttl_ms=600_000)
    try:
        handle = await client.submit("Hello", model=name)  # registered after the read above
        assert await raw_redis.zcard(registration.queue) == 1
        assert await handle.cancel() == "queued"
        await handle.close()
    finally:
        await WorkerRegistry(raw_redis).unregister(registration)
        await raw_redis.delete(registration.queue)
