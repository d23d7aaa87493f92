"""Coalescing through a real worker and engine: while Redis is slow to take writes, a
request's DELTAs merge into fewer chunks, and the stream still reassembles to exactly
what a bare AsyncLLM generates."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import redis.asyncio as aioredis

from producer.client import StreamqClient
from streamq.broker.replay_log import ReplayLog
from streamq.protocol import ChunkEvent, FinalEvent, decode_event
from tests.support.reference_generate import MAX_TOKENS, PROMPTS


async def pause_writes_until_cancelled(redis: aioredis.Redis) -> None:
    """Hold every write (the worker's publish script among them) for 50 ms out of each
    60 ms: batches stay in flight while the engine keeps producing DELTAs."""
    while True:
        await redis.execute_command("CLIENT", "PAUSE", 50, "WRITE")
        await asyncio.sleep(0.06)


async def test_chunks_merged_behind_a_slow_redis_reassemble_to_the_bare_engine_output(
    client: StreamqClient,
    raw_redis: aioredis.Redis,
    reference_outputs: dict[str, dict[str, Any]],
) -> None:
    pauser = asyncio.create_task(pause_writes_until_cancelled(raw_redis))
    try:
        handles = [await client.submit(prompt, max_tokens=MAX_TOKENS, temperature=0.0) for prompt in PROMPTS]
        completions = await asyncio.gather(*(handle.result() for handle in handles))
    finally:
        pauser.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await pauser
        await raw_redis.execute_command("CLIENT", "UNPAUSE")

    merged = 0
    for prompt, handle, completion in zip(PROMPTS, handles, completions, strict=True):
        # What the subscriber rebuilt...
        assert completion.token_ids[0] == reference_outputs[prompt]["token_ids"]
        assert completion.text == reference_outputs[prompt]["text"]
        # ...from what crossed the wire: fewer chunks than tokens, numbered without gaps.
        events = [decode_event(raw) for raw in await ReplayLog(raw_redis).read(handle.request_id)]
        assert [event.seq for event in events] == list(range(len(events)))
        chunks = [event for event in events if isinstance(event, ChunkEvent)]
        assert [t for chunk in chunks for t in chunk.token_ids] == reference_outputs[prompt]["token_ids"]
        assert "".join(chunk.text for chunk in chunks) == reference_outputs[prompt]["text"]
        assert isinstance(events[-1], FinalEvent) and events[-1].completion_tokens == MAX_TOKENS
        merged += sum(len(chunk.token_ids) > 1 for chunk in chunks)
    assert merged > 0, "no chunk carried more than one token: Redis was never slow enough to merge"
