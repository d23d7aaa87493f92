"""A request's events become the chunks of OpenAI's streamed response, in the shape `vllm serve` streams."""

from __future__ import annotations

from typing import Any

import pytest

from producer.openai_api.responses import ChunkBuilder, ResponseMeta
from streamq.protocol import ChunkEvent, ErrorEvent, Event, FinalEvent


def chunk(seq: int, text: str, *, index: int = 0, finish_reason: str | None = None) -> ChunkEvent:
    return ChunkEvent(request_id="r1", seq=seq, index=index, text=text, token_ids=[seq], finish_reason=finish_reason)


def final(seq: int, reasons: list[str | None], prompt_tokens: int = 3, completion_tokens: int = 2) -> FinalEvent:
    return FinalEvent(
        request_id="r1",
        seq=seq,
        finish_reasons=reasons,
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
    )


def build(chat: bool, events: list[Event], *, include_usage: bool = False) -> list[dict[str, Any]]:
    builder = ChunkBuilder(ResponseMeta(chat, "r1", "tiny", 1700), include_usage=include_usage)
    return [c for event in events for c in builder.chunks(event)]


def test_completion_chunks_carry_text_then_the_finish_reason() -> None:
    chunks = build(False, [chunk(0, "Hel"), chunk(1, "lo", finish_reason="length"), final(2, ["length"])])
    assert [c["choices"] for c in chunks] == [
        [{"index": 0, "text": "Hel", "logprobs": None, "finish_reason": None, "stop_reason": None}],
        [{"index": 0, "text": "lo", "logprobs": None, "finish_reason": "length", "stop_reason": None}],
    ]
    for c in chunks:
        assert (c["id"], c["object"], c["created"], c["model"]) == ("cmpl-r1", "text_completion", 1700, "tiny")


def test_chat_chunks_name_the_role_once_per_choice() -> None:
    events: list[Event] = [chunk(0, "a"), chunk(1, "b", index=1), chunk(2, "c"), chunk(3, "d", index=1)]
    deltas = [(c["choices"][0]["index"], c["choices"][0]["delta"]) for c in build(True, events)]
    assert deltas == [
        (0, {"role": "assistant", "content": "a"}),
        (1, {"role": "assistant", "content": "b"}),
        (0, {"content": "c"}),
        (1, {"content": "d"}),
    ]


def test_chat_chunks_are_chat_completion_chunks() -> None:
    for c in build(True, [chunk(0, "a"), final(1, ["stop"])]):
        assert (c["id"], c["object"]) == ("chatcmpl-r1", "chat.completion.chunk")


def test_a_choice_that_ended_without_a_last_chunk_gets_its_finish_reason_from_the_final_event() -> None:
    events: list[Event] = [chunk(0, "a", finish_reason="stop"), chunk(1, "b", index=1), final(2, ["stop", "abort"])]
    tail = build(True, events)[2:]
    assert [c["choices"] for c in tail] == [
        [{"index": 1, "delta": {"content": ""}, "logprobs": None, "finish_reason": "abort"}]
    ]


def test_bytes_of_an_unfinished_character_make_no_chunk() -> None:
    assert build(False, [chunk(0, "")]) == []
    assert build(True, [chunk(0, "")]) == []


@pytest.mark.parametrize("chat", [False, True])
def test_usage_comes_in_a_last_chunk_without_choices_only_when_asked(chat: bool) -> None:
    events: list[Event] = [
        chunk(0, "a", finish_reason="stop"),
        final(1, ["stop"], prompt_tokens=5, completion_tokens=1),
    ]
    assert all("usage" not in c for c in build(chat, events))
    last = build(chat, events, include_usage=True)[-1]
    assert last["choices"] == []
    assert last["usage"] == {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6}


def test_an_error_event_becomes_an_openai_error_body() -> None:
    error = ErrorEvent(request_id="r1", seq=4, code="timeout", message="ran past 60 s")
    assert build(True, [chunk(0, "a"), error])[-1] == {
        "error": {"message": "timeout: ran past 60 s", "type": "internal_error", "param": None, "code": "timeout"}
    }


def test_completion_chunks_parse_as_vllm_serves_stream_response() -> None:
    protocol = pytest.importorskip("vllm.entrypoints.openai.completion.protocol")
    events: list[Event] = [chunk(0, "a"), chunk(1, "b", finish_reason="stop"), final(2, ["stop"])]
    for c in build(False, events, include_usage=True):
        protocol.CompletionStreamResponse.model_validate(c)


def test_chat_chunks_parse_as_vllm_serves_stream_response() -> None:
    protocol = pytest.importorskip("vllm.entrypoints.openai.chat_completion.protocol")
    events: list[Event] = [chunk(0, "a"), chunk(1, "b"), final(2, ["length"])]
    parsed = [protocol.ChatCompletionStreamResponse.model_validate(c) for c in build(True, events, include_usage=True)]
    assert [p.choices[0].delta.role for p in parsed[:3]] == ["assistant", None, None]
    assert parsed[2].choices[0].finish_reason == "length"
    assert parsed[3].usage.total_tokens == 5
