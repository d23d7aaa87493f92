"""A request's events become the chunks of OpenAI's streamed response, chunk for chunk as
`vllm serve` streams them (tests/real_engine/test_gateway_matches_vllm_serve.py compares with a real one)."""

from __future__ import annotations

import json
import warnings
from typing import Any

import pytest

from producer.openai_api.chunks import ChunkBuilder
from producer.openai_api.requests import ResponseShape
from producer.openai_api.responses import SYSTEM_FINGERPRINT, ResponseMeta
from streamq.protocol import ChunkEvent, ErrorEvent, Event, FinalEvent, ParsedOutput, PromptEcho, TokenLogprob

with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)  # torch's own, raised while vLLM imports
    from vllm.entrypoints.openai.chat_completion import protocol as chat_protocol
    from vllm.entrypoints.openai.completion import protocol as completion_protocol


def chunk(
    seq: int, text: str, *, index: int = 0, finish_reason: str | None = None, token_ids: list[int] | None = None
) -> ChunkEvent:
    ids = [seq] if token_ids is None else token_ids
    return ChunkEvent(request_id="r1", seq=seq, index=index, text=text, token_ids=ids, finish_reason=finish_reason)


def final(seq: int, reasons: list[str | None], prompt_tokens: int = 3, completion_tokens: int = 2) -> FinalEvent:
    return FinalEvent(
        request_id="r1",
        seq=seq,
        finish_reasons=reasons,
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
    )


def build(
    chat: bool, events: list[Event], *, include_usage: bool = False, n: int = 1, role_sent: bool = False
) -> list[dict[str, Any]]:
    builder = ChunkBuilder(ResponseMeta(chat, "r1", "tiny", 1700), include_usage, n=n, role_sent=role_sent)
    return [json.loads(c) for event in events for c in builder.chunks(event)]


def test_completion_chunks_carry_text_then_the_finish_reason_in_vllms_keys() -> None:
    chunks = build(False, [chunk(0, "Hel"), chunk(1, "lo", finish_reason="length"), final(2, ["length"])])
    assert [c["choices"] for c in chunks] == [
        [
            {
                "index": 0,
                "text": "Hel",
                "logprobs": None,
                "finish_reason": None,
                "stop_reason": None,
                "prompt_token_ids": None,
                "token_ids": None,
            }
        ],
        [
            {
                "index": 0,
                "text": "lo",
                "logprobs": None,
                "finish_reason": "length",
                "stop_reason": None,
                "prompt_token_ids": None,
                "token_ids": None,
            }
        ],
    ]
    for c in chunks:
        assert (c["id"], c["object"], c["created"], c["model"]) == ("cmpl-r1", "text_completion", 1700, "tiny")
    assert [list(c) for c in chunks] == [
        ["id", "object", "created", "model", "choices"],
        ["id", "object", "created", "model", "choices", "system_fingerprint"],
    ]
    assert chunks[1]["system_fingerprint"] == SYSTEM_FINGERPRINT


@pytest.mark.parametrize("chat", [False, True])
def test_tokens_that_end_inside_a_character_still_make_a_chunk_with_empty_text(chat: bool) -> None:
    chunks = build(chat, [chunk(0, "a"), chunk(1, ""), chunk(2, "é", finish_reason="stop"), final(3, ["stop"])])
    texts = [c["choices"][0]["delta"]["content"] if chat else c["choices"][0]["text"] for c in chunks]
    assert texts == (["", "a", "", "é"] if chat else ["a", "", "é"])


@pytest.mark.parametrize("chat", [False, True])
def test_an_output_with_neither_text_nor_tokens_before_the_first_token_makes_no_chunk(chat: bool) -> None:
    prefill = chunk(0, "", token_ids=[])
    after = chunk(2, "", token_ids=[], finish_reason="stop")
    chunks = build(chat, [prefill, chunk(1, "a"), after, final(3, ["stop"])])
    assert [c["choices"][0]["finish_reason"] for c in chunks] == ([None, None, "stop"] if chat else [None, "stop"])


def test_a_chat_stream_opens_with_the_role_of_each_choice_then_deltas_of_content() -> None:
    events: list[Event] = [chunk(0, "a"), chunk(1, "b", index=1), chunk(2, "c", index=0, finish_reason="stop")]
    chunks = build(True, [*events, final(3, ["stop", "length"])], n=2)
    assert [c["choices"][0] for c in chunks] == [
        {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None},
        {"index": 1, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None},
        {"index": 0, "delta": {"content": "a"}, "logprobs": None, "finish_reason": None, "token_ids": None},
        {"index": 1, "delta": {"content": "b"}, "logprobs": None, "finish_reason": None, "token_ids": None},
        {
            "index": 0,
            "delta": {"content": "c"},
            "logprobs": None,
            "finish_reason": "stop",
            "stop_reason": None,
            "token_ids": None,
        },
        {
            "index": 1,
            "delta": {"content": ""},
            "logprobs": None,
            "finish_reason": "length",
            "stop_reason": None,
            "token_ids": None,
        },
    ]
    assert [c.get("prompt_token_ids", "absent") for c in chunks] == [None, None] + ["absent"] * 4
    assert [c.get("prompt_text", "absent") for c in chunks] == [None, None] + ["absent"] * 4
    assert [c.get("system_fingerprint") for c in chunks] == [None] * 4 + [SYSTEM_FINGERPRINT] * 2
    for c in chunks:
        assert (c["id"], c["object"]) == ("chatcmpl-r1", "chat.completion.chunk")


def test_a_chat_stream_resumed_past_its_first_event_does_not_name_the_role_again() -> None:
    chunks = build(True, [chunk(4, "d"), final(5, ["length"])], role_sent=True)
    assert [c["choices"][0]["delta"] for c in chunks] == [{"content": "d"}, {"content": ""}]


def test_a_chat_stream_that_ends_before_any_token_still_names_the_role_first() -> None:
    chunks = build(True, [final(0, ["abort"], completion_tokens=0)])
    assert [(c["choices"][0]["delta"], c["choices"][0]["finish_reason"]) for c in chunks] == [
        ({"role": "assistant", "content": ""}, None),
        ({"content": ""}, "abort"),
    ]


def test_a_choice_that_ended_without_a_last_chunk_gets_its_finish_reason_from_the_final_event() -> None:
    events: list[Event] = [chunk(0, "a", finish_reason="stop"), chunk(1, "b", index=1), final(2, ["stop", "abort"])]
    tail = build(False, events, n=2)[2:]
    assert [(c["choices"][0]["index"], c["choices"][0]["text"], c["choices"][0]["finish_reason"]) for c in tail] == [
        (1, "", "abort")
    ]


@pytest.mark.parametrize("chat", [False, True])
def test_usage_comes_in_a_last_chunk_without_choices_only_when_asked(chat: bool) -> None:
    events: list[Event] = [
        chunk(0, "a", finish_reason="stop"),
        final(1, ["stop"], prompt_tokens=5, completion_tokens=1),
    ]
    assert all("usage" not in c for c in build(chat, events))
    chunks = build(chat, events, include_usage=True)
    last = chunks[-1]
    assert list(last) == ["id", "object", "created", "model", "choices", "usage", "system_fingerprint"]
    assert last["choices"] == []
    assert last["object"] == ("chat.completion.chunk" if chat else "text_completion")
    assert list(last["usage"].items()) == [("prompt_tokens", 5), ("total_tokens", 6), ("completion_tokens", 1)]
    assert all("system_fingerprint" not in c for c in chunks[:-1])  # the usage chunk is the last


def test_an_error_event_becomes_an_openai_error_body() -> None:
    error = ErrorEvent(request_id="r1", seq=4, code="timeout", message="ran past 60 s")
    assert build(True, [chunk(0, "a"), error])[-1] == {
        "error": {"message": "timeout: ran past 60 s", "type": "internal_error", "param": None, "code": "timeout"}
    }


def test_text_is_json_escaped() -> None:
    (only,) = build(False, [chunk(0, 'say "hi"\n\x08 é')])
    assert only["choices"][0]["text"] == 'say "hi"\n\x08 é'


def test_completion_chunks_parse_as_vllm_serves_stream_response() -> None:
    events: list[Event] = [chunk(0, "a"), chunk(1, ""), chunk(2, "b", finish_reason="stop"), final(3, ["stop"])]
    for c in build(False, events, include_usage=True):
        completion_protocol.CompletionStreamResponse.model_validate(c)


def test_chat_chunks_parse_as_vllm_serves_stream_response() -> None:
    events: list[Event] = [chunk(0, "a"), chunk(1, "b"), final(2, ["length"])]
    parsed = [
        chat_protocol.ChatCompletionStreamResponse.model_validate(c) for c in build(True, events, include_usage=True)
    ]
    assert [p.choices[0].delta.role for p in parsed[:3]] == ["assistant", None, None]
    assert parsed[3].choices[0].finish_reason == "length"
    assert parsed[4].usage.total_tokens == 5


# --- several prompts, echo -------------------------------------------------------------------
def test_several_prompts_number_their_choices_on_and_end_with_one_summed_usage() -> None:
    builder = ChunkBuilder(ResponseMeta(False, "r1", "tiny", 1700), include_usage=True, n=2, prompts=2)
    events: list[tuple[Event, int]] = [
        (chunk(0, "a", index=1), 1),
        (chunk(0, "b", index=0), 0),
        (final(1, ["length", "length"], prompt_tokens=3, completion_tokens=4), 1),
    ]
    chunks = [json.loads(c) for event, prompt in events for c in builder.chunks(event, prompt)]
    assert [c["choices"][0]["index"] for c in chunks] == [3, 0, 2, 3]  # prompt 1's completions are choices 2 and 3
    assert not builder.done  # prompt 0 has not ended
    last = [json.loads(c) for c in builder.chunks(final(2, ["stop", "stop"], prompt_tokens=5, completion_tokens=6), 0)]
    assert builder.done
    assert last[-1]["usage"] == {"prompt_tokens": 8, "total_tokens": 18, "completion_tokens": 10}


def echoed_first_chunk(**fields: Any) -> ChunkEvent:
    event = chunk(0, " there", token_ids=[7])
    event.prompt_token_ids = [4, 5]
    event.prompt_echo = PromptEcho(text="Hi", first_token="H")
    for name, value in fields.items():
        setattr(event, name, value)
    return event


def test_echo_puts_the_prompt_before_each_completions_first_chunk() -> None:
    builder = ChunkBuilder(ResponseMeta(False, "r1", "tiny", 1700), False, n=1, shape=ResponseShape(echo=True))
    (first,) = [json.loads(c) for c in builder.chunks(echoed_first_chunk())]
    (second,) = [json.loads(c) for c in builder.chunks(chunk(1, "!"))]
    assert first["choices"][0]["text"] == "Hi there" and first["choices"][0]["prompt_token_ids"] == [4, 5]
    assert second["choices"][0]["text"] == "!" and second["choices"][0]["prompt_token_ids"] is None


def test_echo_with_logprobs_lists_the_prompts_tokens_null_first() -> None:
    prompt_lp = [None, TokenLogprob(-1.5, 3, "i", [])]
    sampled = [TokenLogprob(-0.5, 1, " there", [])]
    event = echoed_first_chunk(prompt_logprobs=prompt_lp, logprobs=sampled)
    builder = ChunkBuilder(ResponseMeta(False, "r1", "tiny", 1700), False, shape=ResponseShape(echo=True, logprobs=0))
    (first,) = [json.loads(c) for c in builder.chunks(event)]
    logprobs = first["choices"][0]["logprobs"]
    assert logprobs["tokens"] == ["H", "i", " there"] and logprobs["text_offset"] == [0, 1, 2]
    assert logprobs["token_logprobs"] == [None, -1.5, -0.5] and logprobs["top_logprobs"][0] is None


def test_echo_of_max_tokens_0_is_the_prompt_alone() -> None:
    shape = ResponseShape(echo=True, echo_only=True)
    builder = ChunkBuilder(ResponseMeta(False, "r1", "tiny", 1700), False, shape=shape)
    (first,) = [json.loads(c) for c in builder.chunks(echoed_first_chunk(finish_reason="length"))]
    assert first["choices"][0]["text"] == "Hi" and first["choices"][0]["finish_reason"] == "length"


def test_a_chat_echo_follows_the_role_chunks_with_the_last_message() -> None:
    shape = ResponseShape(role="assistant", echo_text="The key")
    chunks = build_with(True, [chunk(0, " is")], shape=shape, n=2)
    assert [c["choices"][0]["delta"] for c in chunks[:4]] == [
        {"role": "assistant", "content": ""},
        {"role": "assistant", "content": ""},
        {"content": "The key"},
        {"content": "The key"},
    ]


def build_with(chat: bool, events: list[Event], *, shape: ResponseShape, n: int = 1) -> list[dict[str, Any]]:
    builder = ChunkBuilder(ResponseMeta(chat, "r1", "tiny", 1700), False, n=n, shape=shape)
    return [json.loads(c) for event in events for c in builder.chunks(event)]


def parsed_chunk(
    seq: int,
    text: str,
    message: dict[str, Any] | None,
    *,
    finish_reason: str | None = None,
    parsed_finish: str | None = None,
    reasoning_tokens: int | None = None,
) -> ChunkEvent:
    """A chunk event as a worker with a tool parser sends it: ``message`` what it made of ``text``."""
    event = chunk(seq, text, finish_reason=finish_reason)
    event.parsed = ParsedOutput(message=message, finish_reason=parsed_finish, reasoning_tokens=reasoning_tokens)
    return event


def test_a_parsed_chat_stream_sends_the_parsers_deltas_and_holds_back_what_they_hold() -> None:
    """A worker's tool parser made the deltas: they go out as vLLM wrote them; a chunk it
    held back (markup) sends nothing, unless it ends the completion; a call's end is
    ``tool_calls``, and the reasoning tokens it counted come in the usage."""
    call = {"index": 0, "id": "call-1", "type": "function", "function": {"name": "f", "arguments": ""}}
    events: list[Event] = [
        parsed_chunk(0, "Hi", {"content": "Hi"}),
        parsed_chunk(1, "<tool_call>", None),
        parsed_chunk(2, '{"name": "f"', {"tool_calls": [call]}),
        parsed_chunk(3, "}", None, finish_reason="stop", parsed_finish="tool_calls", reasoning_tokens=4),
        final(4, ["stop"], completion_tokens=4),
    ]
    chunks = build(True, events, include_usage=True)
    choices = [c["choices"][0] for c in chunks if c["choices"]][1:]  # after the role's
    assert [choice["delta"] for choice in choices] == [{"content": "Hi"}, {"tool_calls": [call]}, {}]
    assert [choice["finish_reason"] for choice in choices] == [None, None, "tool_calls"]
    assert chunks[-1]["usage"]["completion_tokens_details"] == {"reasoning_tokens": 4}


def test_a_chat_stream_with_return_token_ids_names_the_prompts_ids_then_each_chunks() -> None:
    """As ``vllm serve``: the prompt's token ids beside the role, each chunk's own token ids
    (its last one's too), and with a parser, a chunk for every output, even one it held back."""
    builder = ChunkBuilder(ResponseMeta(True, "r1", "tiny", 1700), False, shape=ResponseShape(token_ids=True))
    events: list[Event] = [
        echoed_first_chunk(),
        parsed_chunk(1, "<tool_call>", None),
        parsed_chunk(2, "!", {"content": "!"}, finish_reason="length"),
    ]
    chunks = [json.loads(c) for event in events for c in builder.chunks(event)]
    assert chunks[0]["prompt_token_ids"] == [4, 5] and "token_ids" not in chunks[0]["choices"][0]
    assert [c["choices"][0]["token_ids"] for c in chunks[1:]] == [[7], [1], [2]]
    assert [c["choices"][0]["delta"] for c in chunks[2:]] == [{}, {"content": "!"}]
    for c in chunks:
        chat_protocol.ChatCompletionStreamResponse.model_validate(c)


# --- stream_options.continuous_usage_stats --------------------------------------------------
CONTINUOUS = ResponseShape(continuous_usage=True)


def continuous(chat: bool, events: list[Event], n: int = 1) -> list[dict[str, Any]]:
    builder = ChunkBuilder(ResponseMeta(chat, "r1", "tiny", 1700), True, n=n, shape=CONTINUOUS)
    return [json.loads(c) for event in events for c in builder.chunks(event)]


def with_prompt(event: ChunkEvent, prompt_token_ids: list[int]) -> ChunkEvent:
    event.prompt_token_ids = prompt_token_ids
    event.prompt_echo = PromptEcho(text="Hi you", first_token="H")
    return event


def test_continuous_usage_puts_the_tokens_so_far_in_every_completion_chunk() -> None:
    events: list[Event] = [
        with_prompt(chunk(0, "a", token_ids=[5, 6]), [1, 2, 3]),
        chunk(1, "", token_ids=[7]),
        chunk(2, "b", finish_reason="length", token_ids=[8]),
        final(3, ["length"], prompt_tokens=3, completion_tokens=4),
    ]
    chunks = continuous(False, events)
    assert [c["usage"] for c in chunks[:3]] == [
        {"prompt_tokens": 3, "total_tokens": 5, "completion_tokens": 2},
        {"prompt_tokens": 3, "total_tokens": 6, "completion_tokens": 3},
        {"prompt_tokens": 3, "total_tokens": 7, "completion_tokens": 4},
    ]
    assert chunks[0]["choices"][0]["text"] == "a" and chunks[0]["choices"][0]["prompt_token_ids"] is None  # no echo
    assert list(chunks[2]) == ["id", "object", "created", "model", "choices", "usage"]  # the fingerprint goes last
    assert chunks[3]["choices"] == [] and chunks[3]["usage"]["total_tokens"] == 7
    for c in chunks:
        completion_protocol.CompletionStreamResponse.model_validate(c)


def test_continuous_usage_in_a_chat_counts_each_choice_from_its_role_chunk_on() -> None:
    events: list[Event] = [
        with_prompt(chunk(0, "a", index=1, token_ids=[5]), [1, 2]),
        chunk(1, "b", index=0, token_ids=[6]),
        chunk(2, "c", index=1, token_ids=[7]),
    ]
    chunks = continuous(True, events, n=2)
    usage = {"prompt_tokens": 2, "completion_tokens_details": None}
    assert [(c["choices"][0]["index"], c["usage"]) for c in chunks] == [
        (0, {**usage, "total_tokens": 2, "completion_tokens": 0}),
        (1, {**usage, "total_tokens": 2, "completion_tokens": 0}),
        (1, {**usage, "total_tokens": 3, "completion_tokens": 1}),
        (0, {**usage, "total_tokens": 3, "completion_tokens": 1}),
        (1, {**usage, "total_tokens": 4, "completion_tokens": 2}),
    ]
    assert list(chunks[0]) == [
        "id",
        "object",
        "created",
        "model",
        "choices",
        "usage",
        "prompt_token_ids",
        "prompt_text",
    ]
    for c in chunks:
        chat_protocol.ChatCompletionStreamResponse.model_validate(c)


# --- return_prompt_text, include_reasoning -------------------------------------------------
def test_return_prompt_text_puts_the_rendered_prompt_beside_the_role() -> None:
    builder = ChunkBuilder(ResponseMeta(True, "r1", "tiny", 1700), False, shape=ResponseShape(prompt_text=True))
    chunks = [json.loads(c) for c in builder.chunks(echoed_first_chunk())]
    assert (chunks[0]["prompt_text"], chunks[0]["prompt_token_ids"]) == ("Hi", None)
    assert "prompt_text" not in chunks[1]


def test_include_reasoning_false_hides_a_parsed_chunks_tokens_and_logprobs() -> None:
    """As ``vllm serve``: with reasoning hidden, a parser's chunk names no token ids (the
    prompt's still) and no logprobs, and one the parser held back is not sent."""
    shape = ResponseShape(token_ids=True, hide_reasoning=True)
    builder = ChunkBuilder(ResponseMeta(True, "r1", "tiny", 1700), False, shape=shape)
    first = parsed_chunk(0, "<think>", None)
    first.prompt_token_ids = [4, 5]
    first.logprobs = [TokenLogprob(-0.5, 1, "x", [])]
    events: list[Event] = [first, parsed_chunk(1, "!", {"content": "!"}, finish_reason="length")]
    chunks = [json.loads(c) for event in events for c in builder.chunks(event)]
    assert chunks[0]["prompt_token_ids"] == [4, 5]
    assert [c["choices"][0] for c in chunks[1:]] == [
        {
            "index": 0,
            "delta": {"content": "!"},
            "logprobs": None,
            "finish_reason": "length",
            "stop_reason": None,
            "token_ids": None,
        }
    ]


def test_continuous_usage_counts_the_reasoning_so_far_where_a_parser_counts_it() -> None:
    """As ``vllm serve`` with a reasoning parser: every chunk's details count its choice's
    reasoning tokens so far, the role chunk's 0; the last usage sums the choices'."""
    first = with_prompt(parsed_chunk(0, "<think>", None, reasoning_tokens=1), [1, 2])
    events: list[Event] = [
        first,
        parsed_chunk(1, "hm", {"reasoning": "hm"}, reasoning_tokens=2),
        parsed_chunk(2, "</think>", None, reasoning_tokens=2),
        parsed_chunk(3, "ok", {"content": "ok"}, finish_reason="length", reasoning_tokens=2),
        final(4, ["length"], prompt_tokens=2, completion_tokens=4),
    ]
    chunks = continuous(True, events)
    details = [c["usage"]["completion_tokens_details"] for c in chunks]
    assert details == [{"reasoning_tokens": n} for n in (0, 2, 2, 2)]  # role; "hm"; "ok"; the last usage
    assert [c["usage"]["completion_tokens"] for c in chunks] == [0, 2, 4, 4]
