"""Logprobs through every path: the library, the raw events in the replay log, the
command line, the gateway (the ``openai`` SDK, streamed and whole, completions and chat)
and batch files, on the session's real worker and engine.

What a user can check without knowing the model's weights: one entry per generated
token, log probabilities at most 0 whose probabilities sum to at most 1, the top tokens
sorted, and at temperature 0 the sampled token is the most likely one (rank 1, first of
the top). ``tests/real_engine/test_gateway_matches_vllm_serve.py`` checks the exact shapes against a
real ``vllm serve``."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import redis.asyncio as aioredis

from devkit.gateway_process import GatewayProcess
from devkit.worker_process import WorkerProcess
from producer.client import StreamqClient
from streamq.protocol import TokenLogprob, events_channel

PROMPT = "The key to happiness is"
MESSAGES = [{"role": "user", "content": "Hello there"}]
TOKENS = 8
GREEDY = {"max_tokens": TOKENS, "temperature": 0, "ignore_eos": True}


def check_entry(entry: TokenLogprob, token_id: int, top_k: int, *, greedy: bool) -> None:
    """What holds for any model: see the module's docstring."""
    assert entry.logprob <= 0 and entry.rank >= 1
    assert len(entry.top) == top_k
    logprobs = [t.logprob for t in entry.top]
    assert logprobs == sorted(logprobs, reverse=True)
    assert all(lp <= 0 for lp in logprobs) and sum(math.exp(lp) for lp in logprobs) <= 1 + 1e-4
    ids = [t.token_id for t in entry.top]
    if token_id in ids:  # the sampled token among the top: its place is its rank
        assert ids.index(token_id) + 1 == entry.rank and entry.top[entry.rank - 1].logprob == entry.logprob
    elif top_k:
        assert entry.rank > top_k and entry.logprob <= logprobs[-1]
    if greedy:
        assert entry.rank == 1 and (not top_k or ids[0] == token_id)


def check_completion_tokens(
    token_ids: Sequence[int], entries: Sequence[TokenLogprob], top_k: int, *, greedy: bool
) -> None:
    assert len(entries) == len(token_ids) > 0
    for token_id, entry in zip(token_ids, entries, strict=True):
        check_entry(entry, token_id, top_k, greedy=greedy)


# --- the library -----------------------------------------------------------------------------
async def test_the_library_returns_each_tokens_logprobs_and_the_prompts(client: StreamqClient) -> None:
    handle = await client.submit(PROMPT, logprobs=3, prompt_logprobs=2, **GREEDY)
    completion = await handle.result()
    assert completion.logprobs is not None and completion.completion_tokens == TOKENS
    check_completion_tokens(completion.token_ids[0], completion.logprobs[0], 3, greedy=True)
    prompt = completion.prompt_logprobs
    assert prompt is not None and completion.prompt_token_ids is not None
    assert len(prompt) == len(completion.prompt_token_ids) == completion.prompt_tokens
    assert prompt[0] is None  # nothing comes before the first prompt token
    for token_id, entry in zip(completion.prompt_token_ids[1:], prompt[1:], strict=True):
        assert entry is not None
        check_entry(entry, token_id, 2, greedy=False)


async def test_sampled_tokens_are_ranked_against_the_top_ones(client: StreamqClient) -> None:
    handle = await client.submit(PROMPT, logprobs=2, n=2, seed=11, max_tokens=TOKENS, temperature=1.5, ignore_eos=True)
    completion = await handle.result()
    assert completion.logprobs is not None and len(completion.logprobs) == 2
    for token_ids, entries in zip(completion.token_ids, completion.logprobs, strict=True):
        check_completion_tokens(token_ids, entries, 2, greedy=False)
    assert completion.prompt_logprobs is None


async def test_logprobs_zero_gives_the_sampled_tokens_alone(client: StreamqClient) -> None:
    completion = await (await client.submit(PROMPT, logprobs=0, **GREEDY)).result()
    assert completion.logprobs is not None
    check_completion_tokens(completion.token_ids[0], completion.logprobs[0], 0, greedy=True)


async def test_a_chat_request_has_logprobs_too(client: StreamqClient) -> None:
    completion = await (await client.submit(messages=MESSAGES, logprobs=1, prompt_logprobs=0, **GREEDY)).result()
    assert completion.logprobs is not None and completion.prompt_logprobs is not None
    check_completion_tokens(completion.token_ids[0], completion.logprobs[0], 1, greedy=True)
    assert len(completion.prompt_logprobs) == completion.prompt_tokens  # the chat template's tokens


# --- the raw protocol --------------------------------------------------------------------------
async def test_chunk_events_carry_logprobs_only_when_asked(client: StreamqClient, raw_redis: aioredis.Redis) -> None:
    asked = await client.submit(PROMPT, logprobs=2, prompt_logprobs=1, **GREEDY)
    plain = await client.submit(PROMPT, **GREEDY)
    await asked.result()
    await plain.result()

    async def chunks(request_id: str) -> list[dict[str, Any]]:
        logged = await raw_redis.xrange(events_channel(request_id))
        events = [json.loads(fields[b"event"]) for _, fields in logged]
        return [e for e in events if e["type"] == "chunk"]

    with_logprobs = await chunks(asked.request_id)
    for event in with_logprobs:
        assert len(event["logprobs"]) == len(event["token_ids"])
        for (logprob, rank, token, top), token_id in zip(event["logprobs"], event["token_ids"], strict=True):
            assert logprob <= 0 and rank == 1 and isinstance(token, str)
            assert len(top) == 2 and top[0][0] == token_id and top[0][2] == logprob
    first, *rest = with_logprobs
    assert len(first["prompt_logprobs"]) == len(first["prompt_token_ids"]) and first["prompt_logprobs"][0] is None
    assert not any("prompt_logprobs" in e or "prompt_token_ids" in e for e in rest)
    assert not any("logprobs" in e or "prompt_logprobs" in e for e in await chunks(plain.request_id))


# --- the command line --------------------------------------------------------------------------
def test_the_cli_prints_logprobs_in_its_json_events(worker: WorkerProcess, producer_url: str) -> None:
    env = {**os.environ, "REDIS_URL": producer_url}
    command = [sys.executable, "-m", "producer", "submit", "--json", "--queue", worker.queue]
    command += ["--max-tokens", "4", "--temperature", "0", "--logprobs", "2", "--prompt-logprobs", "1", PROMPT]
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 0, result.stderr
    events = [json.loads(line) for line in result.stdout.splitlines()]
    chunks = [e for e in events if e["type"] == "chunk"]
    assert sum(len(e["logprobs"]) for e in chunks) == sum(len(e["token_ids"]) for e in chunks) > 0
    assert chunks[0]["prompt_logprobs"][0] is None


def test_the_cli_refuses_negative_logprobs(worker: WorkerProcess, producer_url: str) -> None:
    env = {**os.environ, "REDIS_URL": producer_url}
    command = [sys.executable, "-m", "producer", "submit", "--queue", worker.queue, "--logprobs", "-5", PROMPT]
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode != 0 and "logprobs" in result.stderr


# --- the gateway -------------------------------------------------------------------------------
def check_top(top: dict[str, float] | list[Any], size: int) -> None:
    logprobs = list(top.values()) if isinstance(top, dict) else [t.logprob for t in top]
    assert 0 < len(logprobs) <= size and all(lp <= 0 for lp in logprobs)


def test_completions_logprobs_through_the_sdk_streamed_and_whole(sdk: openai.OpenAI, model: str) -> None:
    whole = sdk.completions.create(model=model, prompt=PROMPT, logprobs=2, extra_body={"ignore_eos": True}, **_greedy())
    logprobs = whole.choices[0].logprobs
    assert logprobs is not None and whole.usage is not None
    assert len(logprobs.tokens or []) == len(logprobs.token_logprobs or []) == whole.usage.completion_tokens
    assert all(lp is not None and lp <= 0 for lp in logprobs.token_logprobs or [])
    offsets = logprobs.text_offset or []
    assert offsets[0] == 0 and all(
        b - a == len(t) for a, b, t in zip(offsets, offsets[1:], logprobs.tokens or [], strict=False)
    )
    for top in logprobs.top_logprobs or []:
        check_top(top, 3)  # the sampled token's and the 2 most likely (one when they are the same)

    stream = sdk.completions.create(
        model=model, prompt=PROMPT, logprobs=2, stream=True, extra_body={"ignore_eos": True}, **_greedy()
    )
    streamed: dict[str, list[Any]] = {"text_offset": [], "token_logprobs": [], "tokens": [], "top_logprobs": []}
    for chunk in stream:
        for choice in chunk.choices:
            if choice.logprobs is not None:
                for key, values in streamed.items():
                    values.extend(getattr(choice.logprobs, key))
    assert streamed == logprobs.model_dump()  # temperature 0: the same tokens either way


def test_chat_logprobs_through_the_sdk_streamed_and_whole(sdk: openai.OpenAI, model: str) -> None:
    common: dict[str, Any] = {"model": model, "messages": MESSAGES, "logprobs": True, "top_logprobs": 2}
    whole = sdk.chat.completions.create(**common, extra_body={"ignore_eos": True}, **_greedy())
    content = whole.choices[0].logprobs and whole.choices[0].logprobs.content
    assert content and whole.usage is not None and len(content) == whole.usage.completion_tokens
    for token in content:
        assert token.logprob <= 0 and token.bytes == list(token.token.encode("utf-8", errors="replace"))
        check_top(token.top_logprobs, 2)
        assert token.top_logprobs[0].token == token.token  # temperature 0: the most likely was sampled

    stream = sdk.chat.completions.create(**common, stream=True, extra_body={"ignore_eos": True}, **_greedy())
    streamed = [
        t for chunk in stream for c in chunk.choices if c.logprobs and c.logprobs.content for t in c.logprobs.content
    ]
    assert [t.model_dump() for t in streamed] == [t.model_dump() for t in content]


def test_prompt_logprobs_in_whole_responses(gateway: GatewayProcess, model: str) -> None:
    body = {"model": model, "prompt": PROMPT, "prompt_logprobs": 1, **GREEDY}
    response = httpx.post(gateway.url + "/v1/completions", json=body, timeout=120).json()
    (choice,) = response["choices"]
    prompt = choice["prompt_logprobs"]
    assert len(prompt) == response["usage"]["prompt_tokens"] and prompt[0] is None
    assert all(1 <= len(position) <= 2 for position in prompt[1:])
    chat = {"model": model, "messages": MESSAGES, "prompt_logprobs": 0, **GREEDY}
    response = httpx.post(gateway.url + "/v1/chat/completions", json=chat, timeout=120).json()
    assert len(response["prompt_logprobs"]) == response["usage"]["prompt_tokens"]
    assert response["choices"][0]["logprobs"] is None


def test_prompt_logprobs_cannot_be_streamed(sdk: openai.OpenAI, model: str) -> None:
    with pytest.raises(openai.BadRequestError, match="prompt_logprobs"):
        sdk.completions.create(model=model, prompt=PROMPT, stream=True, extra_body={"prompt_logprobs": 1})


def _greedy() -> dict[str, Any]:
    return {"max_tokens": TOKENS, "temperature": 0}


# --- batch files -------------------------------------------------------------------------------
def test_batch_output_lines_carry_logprobs(worker: WorkerProcess, producer_url: str, tmp_path: Path) -> None:
    lines = [
        {"custom_id": "c", "url": "/v1/completions", "body": {"prompt": PROMPT, "logprobs": 1, **GREEDY}},
        {
            "custom_id": "chat",
            "url": "/v1/chat/completions",
            "body": {"messages": MESSAGES, "logprobs": True, "top_logprobs": 1, "prompt_logprobs": 0, **GREEDY},
        },
    ]
    in_path, out_path = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    in_path.write_text("".join(json.dumps({"method": "POST", **line}) + "\n" for line in lines))
    command = [sys.executable, "-m", "producer", "batch", str(in_path), str(out_path)]
    command += ["--redis-url", producer_url, "--queue", worker.queue, "--no-progress"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stderr
    out = {line["custom_id"]: line["response"]["body"] for line in map(json.loads, out_path.read_text().splitlines())}
    assert len(out["c"]["choices"][0]["logprobs"]["tokens"]) == TOKENS
    assert len(out["chat"]["choices"][0]["logprobs"]["content"]) == TOKENS
    assert len(out["chat"]["prompt_logprobs"]) == out["chat"]["usage"]["prompt_tokens"]
