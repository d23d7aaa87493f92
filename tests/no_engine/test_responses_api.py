"""The Responses API's mapping onto chat completions, with no engine: a body's input items
become the chat messages ``vllm serve`` renders them as; chat chunks become the typed
events the openai SDK parses, numbered from 0 without a gap, the same on every reading;
a whole chat response becomes a ``Response``; and every field of vLLM's ``ResponsesRequest``
is classified in the table docs/gateway.md shows."""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from gateway.responses_face import ResponsesFace
from gateway.responses_fields import RESPONSES_FIELDS, summary
from gateway.responses_input import chat_body
from gateway.responses_output import ResponseHead, ResponsesFraming, dump, whole_response
from producer.errors import InvalidParameter
from producer.openai_api.fields import Support, table_markdown

with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    from vllm.entrypoints.openai.responses.protocol import ResponsesRequest

EVENTS = TypeAdapter(ResponseStreamEvent)
GATEWAY_PAGE = Path(__file__).resolve().parents[2] / "docs" / "gateway.md"


def test_a_string_input_is_the_users_message_after_the_instructions() -> None:
    body = {"model": "m", "input": "Hi", "instructions": "Be brief", "max_output_tokens": 5, "temperature": 0}
    chat = chat_body(body)
    assert chat["messages"] == [{"role": "system", "content": "Be brief"}, {"role": "user", "content": "Hi"}]
    assert chat["max_completion_tokens"] == 5
    assert chat["temperature"] == 0
    assert chat["model"] == "m"


def test_items_fold_into_chat_messages_as_vllm_serve_folds_them() -> None:
    items = [
        {"role": "user", "content": [{"type": "input_text", "text": "Weather in Paris?"}]},
        {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "think"}]},
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Sunny."}]},
    ]
    assert chat_body({"model": "m", "input": items})["messages"] == [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "reasoning": "think",
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
            ],
        },
        {"role": "tool", "content": "sunny", "tool_call_id": "c1"},
        {"role": "assistant", "content": "Sunny."},
    ]


def test_history_comes_before_the_input_without_its_instructions() -> None:
    history = [
        {"role": "system", "content": "old"},
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "b"},
    ]
    chat = chat_body({"model": "m", "input": "c", "instructions": "new"}, history)
    assert [m["content"] for m in chat["messages"]] == ["new", "a", "b", "c"]


def test_text_format_tools_and_reasoning_map_to_their_chat_fields() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    body = {
        "model": "m",
        "input": "x",
        "stream": True,
        "text": {"format": {"type": "json_schema", "name": "A", "schema": schema, "strict": True}},
        "tools": [{"type": "function", "name": "f", "parameters": schema, "strict": True}],
        "tool_choice": {"type": "function", "name": "f"},
        "reasoning": {"effort": "low"},
        "include": ["message.output_text.logprobs"],
        "top_logprobs": 2,
    }
    chat = chat_body(body)
    assert chat["response_format"] == {
        "type": "json_schema",
        "json_schema": {"name": "A", "schema": schema, "strict": True},
    }
    assert chat["tools"] == [{"type": "function", "function": {"name": "f", "parameters": schema, "strict": True}}]
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "f"}}
    assert chat["chat_template_kwargs"] == {"reasoning_effort": "low", "enable_thinking": True}
    assert chat["stream_options"] == {"include_usage": True}
    assert (chat["logprobs"], chat["top_logprobs"]) == (True, 2)
    assert chat_body({"model": "m", "input": "x", "text": {"format": {"type": "json_object"}}})["response_format"] == {
        "type": "json_object"
    }


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"model": "m", "input": [{"type": "web_search_call", "id": "w"}]}, "input"),
        ({"model": "m", "input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input"),
        ({"model": "m", "input": 5}, "input"),
        ({"model": "m"}, "input"),
        ({"model": "m", "input": "x", "tools": [{"type": "web_search_preview"}]}, "tools"),
        ({"model": "m", "input": "x", "truncation": "auto"}, "truncation"),
        ({"model": "m", "input": "x", "prompt": {"id": "p"}}, "prompt"),
        ({"model": "m", "input": "x", "no_such_field": 1}, "no_such_field"),
    ],
)
def test_what_cannot_be_carried_is_refused_by_name(body: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidParameter) as refused:
        chat_body(body)
    assert refused.value.param == param


@pytest.mark.parametrize(
    ("field", "value"), [("temperature", "hot"), ("metadata", 5), ("reasoning", {"effort": "lots"}), ("tools", [{}])]
)
def test_a_field_the_response_echoes_is_checked_before_anything_is_queued(field: str, value: Any) -> None:
    with pytest.raises(InvalidParameter) as refused:
        ResponsesFace().openai_body({"model": "m", "input": "x", field: value})
    assert refused.value.param == field


HEAD = ResponseHead("abc", "m", 1700000000, {"model": "m", "input": "Hi"})


def _chunk(delta: dict[str, Any] | None = None, finish: str | None = None, **extra: Any) -> bytes:
    choices = [] if delta is None else [{"index": 0, "delta": delta, "finish_reason": finish}]
    return json.dumps({"id": "chatcmpl-abc", "choices": choices, **extra}).encode()


USAGE = {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
TEXT_STREAM = [
    [_chunk({"role": "assistant", "content": ""})],
    [_chunk({"content": "Hel"})],
    [_chunk({"content": "lo"}, "length")],
    [_chunk(usage=USAGE)],
]


def _events(framing: ResponsesFraming, batches: list[list[bytes]]) -> list[Any]:
    sse = b"".join(framing.frame(batch, None) for batch in batches) + framing.end()
    events = []
    for block in sse.decode().split("\n\n")[:-1]:
        kind, data = block.split("\n")
        event = EVENTS.validate_json(data.removeprefix("data: "))
        assert kind == f"event: {event.type}"
        events.append(event)
    return events


def test_a_text_stream_is_the_typed_events_numbered_from_zero() -> None:
    events = _events(ResponsesFraming(HEAD), TEXT_STREAM)
    assert [e.type for e in events] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    completed = events[-1].response
    assert completed.id == "resp_abc" and completed.status == "incomplete"
    assert completed.output_text == "Hello"
    assert completed.usage.input_tokens == 3 and completed.usage.output_tokens == 2


def test_a_stream_read_again_has_the_same_events_and_starting_after_drops_the_first() -> None:
    first = _events(ResponsesFraming(HEAD), TEXT_STREAM)
    again = _events(ResponsesFraming(HEAD), [[chunk] for batch in TEXT_STREAM for chunk in batch])
    assert [dump(e) for e in first] == [dump(e) for e in again]
    resumed = _events(ResponsesFraming(HEAD, starting_after=4), TEXT_STREAM)
    assert [dump(e) for e in resumed] == [dump(e) for e in first[5:]]


def test_reasoning_and_a_function_call_stream_as_their_own_items() -> None:
    call = {"index": 0, "id": "call_1", "type": "function", "function": {"name": "f", "arguments": ""}}
    batches = [
        [_chunk({"role": "assistant", "content": ""})],
        [_chunk({"reasoning": "hm"})],
        [_chunk({"tool_calls": [call]})],
        [_chunk({"tool_calls": [{"index": 0, "function": {"arguments": '{"a": 1}'}}]}, "tool_calls")],
        [_chunk(usage=USAGE)],
    ]
    events = _events(ResponsesFraming(HEAD), batches)
    kinds = [e.type for e in events]
    assert "response.reasoning_text.delta" in kinds
    assert "response.function_call_arguments.delta" in kinds
    (arguments_done,) = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert arguments_done.arguments == '{"a": 1}'
    output = events[-1].response.output
    assert [item.type for item in output] == ["reasoning", "function_call"]
    assert (output[1].call_id, output[1].name, output[1].arguments) == ("call_1", "f", '{"a": 1}')


def test_a_token_without_text_of_its_own_still_streams_its_logprobs() -> None:
    def entry(token: str) -> dict[str, Any]:
        return {"token": token, "logprob": -1.0, "bytes": [1], "top_logprobs": []}

    batches = [
        [_chunk({"role": "assistant", "content": ""})],
        [
            json.dumps(
                {"choices": [{"index": 0, "delta": {"content": "a"}, "logprobs": {"content": [entry("a")]}}]}
            ).encode()
        ],
        [
            json.dumps(
                {"choices": [{"index": 0, "delta": {"content": ""}, "logprobs": {"content": [entry("")]}}]}
            ).encode()
        ],
    ]
    events = _events(ResponsesFraming(HEAD), batches)
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert [[lp.token for lp in e.logprobs] for e in deltas] == [["a"], [""]]
    assert [lp.token for lp in events[-1].response.output[0].content[0].logprobs] == ["a", ""]


def test_a_request_past_its_deadline_is_a_failed_response() -> None:
    events = _events(ResponsesFraming(HEAD), [[_chunk({"role": "assistant", "content": ""})], [_chunk({}, "timeout")]])
    assert events[-1].response.status == "failed" and events[-1].response.error is not None


def test_an_error_chunk_ends_the_stream_with_an_error_event() -> None:
    error = json.dumps({"error": {"message": "boom", "type": "internal_error", "param": None, "code": "x"}}).encode()
    events = _events(ResponsesFraming(HEAD), [[error]])
    assert [e.type for e in events] == ["response.created", "response.in_progress", "error"]
    assert events[-1].message == "boom"


def test_a_whole_chat_response_is_a_response() -> None:
    chat = {
        "id": "chatcmpl-abc",
        "model": "m",
        "created": 1,
        "choices": [
            {
                "index": 0,
                "message": {
                    "role": "assistant",
                    "content": "Hi",
                    "reasoning": "r",
                    "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}],
                },
                "finish_reason": "stop",
            }
        ],
        "usage": USAGE,
    }
    response = Response.model_validate(dump(whole_response(chat, HEAD)))
    assert [item.type for item in response.output] == ["reasoning", "message", "function_call"]
    assert response.output_text == "Hi" and response.status == "completed"
    assert response.usage is not None and response.usage.total_tokens == 5


def test_every_field_of_vllms_responses_request_is_classified() -> None:
    assert set(RESPONSES_FIELDS) == set(ResponsesRequest.model_fields)
    assert all(spec.note for spec in RESPONSES_FIELDS.values() if spec.support is not Support.HONOURED)


def test_the_gateway_page_shows_the_responses_table() -> None:
    page = GATEWAY_PAGE.read_text(encoding="utf-8")
    assert summary() in " ".join(page.split())
    assert table_markdown(RESPONSES_FIELDS) in page
