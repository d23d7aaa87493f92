"""End to end with real parts: Redis, a worker process, the vLLM engine on the CPU."""

from __future__ import annotations

import asyncio
import json
import subprocess
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from devkit.redis_server import server_binary
from devkit.worker_process import WorkerProcess
from producer.client import StreamqClient
from producer.sync import StreamqClient as SyncClient
from streamq.protocol import DEFAULT_QUEUE, JOB_KEY_PREFIX, WAKEUP_CHANNEL
from tests.support.events import assert_well_formed, capture_events
from tests.support.reference_generate import MAX_TOKENS, PROMPTS


async def test_streamed_text_equals_bare_engine_output(
    client: StreamqClient, reference_outputs: dict[str, dict[str, Any]]
) -> None:
    for prompt in PROMPTS:
        handle = await client.submit(prompt, max_tokens=MAX_TOKENS, temperature=0.0)
        completion = await handle.result()
        assert completion.token_ids[0] == reference_outputs[prompt]["token_ids"]
        assert completion.text == reference_outputs[prompt]["text"]


async def test_the_blocking_client_shared_by_eight_threads_gives_each_the_bare_engines_text(
    worker: WorkerProcess, producer_url: str, reference_outputs: dict[str, dict[str, Any]]
) -> None:
    """A web server's threads on one ``producer.sync.StreamqClient``: half stream with a
    plain ``for``, half ``generate``; each gets its own prompt's text."""
    texts: dict[int, str] = {}

    def view(client: SyncClient, i: int) -> None:
        prompt = PROMPTS[i % len(PROMPTS)]
        if i % 2:
            texts[i] = client.generate(prompt, max_tokens=MAX_TOKENS, temperature=0.0, timeout=120).text
        else:
            with client.submit(prompt, max_tokens=MAX_TOKENS, temperature=0.0) as handle:
                texts[i] = "".join(handle.text())

    def serve() -> None:
        with SyncClient.connect(producer_url, queue=worker.queue) as client, ThreadPoolExecutor(8) as pool:
            for done in [pool.submit(view, client, i) for i in range(8)]:
                done.result(timeout=180)

    await asyncio.to_thread(serve)
    assert texts == {i: reference_outputs[PROMPTS[i % len(PROMPTS)]]["text"] for i in range(8)}


async def test_events_are_numbered_contiguously_and_end_with_one_final(
    client: StreamqClient, redis_url: str, request_id: str
) -> None:
    events = await capture_events(
        redis_url, request_id, lambda: client.submit(PROMPTS[0], request_id=request_id, max_tokens=32, ignore_eos=True)
    )
    assert_well_formed(events, request_id)
    chunks, final = events[:-1], events[-1]
    assert final["type"] == "final"
    assert final["finish_reasons"] == ["length"]
    assert final["completion_tokens"] == 32 == sum(len(c["token_ids"]) for c in chunks)
    assert final["prompt_tokens"] > 0
    # Every DELTA carries its tokens, even when they do not yet decode to text.
    assert all(c["type"] == "chunk" and c["token_ids"] for c in chunks)
    assert chunks[-1]["finish_reason"] == "length"


async def test_a_token_id_prompt_answers_as_its_text_does_and_echo_sends_it_back(
    client: StreamqClient, tiny_model: Path
) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    ids = tokenizer.encode(PROMPTS[0])  # as the engine tokenizes a text prompt: special tokens too
    from_text = await client.generate(PROMPTS[0], max_tokens=8, temperature=0.0)
    from_ids = await client.generate(ids, max_tokens=8, temperature=0.0, echo=True)
    assert from_ids.token_ids == from_text.token_ids and from_ids.text == from_text.text
    assert from_ids.prompt_token_ids == ids and from_ids.prompt_echo is not None
    assert from_ids.prompt_echo.text == tokenizer.decode(ids)
    assert from_ids.prompt_echo.first_token == tokenizer.decode(ids[0])


async def test_deltas_decode_to_the_streamed_text(client: StreamqClient, tiny_model: Path) -> None:
    completion = await (await client.submit(PROMPTS[1], max_tokens=40, temperature=0.0)).result()
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    decoded = tokenizer.decode(completion.token_ids[0], skip_special_tokens=True)
    # vLLM holds back bytes that do not yet form a whole character; any left when the
    # generation stops never become text (a full decode shows them as U+FFFD).
    assert decoded.startswith(completion.text)
    assert set(decoded[len(completion.text) :]) <= {"\ufffd"}


async def test_stream_interval_sends_fewer_bigger_chunks_of_the_same_text(
    client: StreamqClient, redis_url: str, request_id: str
) -> None:
    every_token = await (await client.submit(PROMPTS[0], max_tokens=32, ignore_eos=True, temperature=0.0)).result()
    events = await capture_events(
        redis_url,
        request_id,
        lambda: client.submit(
            PROMPTS[0], request_id=request_id, max_tokens=32, ignore_eos=True, temperature=0.0, stream_interval=8
        ),
    )
    assert_well_formed(events, request_id)
    sizes = [len(e["token_ids"]) for e in events[:-1]]
    assert sizes[0] == 1  # the first token is not held back
    assert all(size >= 8 for size in sizes[1:-1]) and sum(sizes) == 32
    assert "".join(e["text"] for e in events[:-1]) == every_token.text


async def test_32_concurrent_prompts_all_complete(client: StreamqClient) -> None:
    handles = [await client.submit(f"{PROMPTS[i % 3]} {i}", max_tokens=16, ignore_eos=True) for i in range(32)]
    completions = await asyncio.wait_for(asyncio.gather(*(h.result() for h in handles)), timeout=180)
    assert len({c.request_id for c in completions}) == 32
    assert all(c.completion_tokens == 16 and c.finish_reasons == ["length"] for c in completions)


async def test_n_completions_are_kept_apart_by_index(client: StreamqClient, redis_url: str, request_id: str) -> None:
    events = await capture_events(
        redis_url,
        request_id,
        lambda: client.submit(
            PROMPTS[2], request_id=request_id, n=3, max_tokens=8, temperature=1.0, seed=7, ignore_eos=True
        ),
    )
    assert_well_formed(events, request_id)
    chunks, final = events[:-1], events[-1]
    assert {c["index"] for c in chunks} == {0, 1, 2}
    for index in range(3):
        tokens = [t for c in chunks if c["index"] == index for t in c["token_ids"]]
        assert len(tokens) == 8
    assert final["finish_reasons"] == ["length", "length", "length"]
    assert final["completion_tokens"] == 24


async def test_chat_messages_are_rendered_with_the_chat_template(client: StreamqClient, tiny_model: Path) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": PROMPTS[0]}]
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert "<|im_start|>assistant" in rendered  # the template, not the bare content
    expected_prompt_tokens = len(tokenizer.encode(rendered, add_special_tokens=False))

    completion = await (await client.submit(messages=messages, max_tokens=8, temperature=0.0)).result()
    assert completion.prompt_tokens == expected_prompt_tokens


async def test_job_enqueued_with_plain_redis_commands_streams(worker: WorkerProcess, producer_url: str) -> None:
    """The PROTOCOL.md recipe, with redis-cli (valkey-cli) and no streamq code, as the producer role."""
    request_id = f"raw-{uuid.uuid4().hex}"
    cli = [str(Path(server_binary()).with_name("valkey-cli")), "-u", producer_url]
    if not Path(cli[0]).exists():
        pytest.skip("no redis-cli binary beside the server")
    job = json.dumps(
        {
            "t": 1,
            "f": "generate",
            "k": {},
            "et": int(time.time() * 1000),
            "a": [{"request_id": request_id, "prompt": PROMPTS[0], "sampling": {"max_tokens": 8, "temperature": 0}}],
        }
    )

    async def enqueue() -> None:
        for command in (
            ["SET", JOB_KEY_PREFIX + request_id, job, "PX", "86400000"],
            ["ZADD", DEFAULT_QUEUE, str(int(time.time() * 1000)), request_id],
            ["PUBLISH", WAKEUP_CHANNEL, DEFAULT_QUEUE],
        ):
            subprocess.run(cli + command, check=True, capture_output=True)

    events = await capture_events(producer_url, request_id, enqueue)
    assert_well_formed(events, request_id)
    assert events[-1]["type"] == "final"
    assert sum(len(e["token_ids"]) for e in events[:-1]) == 8
