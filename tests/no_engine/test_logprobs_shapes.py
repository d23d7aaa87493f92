"""Logprobs on the wire and in OpenAI's shapes.

The engine's logprobs become compact ``TokenLogprob`` arrays in chunk events (absent when
not asked for, so other requests' chunks are byte for byte what they were); merged chunks
keep them in token order; and the gateway rebuilds from them what ``vllm serve`` returns,
which is checked here against vLLM's own builders fed the engine's dicts.
"""

from __future__ import annotations

import json
import math
import uuid
import warnings
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

import msgspec
import pytest
import redis.asyncio as aioredis

from producer.client import Completion
from producer.openai_api.chunks import ChunkBuilder
from producer.openai_api.logprobs import chat_logprobs, completion_logprobs, prompt_logprobs, vllm_order
from producer.openai_api.responses import ResponseMeta, chat_completion_response, completion_response
from streamq.broker.replay_log import ReplayLog
from streamq.protocol import (
    LOGPROB_FLOOR,
    ChunkEvent,
    TokenLogprob,
    TopLogprob,
    decode_event,
    encode_event,
)
from tests.support.gated_log import GatedLog
from worker.publisher import EventPublisher
from worker.request_events import RequestEvents

with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)  # torch's own, raised while vLLM imports
    from vllm import logprobs as vllm_logprobs
    from vllm.entrypoints.openai.chat_completion import protocol as chat_protocol
    from vllm.entrypoints.openai.chat_completion.serving import OpenAIServingChat
    from vllm.entrypoints.openai.completion import protocol as completion_protocol
    from vllm.entrypoints.openai.completion.serving import OpenAIServingCompletion

    from worker import logprobs as worker_logprobs
    from worker.prompt_report import PromptReport

TOKENS = {1: "a", 2: " b", 3: "\ufffd", 4: "c", 5: "a", 6: "é"}


def decode(token_id: int) -> str:
    return TOKENS[token_id]


def engine_position(sampled: int, sampled_logprob: float, sampled_rank: int, top: list[tuple[int, float]]) -> Any:
    """One position as vLLM's engine stores it: its own function fed the sampler's row
    (the sampled token, then the top-k in rank order)."""
    positions: list[Any] = []
    ids = [sampled, *(t for t, _ in top)]
    logprobs = [sampled_logprob, *(lp for _, lp in top)]
    vllm_logprobs.append_logprobs_for_next_position(
        positions, ids, logprobs, [TOKENS[i] for i in ids], sampled_rank, len(top)
    )
    return positions[0]


# The sampled token first of the top-k; outside it; second in it; a top-k with two tokens
# of the same text (1 and 5 both read "a"); a -inf logprob.
SAMPLED: list[tuple[int, float, int, list[tuple[int, float]]]] = [
    (2, -0.5, 1, [(2, -0.5), (1, -1.25), (4, -3.0)]),
    (3, -4.0, 7, [(2, -0.25), (1, -1.5), (4, -2.0)]),
    (4, -1.0, 2, [(1, -0.75), (4, -1.0), (5, -2.5)]),
    (6, -math.inf, 9, [(1, -0.1), (5, -0.2), (2, -0.3)]),
]
TOKEN_IDS = [token_id for token_id, *_ in SAMPLED]


def positions(top_k: int = 3) -> list[Any]:
    """The engine's logprobs of ``TOKEN_IDS`` for ``logprobs=top_k``."""
    return [engine_position(t, lp, rank, top[:top_k]) for t, lp, rank, top in SAMPLED]


def entries(top_k: int = 3) -> list[TokenLogprob]:
    """What the worker sends for them."""
    return worker_logprobs.sample_logprobs(TOKEN_IDS, positions(top_k), top_k, decode)


# --- the worker's conversion -----------------------------------------------------------
def test_each_token_gets_its_logprob_rank_text_and_the_top_k_in_rank_order() -> None:
    first, second, third, fourth = entries()
    assert first == TokenLogprob(
        -0.5, 1, " b", [TopLogprob(2, " b", -0.5), TopLogprob(1, "a", -1.25), TopLogprob(4, "c", -3.0)]
    )
    assert second.rank == 7 and [t.token_id for t in second.top] == [2, 1, 4]  # sampled outside the top-k
    assert [t.token_id for t in third.top] == [1, 4, 5] and third.rank == 2  # sampled second: kept in its place
    assert fourth.logprob == LOGPROB_FLOOR and fourth.token == "é"  # -inf is sent as OpenAI's floor


def test_a_nan_from_a_broken_model_still_makes_an_event_that_decodes() -> None:
    (entry,) = worker_logprobs.sample_logprobs([2], [engine_position(2, math.nan, 1, [])], 0, decode)
    event = chunk(0, [2], [entry])
    assert entry.logprob == LOGPROB_FLOOR and decode_event(encode_event(event)) == event


def test_logprobs_zero_gives_the_sampled_tokens_alone() -> None:
    position = engine_position(2, -0.5, 3, [])
    (only,) = worker_logprobs.sample_logprobs([2], [position], 0, decode)
    assert only == TokenLogprob(-0.5, 3, " b", [])


def test_positions_for_tokens_dropped_from_a_delta_are_skipped() -> None:
    # A regeneration drops the tokens already sent from the front of its first delta ...
    tail = worker_logprobs.sample_logprobs(TOKEN_IDS[2:], positions(), 3, decode)
    assert [e.token for e in tail] == ["c", "é"]
    # ... a stop string the tokens after it, from the back.
    head = worker_logprobs.sample_logprobs(TOKEN_IDS[:1], positions(), 3, decode)
    assert [e.token for e in head] == [" b"]


def test_tokens_the_engine_did_not_decode_are_decoded_by_the_worker() -> None:
    position = {2: vllm_logprobs.Logprob(-0.5, 1, None), 1: vllm_logprobs.Logprob(-1.0, 2, None)}
    (only,) = worker_logprobs.sample_logprobs([2], [position], 2, decode)
    assert (only.token, [t.token for t in only.top]) == (" b", [" b", "a"])


def test_prompt_logprobs_have_none_for_the_first_token() -> None:
    prompt = worker_logprobs.prompt_logprobs([1, 2], [None, positions()[0]], 3, decode)
    assert prompt[0] is None and prompt[1] == entries()[0]


# --- the wire ------------------------------------------------------------------------------
def chunk(seq: int, token_ids: list[int], logprobs: list[TokenLogprob] | None = None, **more: Any) -> ChunkEvent:
    event = ChunkEvent(
        request_id="r1", seq=seq, text="".join(TOKENS[t] for t in token_ids), token_ids=token_ids, **more
    )
    if logprobs is not None:
        event.logprobs = logprobs
    return event


def test_a_chunk_without_logprobs_is_encoded_as_before() -> None:
    raw = encode_event(chunk(0, [2]))
    before = b'{"type":"chunk","v":1,"request_id":"r1","seq":0,"attempt":1,"index":0,'
    assert raw == before + b'"text":" b","token_ids":[2],"finish_reason":null}'


def test_logprobs_are_compact_arrays_and_decode_back() -> None:
    event = chunk(0, [2], entries()[:1])
    raw = json.loads(encode_event(event))
    assert raw["logprobs"] == [[-0.5, 1, " b", [[2, " b", -0.5], [1, "a", -1.25], [4, "c", -3.0]]]]
    assert "prompt_logprobs" not in raw
    assert decode_event(encode_event(event)) == event


@pytest.fixture
async def redis(redis_url: str) -> AsyncIterator[aioredis.Redis]:
    client = aioredis.Redis.from_url(redis_url)
    yield client
    await client.aclose()


async def test_merged_chunks_keep_their_logprobs_in_token_order(redis: aioredis.Redis) -> None:
    request_id = f"lp-{uuid.uuid4().hex}"
    log = GatedLog(redis)
    publisher = EventPublisher(log)
    publisher.start()
    events = RequestEvents(publisher, request_id)
    lps = entries()
    events.chunk(0, " b", [2], None, lps[:1], PromptReport([1, 2], [None, lps[0]]))
    await log.in_flight()
    for i in range(1, 4):  # these wait behind the batch in flight: merged into one chunk
        events.chunk(0, TOKENS[TOKEN_IDS[i]], [TOKEN_IDS[i]], "length" if i == 3 else None, lps[i : i + 1])
    events.final(["length"], prompt_tokens=2, completion_tokens=4)
    log.gate.set()
    await events.delivered()
    await publisher.close()
    logged = [decode_event(raw) for raw in await ReplayLog(redis).read(request_id)]
    chunks = [e for e in logged if isinstance(e, ChunkEvent)]
    assert [len(c.token_ids) for c in chunks] == [1, 3]
    assert [e for c in chunks for e in c.logprobs or []] == lps
    assert chunks[0].prompt_logprobs == [None, lps[0]] and chunks[0].prompt_token_ids == [1, 2]
    assert chunks[1].prompt_logprobs is msgspec.UNSET


# --- OpenAI's shapes, against vLLM's own builders ------------------------------------------------
def vllm_serving(serving: Any) -> Any:
    """vLLM's serving class, its logprobs methods callable without a server."""
    stub = SimpleNamespace(return_tokens_as_token_ids=False)
    stub._get_decoded_token = serving._get_decoded_token  # a static method
    stub._get_top_logprobs = lambda *a, **k: serving._get_top_logprobs(stub, *a, **k)
    return serving, stub


@pytest.mark.parametrize("top_k", [0, 1, 2, 3])
def test_completion_logprobs_are_vllms(top_k: int) -> None:
    serving, stub = vllm_serving(OpenAIServingCompletion)
    expected = serving._create_completion_logprobs(
        stub, TOKEN_IDS, positions(top_k), top_k, None, initial_text_offset=5
    )
    ours = completion_logprobs(TOKEN_IDS, entries(top_k), 5)
    assert msgspec.to_builtins(ours) == expected.model_dump()


@pytest.mark.parametrize("top_k", [0, 1, 2, 3])
def test_chat_logprobs_are_vllms(top_k: int) -> None:
    serving, stub = vllm_serving(OpenAIServingChat)
    expected = serving._create_chat_logprobs(stub, TOKEN_IDS, positions(top_k), None, top_k)
    ours = chat_logprobs(TOKEN_IDS, entries(top_k))
    assert msgspec.to_builtins(ours) == expected.model_dump()


@pytest.mark.parametrize("top_k", [0, 1, 2, 3])
def test_vllm_order_puts_the_token_first_then_the_top_k_without_it(top_k: int) -> None:
    for token_id, position, entry in zip(TOKEN_IDS, positions(top_k), entries(top_k), strict=True):
        assert [t.token_id for t in vllm_order(entry, token_id)] == list(position)


def test_prompt_logprobs_are_vllms_json() -> None:
    position = positions()[1]
    ours = prompt_logprobs([1, 3], [None, entries()[1]])
    (expected,) = [
        {str(k): {"logprob": v.logprob, "rank": v.rank, "decoded_token": v.decoded_token} for k, v in position.items()}
    ]
    assert ours == [None, expected]
    assert list(ours[1] or {}) == ["3", "2", "1", "4"]


# --- streamed and whole ------------------------------------------------------------------
def test_streamed_completion_chunks_carry_logprobs_with_running_text_offsets() -> None:
    lps = entries()
    builder = ChunkBuilder(ResponseMeta(False, "r1", "tiny", 1700), include_usage=False)
    first = json.loads(builder.chunks(chunk(0, TOKEN_IDS[:2], lps[:2]))[0])["choices"][0]["logprobs"]
    second = json.loads(builder.chunks(chunk(1, TOKEN_IDS[2:], lps[2:]))[0])["choices"][0]["logprobs"]
    assert first["text_offset"] == [0, 2] and second["text_offset"] == [3, 4]  # " b" is 2 characters, "\ufffd" 1
    assert first["tokens"] == [" b", "\ufffd"] and first["token_logprobs"] == [-0.5, -4.0]
    assert list(first["top_logprobs"][1]) == ["\ufffd", " b", "a", "c"]  # the sampled token, then the top-3
    plain = json.loads(builder.chunks(chunk(2, [1]))[0])["choices"][0]
    assert plain["logprobs"] is None


def test_streamed_chat_chunks_carry_logprobs_with_bytes() -> None:
    builder = ChunkBuilder(ResponseMeta(True, "r1", "tiny", 1700), include_usage=False, role_sent=True)
    (raw,) = builder.chunks(chunk(0, [6], entries()[3:]))
    (content,) = json.loads(raw)["choices"][0]["logprobs"]["content"]
    assert content["token"] == "é" and content["bytes"] == [195, 169] and content["logprob"] == LOGPROB_FLOOR
    assert [t["token"] for t in content["top_logprobs"]] == ["é", "a", "a"]


def completion(logprobs: bool) -> Completion:
    return Completion(
        request_id="r1",
        texts=["".join(TOKENS[t] for t in TOKEN_IDS)],
        token_ids=[TOKEN_IDS],
        finish_reasons=["length"],
        prompt_tokens=2,
        completion_tokens=4,
        logprobs=[entries()] if logprobs else None,
        prompt_logprobs=[None, entries()[0]] if logprobs else None,
        prompt_token_ids=[1, 2] if logprobs else None,
    )


def test_whole_responses_put_logprobs_where_vllm_does() -> None:
    body = completion_response([completion(True)], model="tiny", created=1)
    (choice,) = body["choices"]
    assert choice["logprobs"]["tokens"] == [" b", "\ufffd", "c", "é"]
    assert choice["prompt_logprobs"][0] is None and list(choice["prompt_logprobs"][1]) == ["2", "1", "4"]
    chat = chat_completion_response([completion(True)], model="tiny", created=1)
    assert [c["token"] for c in chat["choices"][0]["logprobs"]["content"]] == [" b", "\ufffd", "c", "é"]
    assert chat["prompt_logprobs"] == choice["prompt_logprobs"]  # chat has them on the response, not the choice
    plain = completion_response([completion(False)], model="tiny", created=1)
    assert plain["choices"][0]["logprobs"] is None and plain["choices"][0]["prompt_logprobs"] is None


def test_whole_responses_parse_as_vllms() -> None:
    completion_protocol.CompletionResponse.model_validate(
        completion_response([completion(True)], model="tiny", created=1)
    )
    chat_protocol.ChatCompletionResponse.model_validate(
        chat_completion_response([completion(True)], model="tiny", created=1)
    )


# --- logprob_token_ids: the logprobs of chosen tokens, against vLLM's own builders -------------
CHOSEN = [1, 5]


def chosen_positions() -> list[Any]:
    """The engine's logprobs of ``TOKEN_IDS`` for ``logprob_token_ids=CHOSEN``: the sampled
    token first, then the chosen ones (a dict: the sampled one once)."""
    out = []
    for token_id, logprob, rank, top in SAMPLED:
        given = dict(top)
        position = {token_id: vllm_logprobs.Logprob(logprob, rank, TOKENS[token_id])}
        for i, chosen in enumerate(CHOSEN):
            position.setdefault(chosen, vllm_logprobs.Logprob(given.get(chosen, -5.0 - i), None, TOKENS[chosen]))
        out.append(position)
    return out


def test_chosen_tokens_logprobs_are_vllms() -> None:
    ours = worker_logprobs.sample_logprobs(TOKEN_IDS, chosen_positions(), 0, decode)
    chat, chat_stub = vllm_serving(OpenAIServingChat)
    expected = chat._create_chat_logprobs(chat_stub, TOKEN_IDS, chosen_positions(), None, None, CHOSEN)
    assert msgspec.to_builtins(chat_logprobs(TOKEN_IDS, ours, every=True)) == expected.model_dump()
    completion, completion_stub = vllm_serving(OpenAIServingCompletion)
    expected_completion = completion._create_completion_logprobs(
        completion_stub, TOKEN_IDS, chosen_positions(), 0, None, CHOSEN
    )
    assert msgspec.to_builtins(completion_logprobs(TOKEN_IDS, ours)) == expected_completion.model_dump()
