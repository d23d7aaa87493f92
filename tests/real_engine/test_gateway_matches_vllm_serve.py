"""The gateway answers as ``vllm serve`` does, chunk for chunk: a real ``vllm serve`` and
a real gateway in front of a real worker, the same tiny model and engine flags, the same
requests at temperature 0, their responses compared whole (only ids, timestamps and the
system fingerprint may differ). The tiny model's tokens often end inside a multi-byte
character, so the streams hold chunks whose text is empty; the test checks that the answers
compared hold such tokens.

vLLM itself merges the outputs of steps its consumer has not picked up yet (its
``RequestOutputCollector``), on either server, whenever that consumer is late: a matter of
timing on a busy machine. So the reference is the first of a few tries of ``vllm serve``
in which every token came as a chunk of its own (``ignore_eos`` makes that count known), or
else the try of most chunks; both servers are asked for each chunk's ``token_ids``, and the
streams are compared merged at the token counts where both ended a chunk. With a
per-token reference, the usual case, that is the reference merged as the worker's engine
merged it: one chunk for each chunk event of the request's replay log, covering as many
tokens."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import redis
from transformers import AutoTokenizer

from devkit.gateway_process import GatewayProcess
from devkit.worker_process import tiny_engine_flags, worker_env
from producer.openai_api.fields import ENDPOINT_FIELDS, LEGACY_FIELDS, Support
from streamq.protocol import ChunkEvent, decode_event, events_channel, is_valid_request_id
from tests.support.schema_fuzz import Answers, answered, bounded, drawn_bodies
from tests.support.session import MAX_MODEL_LEN
from tests.support.vllm_serve import beside_a_worker, comparable, post

MODEL = "tiny-as-vllm-serve"
"""Served under a name of its own, on a queue of its own, so no other worker of the
session answers the gateway's requests."""
QUEUE = f"streamq:queue:{MODEL}"

PROMPTS = ["The key to happiness is", "In a galaxy far"]
MESSAGES = [[{"role": "user", "content": "Hello there"}], [{"role": "user", "content": "The key to happiness is"}]]
MAX_TOKENS = 12
TRIES = 10


def engine_flags(tiny_model: Path) -> list[str]:
    """The same for both; the scheduler limits are spelled out because ``vllm serve``
    and ``AsyncLLM.from_engine_args`` default them differently."""
    flags = tiny_engine_flags(tiny_model, max_model_len=MAX_MODEL_LEN)
    return [*flags, "--served-model-name", MODEL, "--max-num-seqs", "16", "--max-num-batched-tokens", "2048"]


@dataclass(frozen=True)
class Servers:
    serve_url: str
    gateway_url: str
    redis_url: str
    """The harness's, to read the replay logs."""
    gateway_redis_url: str
    """Redis as the gateway role sees it, for a second gateway."""
    tiny_model: Path


@pytest.fixture(scope="module")
def servers(
    redis_url: str, worker_url: str, gateway_url: str, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Servers]:
    """``vllm serve`` and a gateway; both engines start at once. The worker publishes each
    engine output as one event (no merging of its own), as ``vllm serve`` sends it."""
    logs = tmp_path_factory.mktemp("vs-vllm-serve")
    env = worker_env(STREAMQ_COALESCE="0")
    with beside_a_worker(
        engine_flags(tiny_model), worker_url=worker_url, gateway_url=gateway_url, queue=QUEUE, logs=logs, env=env
    ) as (serve_url, ours):
        yield Servers(serve_url, ours, redis_url, gateway_url, tiny_model)


def text_of(choice: dict[str, Any]) -> str:
    """A streamed choice's text (a chat delta's content)."""
    return str(choice["text"] if "text" in choice else choice["delta"]["content"])


def texts(chunks: list[Any]) -> list[str]:
    return [text_of(c) for chunk in chunks for c in chunk["choices"]]


def is_role(chunk: dict[str, Any]) -> bool:
    return bool(chunk["choices"]) and "role" in chunk["choices"][0].get("delta", {})


def token_chunks(chunks: list[Any]) -> list[dict[str, Any]]:
    """The chunks that carry tokens: all but a chat stream's role chunks and the usage chunk."""
    return [chunk for chunk in chunks if chunk["choices"] and not is_role(chunk)]


def reference_stream(servers: Servers, path: str, body: dict[str, Any], tokens: int) -> list[Any]:
    """The first of ``TRIES`` streams of ``vllm serve`` in which each of ``tokens`` came
    alone, or else the one of most chunks (vLLM merged outputs in every try)."""
    tries = []
    for _ in range(TRIES):
        chunks, _ = post(servers.serve_url, path, body)
        if len(token_chunks(chunks)) == tokens:
            return chunks
        tries.append(chunks)
    return max(tries, key=lambda chunks: len(token_chunks(chunks)))


def logged_chunks(servers: Servers, request_id: str) -> list[ChunkEvent]:
    client = redis.Redis.from_url(servers.redis_url)
    try:
        logged = [decode_event(fields[b"event"]) for _, fields in client.xrange(events_channel(request_id))]
    finally:
        client.close()
    return [event for event in logged if isinstance(event, ChunkEvent)]


def counted(chunks: list[Any]) -> Iterator[tuple[dict[str, Any], int, int]]:
    """Each token chunk of ``chunks``, its choice, and how many of that choice's tokens were
    sent up to and with it (``return_token_ids`` names them)."""
    sent: dict[int, int] = {}
    for chunk in token_chunks(chunks):
        choice = chunk["choices"][0]
        sent[choice["index"]] = sent.get(choice["index"], 0) + len(choice["token_ids"])
        yield chunk, choice["index"], sent[choice["index"]]


def chunk_ends(chunks: list[Any]) -> dict[int, set[int]]:
    """Per choice, where its token chunks end: the count of its tokens sent up to and with each."""
    ends: dict[int, set[int]] = {}
    for _, index, sent in counted(chunks):
        ends.setdefault(index, set()).add(sent)
    return ends


def merged_at(chunks: list[Any], ends: dict[int, set[int]]) -> dict[str, list[Any]]:
    """``chunks`` with each choice's token chunks merged up to each of its ``ends``: one
    chunk per end (``merged_chunk``). Keyed ``opening`` (a chat stream's role chunks),
    ``closing`` (the usage chunk), and by choice (their order across choices is timing, not
    content)."""
    merged: dict[str, list[Any]] = {
        "opening": [chunk for chunk in chunks if is_role(chunk)],
        "closing": [chunk for chunk in chunks if not chunk["choices"]],
    }
    covered: dict[int, list[dict[str, Any]]] = {}
    for chunk, index, sent in counted(chunks):
        covered.setdefault(index, []).append(chunk)
        if sent in ends[index]:
            merged.setdefault(f"choice {index}", []).append(merged_chunk(covered.pop(index)))
    assert not any(covered.values()), "a choice's last chunks end nowhere both streams end"
    return merged


def merged_chunk(covered: list[dict[str, Any]]) -> dict[str, Any]:
    """One chunk for the ``covered`` ones: the keys of the last, the prompt's token ids of the
    first (a completion's first chunk names them), the text, token ids and logprobs of all."""
    chunk = copy.deepcopy(covered[-1])
    choice = chunk["choices"][0]
    if "prompt_token_ids" in choice:
        choice["prompt_token_ids"] = covered[0]["choices"][0]["prompt_token_ids"]
    text = "".join(text_of(c["choices"][0]) for c in covered)
    if "text" in choice:
        choice["text"] = text
    else:
        choice["delta"]["content"] = text
    choice["token_ids"] = [token for c in covered for token in c["choices"][0]["token_ids"]]
    if choice.get("logprobs") is not None:
        choice["logprobs"] = merged_logprobs([c["choices"][0]["logprobs"] for c in covered])
    return chunk


def merged_logprobs(parts: list[dict[str, list[Any]]]) -> dict[str, list[Any]]:
    """The logprobs of consecutive chunks as one chunk's: each list concatenated."""
    return {key: [item for part in parts for item in part[key]] for key in parts[0]}


def compare_streams(servers: Servers, path: str, body: dict[str, Any], tokens: int) -> list[Any]:
    """Assert that the gateway streams ``body`` as ``vllm serve`` does, chunk for chunk where
    both split the tokens alike; the reference. Either server's vLLM may merge outputs its
    consumer was late for (the module's docstring), so both streams are compared merged at
    the token counts where both ended a chunk: with a reference of one token per chunk (the
    usual), exactly as the worker's engine merged them."""
    body = {**body, "return_token_ids": True}
    reference = reference_stream(servers, path, body, tokens)
    ours, request_id = post(servers.gateway_url, path, body)
    events = logged_chunks(servers, request_id)
    assert len(token_chunks(ours)) == len(events), "one chunk for each chunk event"
    assert [len(c["choices"][0]["token_ids"]) for c in token_chunks(ours)] == [len(e.token_ids) for e in events]
    theirs_ends, our_ends = chunk_ends(reference), chunk_ends(ours)
    assert theirs_ends.keys() == our_ends.keys(), "the same choices"
    common = {index: theirs_ends[index] & our_ends[index] for index in theirs_ends}
    assert comparable(merged_at(ours, common)) == comparable(merged_at(reference, common))
    return reference


def ends_inside_a_character(tiny_model: Path, token_ids: list[int]) -> int:
    """How many of ``token_ids`` (one completion's) end inside a multi-byte character: the
    text so far ends in an incomplete one, so vLLM streams that token's chunk with no text."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    return sum(tokenizer.decode(token_ids[: i + 1]).endswith("\ufffd") for i in range(len(token_ids)))


def tokens_of(chunks: list[Any]) -> list[int]:
    return [token for chunk in token_chunks(chunks) for token in chunk["choices"][0]["token_ids"]]


def stream_body(field: str, request: Any, *, include_usage: bool = False, **more: Any) -> dict[str, Any]:
    body = {"model": MODEL, field: request, "max_tokens": MAX_TOKENS, "ignore_eos": True, "temperature": 0}
    body |= {"stream": True, **more}
    if include_usage:
        body["stream_options"] = {"include_usage": True}
    return body


@pytest.mark.parametrize("include_usage", [False, True])
def test_streamed_completions_match_chunk_for_chunk(servers: Servers, include_usage: bool) -> None:
    split = 0
    for prompt in PROMPTS:
        reference = compare_streams(
            servers, "/v1/completions", stream_body("prompt", prompt, include_usage=include_usage), MAX_TOKENS
        )
        split += ends_inside_a_character(servers.tiny_model, tokens_of(reference))
    assert split > 0, "no token ends inside a character: no chunk with empty text was compared"


@pytest.mark.parametrize("include_usage", [False, True])
def test_streamed_chat_matches_chunk_for_chunk(servers: Servers, include_usage: bool) -> None:
    split = 0
    for messages in MESSAGES:
        body = stream_body("messages", messages, include_usage=include_usage)
        reference = compare_streams(servers, "/v1/chat/completions", body, MAX_TOKENS)
        assert is_role(reference[0]) and not is_role(reference[1])
        split += ends_inside_a_character(servers.tiny_model, tokens_of(reference))
    assert split > 0, "no token ends inside a character: no content chunk with empty text was compared"


def test_streamed_chat_of_several_choices_matches(servers: Servers) -> None:
    body = stream_body("messages", MESSAGES[0], n=2, temperature=1.0, seed=7)
    reference = compare_streams(servers, "/v1/chat/completions", body, 2 * MAX_TOKENS)
    assert [is_role(chunk) for chunk in reference[:3]] == [True, True, False]  # one role chunk per choice


CONTINUOUS_USAGE = {"include_usage": True, "continuous_usage_stats": True}
"""guidellm's default: a ``usage`` in every chunk."""


@pytest.mark.parametrize(
    ("path", "field", "request_", "more"),
    [
        ("/v1/completions", "prompt", PROMPTS[0], {}),
        ("/v1/chat/completions", "messages", MESSAGES[0], {}),
        ("/v1/chat/completions", "messages", MESSAGES[1], {"n": 2, "temperature": 1.0, "seed": 7}),
    ],
    ids=["completion", "chat", "chat-of-two-choices"],
)
def test_continuous_usage_stats_put_the_same_usage_in_every_chunk(
    servers: Servers, path: str, field: str, request_: Any, more: dict[str, Any]
) -> None:
    body = stream_body(field, request_, stream_options=CONTINUOUS_USAGE, **more)
    choices = more.get("n", 1)
    reference = compare_streams(servers, path, body, choices * MAX_TOKENS)
    assert all("usage" in chunk for chunk in reference), "vllm serve put a usage in every chunk"
    assert reference[-1]["usage"]["completion_tokens"] == choices * MAX_TOKENS


def test_streamed_completions_with_logprobs_match(servers: Servers) -> None:
    for prompt in PROMPTS:
        reference = compare_streams(servers, "/v1/completions", stream_body("prompt", prompt, logprobs=3), MAX_TOKENS)
        choices = [c for chunk in token_chunks(reference) for c in chunk["choices"]]
        assert all(len(c["logprobs"]["tokens"]) == len(c["token_ids"]) for c in choices)


def test_streamed_chat_with_logprobs_matches(servers: Servers) -> None:
    for messages in MESSAGES:
        body = stream_body("messages", messages, include_usage=True, logprobs=True, top_logprobs=3)
        reference = compare_streams(servers, "/v1/chat/completions", body, MAX_TOKENS)
        choices = [c for chunk in token_chunks(reference) for c in chunk["choices"]]
        assert all(len(c["logprobs"]["content"]) == len(c["token_ids"]) for c in choices)
        assert all(len(entry["top_logprobs"]) == 3 for c in choices for entry in c["logprobs"]["content"])


WHOLE_EXTRAS = {
    "/v1/completions": [{}, {"logprobs": 0}, {"logprobs": 3, "prompt_logprobs": 2}],
    "/v1/chat/completions": [{}, {"logprobs": True}, {"logprobs": True, "top_logprobs": 2, "prompt_logprobs": 1}],
}


@pytest.mark.parametrize(
    ("path", "extra"), [(path, extra) for path, extras in WHOLE_EXTRAS.items() for extra in extras]
)
def test_whole_responses_match(servers: Servers, path: str, extra: dict[str, Any]) -> None:
    field = "prompt" if path == "/v1/completions" else "messages"
    request = PROMPTS[0] if field == "prompt" else MESSAGES[0]
    body = {"model": MODEL, field: request, "max_tokens": MAX_TOKENS, "temperature": 0, **extra}
    (ours,), _ = post(servers.gateway_url, path, body)
    (reference,), _ = post(servers.serve_url, path, body)
    assert comparable(ours) == comparable(reference)


# --- the rest of the completions API: token prompts, several prompts, echo, vLLM's fields -------
TOKEN_PROMPTS = [[5, 17, 42, 99], [7, 8, 9, 10, 11]]
"""Token ids the tiny model's vocabulary holds (its size is a few hundred)."""

WHOLE_COMPLETIONS = [
    {"prompt": TOKEN_PROMPTS[0]},
    {"prompt": PROMPTS},
    {"prompt": TOKEN_PROMPTS, "logprobs": 2},
    {"prompt": PROMPTS, "n": 2, "temperature": 1.0, "seed": 3},
    {"prompt": PROMPTS[0], "echo": True},
    {"prompt": TOKEN_PROMPTS, "echo": True, "logprobs": 1, "max_tokens": 1},  # lm-evaluation-harness's loglikelihood
    {"prompt": PROMPTS[0], "echo": True, "logprobs": 2, "max_tokens": 0},
    {"prompt": PROMPTS[0], "echo": True, "return_token_ids": True},
    {"prompt": PROMPTS[0], "logprobs": 2, "return_tokens_as_token_ids": True},
    {"prompt": PROMPTS[0], "logit_bias": {"5": 100}},
    {"prompt": PROMPTS[0], "allowed_token_ids": [5, 6, 7]},
    {"prompt": PROMPTS[0], "bad_words": ["the"], "spaces_between_special_tokens": False},
]
WHOLE_CHATS = [
    {
        "messages": [*MESSAGES[0], {"role": "assistant", "content": "The key"}],
        "add_generation_prompt": False,
        "continue_final_message": True,
        "echo": True,
    },
    {"messages": MESSAGES[1], "chat_template_kwargs": {"not_in_the_template": 1}},
    {"messages": [{"role": "user", "content": [{"type": "text", "text": "Hello"}, {"type": "text", "text": "there"}]}]},
    {"messages": MESSAGES[0], "logprobs": True, "top_logprobs": 2, "return_tokens_as_token_ids": True},
    {"messages": MESSAGES[1], "return_token_ids": True},
]


WHOLE_BODIES = [("/v1/completions", body) for body in WHOLE_COMPLETIONS]
WHOLE_BODIES += [("/v1/chat/completions", body) for body in WHOLE_CHATS]


@pytest.mark.parametrize(
    ("path", "extra"), WHOLE_BODIES, ids=lambda item: ",".join(item) if isinstance(item, dict) else item
)
def test_whole_responses_in_every_form_match(servers: Servers, path: str, extra: dict[str, Any]) -> None:
    body = {"model": MODEL, "max_tokens": MAX_TOKENS, "temperature": 0, **extra}
    (ours,), _ = post(servers.gateway_url, path, body)
    (reference,), _ = post(servers.serve_url, path, body)
    assert comparable(ours) == comparable(reference)


# --- fields the queue carries to the worker: each answers as in vllm serve -------------------
FORMERLY_REFUSED: list[tuple[str, dict[str, Any], bool]] = [
    ("/v1/completions", {"prompt": PROMPTS[0], "truncate_prompt_tokens": 3, "return_token_ids": True}, True),
    (
        "/v1/completions",
        {"prompt": PROMPTS[0], "truncate_prompt_tokens": 3, "truncation_side": "left", "return_token_ids": True},
        True,
    ),
    ("/v1/completions", {"prompt": TOKEN_PROMPTS[1], "truncate_prompt_tokens": 2, "truncation_side": "left"}, True),
    ("/v1/completions", {"prompt": PROMPTS[0], "cache_salt": "tenant-a"}, False),
    ("/v1/completions", {"prompt": PROMPTS[0], "logprobs": 1, "logprob_token_ids": [5, 17]}, True),
    ("/v1/chat/completions", {"messages": MESSAGES[0], "logprobs": True, "logprob_token_ids": [5, 17]}, True),
    (
        "/v1/chat/completions",
        {"messages": MESSAGES[1], "truncate_prompt_tokens": 5, "truncation_side": "left", "return_token_ids": True},
        True,
    ),
    ("/v1/chat/completions", {"messages": MESSAGES[1], "return_prompt_text": True}, True),
    ("/v1/chat/completions", {"messages": MESSAGES[0], "cache_salt": "tenant-a"}, False),
    # The tiny model's template reads no reasoning_effort, and its workers run no reasoning
    # parser: both servers answer as without them.
    ("/v1/chat/completions", {"messages": MESSAGES[0], "reasoning_effort": "low"}, False),
    ("/v1/chat/completions", {"messages": MESSAGES[0], "include_reasoning": False}, False),
]
FIELD_OF = {"/v1/completions": ("prompt",), "/v1/chat/completions": ("messages",)}


@pytest.mark.parametrize(
    ("path", "extra", "changes"),
    FORMERLY_REFUSED,
    ids=lambda item: ",".join(item) if isinstance(item, dict) else str(item),
)
def test_the_fields_the_queue_carries_answer_as_vllm_serve(
    servers: Servers, path: str, extra: dict[str, Any], changes: bool
) -> None:
    """Each answers as ``vllm serve`` does; those that change the answer change it (the same
    request without them, from ``vllm serve``, differs)."""
    body = {"model": MODEL, "max_tokens": MAX_TOKENS, "temperature": 0, **extra}
    (ours,), _ = post(servers.gateway_url, path, body)
    (reference,), _ = post(servers.serve_url, path, body)
    assert comparable(ours) == comparable(reference)
    plain = {k: v for k, v in body.items() if k in ("model", "max_tokens", "temperature", *FIELD_OF[path])}
    (without,), _ = post(servers.serve_url, path, plain)
    assert (comparable(without) != comparable(reference)) == changes


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_a_request_id_in_the_body_names_the_response_as_in_vllm_serve(servers: Servers, path: str) -> None:
    request_id = f"body-id-{uuid.uuid4().hex[:12]}"
    field, request = ("prompt", PROMPTS[0]) if path == "/v1/completions" else ("messages", MESSAGES[0])
    body = {"model": MODEL, field: request, "max_tokens": 2, "request_id": request_id}
    (ours,), named = post(servers.gateway_url, path, body)
    (reference,), _ = post(servers.serve_url, path, body)
    assert ours["id"] == reference["id"] and reference["id"].endswith(f"-{request_id}")
    assert named == request_id


def test_streamed_logprobs_of_chosen_tokens_match(servers: Servers) -> None:
    chosen = [5, 17, 42]
    for path, field, request in [
        ("/v1/completions", "prompt", PROMPTS[0]),
        ("/v1/chat/completions", "messages", MESSAGES[0]),
    ]:
        logprobs: dict[str, Any] = {"logprobs": 2} if field == "prompt" else {"logprobs": True}
        body = stream_body(field, request, **logprobs, logprob_token_ids=chosen)
        reference = compare_streams(servers, path, body, MAX_TOKENS)
        assert all(c["choices"][0]["logprobs"] is not None for c in token_chunks(reference))


def test_a_streamed_chat_returns_its_prompt_text_as_vllm_serve(servers: Servers) -> None:
    body = stream_body("messages", MESSAGES[1], return_prompt_text=True)
    reference = compare_streams(servers, "/v1/chat/completions", body, MAX_TOKENS)
    assert "<|im_start|>user" in reference[0]["prompt_text"]


def test_echo_with_logprobs_has_the_prompts_tokens_first(servers: Servers) -> None:
    """What an evaluation harness reads: the prompt's token logprobs, ``null`` first, then the
    generated token's (summing a continuation's logprobs reads these)."""
    body = {"model": MODEL, "prompt": TOKEN_PROMPTS[1], "echo": True, "logprobs": 1, "max_tokens": 1}
    (ours,), _ = post(servers.gateway_url, "/v1/completions", {**body, "temperature": 0})
    logprobs = ours["choices"][0]["logprobs"]
    assert len(logprobs["token_logprobs"]) == len(TOKEN_PROMPTS[1]) + 1
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    assert all(isinstance(lp, float) for lp in logprobs["token_logprobs"][1:])


def by_choice(chunks: list[Any]) -> dict[Any, Any]:
    """A stream read as a client does: per choice, its text, its logprobs' tokens and
    values, its token ids and its finish reason; and the usage. Order across choices and
    how tokens were grouped into chunks are timing (each server's engine merges outputs its
    consumer was late for), so they are left out."""
    seen: dict[Any, Any] = {}
    for chunk in chunks:
        if not chunk["choices"]:
            seen["usage"] = chunk["usage"]
        for choice in chunk["choices"]:
            entry = seen.setdefault(choice["index"], {"text": "", "tokens": [], "logprobs": [], "ids": []})
            entry["text"] += text_of(choice)
            if choice.get("logprobs"):
                entry["tokens"] += choice["logprobs"]["tokens"]
                entry["logprobs"] += choice["logprobs"]["token_logprobs"]
            entry["ids"] += choice.get("token_ids") or []
            entry["prompt_ids"] = entry.get("prompt_ids") or choice.get("prompt_token_ids")
            if choice.get("finish_reason"):
                entry["finish_reason"] = choice["finish_reason"]
    return seen


STREAMED_COMPLETIONS = [
    {"prompt": TOKEN_PROMPTS, "stream_options": {"include_usage": True}},
    {"prompt": PROMPTS, "n": 2, "temperature": 1.0, "seed": 5, "stream_options": {"include_usage": True}},
    {"prompt": TOKEN_PROMPTS, "echo": True, "logprobs": 1, "max_tokens": 1},
    {"prompt": PROMPTS[0], "echo": True, "logprobs": 2, "max_tokens": 0},
    {"prompt": PROMPTS[1], "echo": True, "logprobs": 1, "return_token_ids": True},
]


@pytest.mark.parametrize("extra", STREAMED_COMPLETIONS, ids=lambda body: ",".join(body))
def test_streamed_completions_in_every_form_read_the_same(servers: Servers, extra: dict[str, Any]) -> None:
    body = {"model": MODEL, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True, **extra}
    ours, _ = post(servers.gateway_url, "/v1/completions", body)
    reference, _ = post(servers.serve_url, "/v1/completions", body)
    assert by_choice(ours) == by_choice(reference)
    assert all(entry["text"] for key, entry in by_choice(reference).items() if key != "usage")


def test_streamed_chat_echo_opens_as_vllm_serve_does(servers: Servers) -> None:
    body = {"model": MODEL, "stream": True, "temperature": 0, "max_tokens": MAX_TOKENS, **WHOLE_CHATS[0]}
    ours, _ = post(servers.gateway_url, "/v1/chat/completions", body)
    reference, _ = post(servers.serve_url, "/v1/chat/completions", body)
    assert comparable(ours[:2]) == comparable(reference[:2])  # the role chunk (the last message's), then the echo
    assert by_choice(ours) == by_choice(reference)


# --- the tokenizer's routes --------------------------------------------------------------------
TOKENIZE_BODIES = [
    {"prompt": PROMPTS[0]},
    {"prompt": PROMPTS[1], "add_special_tokens": False},
    {"messages": MESSAGES[0]},
    {"messages": [*MESSAGES[0], {"role": "assistant", "content": "Hi"}], "add_generation_prompt": False},
]


@pytest.mark.parametrize("body", TOKENIZE_BODIES, ids=lambda body: ",".join(body))
def test_tokenize_answers_as_vllm_serve(servers: Servers, body: dict[str, Any]) -> None:
    ours = httpx.post(servers.gateway_url + "/tokenize", json={"model": MODEL, **body}, timeout=60)
    reference = httpx.post(servers.serve_url + "/tokenize", json={"model": MODEL, **body}, timeout=60)
    assert ours.status_code == reference.status_code == 200, ours.text
    assert ours.json() == reference.json()


def test_detokenize_and_tokenizer_info_answer_as_vllm_serve(servers: Servers) -> None:
    ours = httpx.post(
        servers.gateway_url + "/detokenize", json={"model": MODEL, "tokens": TOKEN_PROMPTS[1]}, timeout=60
    )
    reference = httpx.post(servers.serve_url + "/detokenize", json={"model": MODEL, "tokens": TOKEN_PROMPTS[1]})
    assert ours.json() == reference.json() and ours.json()["prompt"]
    info = httpx.get(servers.gateway_url + "/tokenizer_info", params={"model": MODEL}, timeout=10)
    assert info.status_code == 200, info.text
    assert info.json() == httpx.get(servers.serve_url + "/tokenizer_info", timeout=10).json()


# --- lm-evaluation-harness, sample by sample -----------------------------------------------------
LM_EVAL_TASKS = ("streamq_generate", "streamq_choice")


def lm_eval_samples(base_url: str, tokenizer: str, out: Path) -> dict[str, list[dict[str, Any]]]:
    """Run lm-eval's ``local-completions`` against ``base_url`` (its own process, as a team
    runs it) on the local tasks; each task's samples in document order."""
    model_args = ",".join(
        [
            f"model={MODEL}",
            f"base_url={base_url}/v1/completions",
            tokenizer,
            "num_concurrent=2",
            "max_retries=1",
            "timeout=120",
        ]
    )
    command = [sys.executable, "-m", "lm_eval", "--model", "local-completions", "--model_args", model_args]
    command += ["--tasks", ",".join(LM_EVAL_TASKS), "--include_path", "tests/support/lm_eval"]
    command += ["--batch_size", "4"]  # several prompts in one request, as harness runs send them
    command += ["--output_path", str(out), "--log_samples", "--seed", "1234"]
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "HF_HOME": str(out / "hf")}
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    samples: dict[str, list[dict[str, Any]]] = {}
    for task in LM_EVAL_TASKS:
        (path,) = out.rglob(f"samples_{task}_*.jsonl")
        rows = [json.loads(line) for line in path.read_text().splitlines() if line]
        samples[task] = sorted(rows, key=lambda row: row["doc_id"])
    return samples


def assert_same_responses(ours: list[dict[str, Any]], reference: list[dict[str, Any]]) -> None:
    """Each document's responses equal: texts exactly, loglikelihoods within 1e-3 and
    whether the continuation is greedy."""
    assert [row["doc_id"] for row in ours] == [row["doc_id"] for row in reference]
    for mine, theirs in zip(ours, reference, strict=True):
        for got, expected in zip(mine["resps"], theirs["resps"], strict=True):
            (got,), (expected,) = got, expected
            if isinstance(expected, str):
                assert got == expected, (mine["doc_id"], got, expected)
            else:
                (ll, greedy), (ll_ref, greedy_ref) = got, expected
                assert float(ll) == pytest.approx(float(ll_ref), abs=1e-3), (mine["doc_id"], ll, ll_ref)
                assert str(greedy) == str(greedy_ref), mine["doc_id"]


def test_lm_eval_gives_the_same_samples_through_the_gateway(servers: Servers, tmp_path: Path) -> None:
    tokenizer = f"tokenizer={servers.tiny_model},tokenizer_backend=huggingface"
    reference = lm_eval_samples(servers.serve_url, tokenizer, tmp_path / "vllm-serve")
    ours = lm_eval_samples(servers.gateway_url, tokenizer, tmp_path / "gateway")
    # The remote tokenizer names no model: a gateway of several models is told which one answers.
    gateway = GatewayProcess(
        servers.gateway_redis_url, tmp_path / "gateway.log", "--tokenizer-model", MODEL
    ).wait_ready()
    try:
        remote = lm_eval_samples(gateway.url, "tokenizer_backend=remote", tmp_path / "gateway-remote")
    finally:
        assert gateway.stop() == 0, gateway.log_tail()
    for task in LM_EVAL_TASKS:
        assert len(reference[task]) >= 12
        assert_same_responses(ours[task], reference[task])
        assert_same_responses(remote[task], reference[task])
    loglikelihoods = [float(r[0][0]) for row in ours["streamq_choice"] for r in row["resps"]]
    assert len(set(loglikelihoods)) > 1 and all(ll < 0 for ll in loglikelihoods)  # real scores, not a constant


FUZZ_CASES = 100
"""Bodies drawn per endpoint: the same each run (``tests/support/schema_fuzz.py``)."""


def refused_for_the_queue(answers: Answers, body: Any, chat: bool) -> bool:
    """A 400 of the gateway naming a field its table refuses (a reason of the queue's:
    beam search, disaggregation, tensors, ...), sent with a value other than its default;
    or a ``request_id`` that cannot name a streamq request (docs/gateway.md: it names the
    request's Redis keys, URL and headers, where ``vllm serve`` takes any string)."""
    if answers.gateway_status != 400:
        return False
    param = json.loads(answers.gateway_text)["error"].get("param")
    if param == "request_id":
        request_id = body.get("request_id") if isinstance(body, dict) else None
        return not (isinstance(request_id, str) and is_valid_request_id(request_id))
    field = {**ENDPOINT_FIELDS[chat], **LEGACY_FIELDS}.get(param or "")
    return field is not None and field.support is Support.REFUSED


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_bodies_drawn_from_vllm_serves_schema_are_answered_as_it_answers_them(servers: Servers, path: str) -> None:
    """What a fuzzer driven by ``vllm serve``'s OpenAPI schema finds: the gateway never
    answers with a 5xx; it gives a completion wherever ``vllm serve`` gives one, unless it
    refuses a field its table refuses for a reason of the queue's; and it refuses what
    ``vllm serve`` refuses."""
    schema = httpx.get(servers.serve_url + "/openapi.json", timeout=30).json()
    chat = path.endswith("chat/completions")
    differences = []
    for drawn in drawn_bodies(schema, path, FUZZ_CASES):
        body = bounded(drawn, MODEL)
        answers = answered(servers.serve_url, servers.gateway_url, path, body)
        serve_ok, gateway_ok = answers.serve_status == 200, answers.gateway_status == 200
        refused_alone = serve_ok and not gateway_ok and not refused_for_the_queue(answers, body, chat)
        answered_alone = gateway_ok and 400 <= answers.serve_status < 500
        if answers.gateway_status >= 500 or refused_alone or answered_alone:
            differences.append(answers.describe())
    assert not differences, "\n".join(differences)


RESPONSES_BODIES = [
    {"input": PROMPTS[0]},
    {"input": PROMPTS[1], "instructions": "Answer in French."},
    {"input": [{"role": "user", "content": [{"type": "input_text", "text": "Hello"}]}, *MESSAGES[1]]},
    {"input": MESSAGES[0], "top_p": 0.5, "extra_body": {"stop": ["the"], "top_k": 3}},
]


@pytest.mark.parametrize("extra", RESPONSES_BODIES, ids=lambda body: ",".join(body))
def test_responses_create_gives_vllm_serves_text(servers: Servers, extra: dict[str, Any]) -> None:
    """The Responses API's whole answer: the same text, status and token counts (its items'
    ids are random on ``vllm serve``)."""
    body = {"model": MODEL, "max_output_tokens": MAX_TOKENS, "temperature": 0, "store": False, **extra}
    answers = []
    for url in (servers.gateway_url, servers.serve_url):
        with openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120) as sdk:
            answers.append(sdk.responses.create(**body))
    ours, reference = answers
    assert ours.output_text == reference.output_text
    assert [item.type for item in ours.output] == [item.type for item in reference.output]
    assert ours.status == reference.status
    assert ours.usage is not None and reference.usage is not None
    assert (ours.usage.input_tokens, ours.usage.output_tokens) == (
        reference.usage.input_tokens,
        reference.usage.output_tokens,
    )
