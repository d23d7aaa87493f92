"""Anthropic's Messages API over the chat completions mapping (``gateway.faces_messages``):
bodies mapped to the chat body ``vllm serve`` makes of them, chat chunks framed as the
events the anthropic SDK reads (read here by the SDK itself), whole responses, Anthropic's
error shape, ``x-api-key``, and the fields table against vLLM's own request class."""

from __future__ import annotations

import json
import re
import warnings
from pathlib import Path
from typing import Any, get_args

import anthropic
import httpx2
import pytest
from starlette.applications import Starlette
from starlette.responses import PlainTextResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from gateway.auth import ApiKeyAuth, ApiKeyMiddleware
from gateway.faces_messages import MESSAGES_FACE
from gateway.messages_errors import anthropic_error_body
from gateway.messages_fields import MESSAGES_FIELDS, PASSED_ON
from gateway.messages_request import EFFORTS, count_tokens_to_chat, messages_to_chat
from gateway.messages_response import message_of
from gateway.messages_stream import MessagesFraming
from producer.errors import InvalidParameter
from producer.openai_api.errors import ApiError, bad_request
from producer.openai_api.fields import CHAT_FIELDS, Support, table_markdown
from producer.openai_api.requests import parse_openai_body
from producer.openai_api.responses import ResponseMeta

with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)  # torch's own, raised while vLLM imports
    from vllm.entrypoints.anthropic.protocol import AnthropicMessagesRequest

GATEWAY_PAGE = Path(__file__).resolve().parents[2] / "docs" / "gateway.md"
USER = [{"role": "user", "content": "Hi"}]
WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}


def body(**fields: Any) -> dict[str, Any]:
    return {"model": "m", "max_tokens": 8, "messages": USER, **fields}


# The body mapping


def test_system_text_blocks_are_joined_into_the_first_message_without_the_billing_header() -> None:
    system = [
        {"type": "text", "text": "x-anthropic-billing-header: cc_version=1; hash=abc"},
        {"type": "text", "text": "Be brief. "},
        {"type": "text", "text": "Be kind.", "cache_control": {"type": "ephemeral"}},
    ]
    chat = messages_to_chat(body(system=system))
    assert chat["messages"] == [{"role": "system", "content": "Be brief. Be kind."}, *USER]
    assert messages_to_chat(body(system="Short."))["messages"][0] == {"role": "system", "content": "Short."}


def test_sampling_fields_become_the_chat_fields_of_the_same_meaning() -> None:
    chat = messages_to_chat(
        body(temperature=0.5, top_p=0.9, top_k=4, stop_sequences=["\n\n"], metadata={"user_id": "u"})
    )
    assert chat == {
        "model": "m",
        "messages": USER,
        "max_tokens": 8,
        "temperature": 0.5,
        "top_p": 0.9,
        "top_k": 4,
        "stop": ["\n\n"],
    }


def test_a_stream_asks_for_the_usage_chunk_that_message_delta_reports() -> None:
    chat = messages_to_chat(body(stream=True))
    assert chat["stream"] is True and chat["stream_options"] == {"include_usage": True}


def test_a_tool_round_trip_becomes_tool_calls_and_a_tool_message() -> None:
    turns = [
        {"role": "user", "content": "Weather in Oslo?"},
        {
            "role": "assistant",
            "content": [
                {"type": "thinking", "thinking": "Ask the tool.", "signature": "s"},
                {"type": "text", "text": "Let me look."},
                {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Oslo"}},
            ],
        },
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "Snow"}]},
                {"type": "text", "text": "And now?"},
            ],
        },
    ]
    chat = messages_to_chat(body(messages=turns, tools=[WEATHER], tool_choice={"type": "any"}))
    call = {"id": "toolu_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
    assert chat["messages"] == [
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "reasoning": "Ask the tool.", "tool_calls": [call], "content": "Let me look."},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "Snow"},
        {"role": "user", "content": "And now?"},
    ]
    function = {"name": "get_weather", "description": "The weather in a city", "parameters": WEATHER["input_schema"]}
    assert chat["tools"] == [{"type": "function", "function": function}]
    assert chat["tool_choice"] == "required" and chat["parallel_tool_calls"] is True
    parse_openai_body(chat, chat=True)  # a body the chat mapping takes as it is


@pytest.mark.parametrize(
    ("choice", "expected", "parallel"),
    [
        ({"type": "auto"}, "auto", True),
        ({"type": "none"}, "none", True),
        ({"type": "any", "disable_parallel_tool_use": True}, "required", False),
        ({"type": "tool", "name": "get_weather"}, {"type": "function", "function": {"name": "get_weather"}}, True),
    ],
)
def test_tool_choice_becomes_openais(choice: dict[str, Any], expected: Any, parallel: bool) -> None:
    chat = messages_to_chat(body(tools=[WEATHER], tool_choice=choice))
    assert (chat["tool_choice"], chat["parallel_tool_calls"]) == (expected, parallel)


def test_tools_without_a_choice_are_auto_and_a_schema_without_a_type_is_an_object() -> None:
    chat = messages_to_chat(body(tools=[{"name": "f", "input_schema": {"properties": {}}}]))
    assert chat["tool_choice"] == "auto"
    assert chat["tools"][0]["function"]["parameters"] == {"type": "object", "properties": {}}


def test_vllms_own_fields_pass_on_to_the_chat_body_where_its_table_decides() -> None:
    chat = messages_to_chat(body(chat_template_kwargs={"enable_thinking": False}, vllm_xargs={"a": 1}))
    assert chat["chat_template_kwargs"] == {"enable_thinking": False} and chat["vllm_xargs"] == {"a": 1}
    salted = parse_openai_body(messages_to_chat(body(cache_salt="salt")), chat=True)
    assert salted.submit_kwargs["cache_salt"] == "salt"  # the chat table honours it


def test_count_tokens_maps_the_conversation_without_sampling() -> None:
    chat = count_tokens_to_chat({"model": "m", "messages": USER, "system": "S", "tools": [WEATHER]})
    assert set(chat) == {"model", "messages", "tools", "tool_choice"}
    assert chat["messages"][0] == {"role": "system", "content": "S"}


# Bad input: a 400 naming the field


@pytest.mark.parametrize(
    ("fields", "param", "words"),
    [
        ({"max_tokens": None}, "max_tokens", "max_tokens: field required"),
        ({"max_tokens": 0}, "max_tokens", "positive"),
        ({"model": ""}, "model", "model: field required"),
        ({"messages": []}, "messages", "non-empty"),
        ({"messages": [{"role": "user", "content": [{"type": "video", "x": 1}]}]}, "messages", "'video'"),
        (
            {"messages": [{"role": "user", "content": [{"type": "text"}]}]},
            "messages",
            "content[0].text: Field required",
        ),
        ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "messages", "images"),
        ({"messages": [{"role": "system", "content": "S"}]}, "messages", "`system`"),
        ({"messages": [{"role": "tool", "content": "S"}]}, "messages", "'user' or 'assistant'"),
        ({"tool_choice": {"type": "function"}}, "tool_choice", "tool_choice.type"),
        ({"tool_choice": {"type": "tool"}}, "tool_choice", "tool_choice.name: Field required"),
        ({"tools": [{"name": "f"}]}, "tools", "tools[0].input_schema: Field required"),
        ({"output_config": {"effort": "extreme"}}, "output_config", "effort must be one of"),
        ({"stop_sequences": "\n"}, "stop_sequences", "list of strings"),
        ({"system": [{"type": "image"}]}, "system", "system[0]"),
    ],
)
def test_a_body_vllm_serve_refuses_or_streamq_cannot_honour_is_a_400_naming_the_field(
    fields: dict[str, Any], param: str, words: str
) -> None:
    with pytest.raises(InvalidParameter, match=re.escape(words)) as refused:
        messages_to_chat({k: v for k, v in body(**fields).items() if v is not None})
    assert refused.value.param == param
    response = MESSAGES_FACE.error_response(refused.value)
    assert response.status_code == 400
    assert json.loads(bytes(response.body)) == {
        "type": "error",
        "error": {"type": "invalid_request_error", "message": str(refused.value)},
    }


# Anthropic's error shape


@pytest.mark.parametrize(
    ("status", "kind"),
    [
        (400, "invalid_request_error"),
        (401, "authentication_error"),
        (403, "permission_error"),
        (404, "not_found_error"),
        (429, "rate_limit_error"),
        (500, "api_error"),
        (503, "overloaded_error"),
    ],
)
def test_errors_take_anthropics_type_by_status(status: int, kind: str) -> None:
    error = ApiError(status, "what went wrong")
    assert anthropic_error_body(error) == {"type": "error", "error": {"type": kind, "message": "what went wrong"}}


def test_an_x_api_key_is_a_key_and_a_refusal_on_messages_is_in_anthropics_shape() -> None:
    async def ok(request: Any) -> PlainTextResponse:
        return PlainTextResponse("ok")

    app = Starlette(routes=[Route("/v1/messages", ok, methods=["POST"]), Route("/v1/models", ok)])
    guarded = ApiKeyMiddleware(app, ApiKeyAuth(["sesame"]), error_bodies={"/v1/messages": MESSAGES_FACE.error_body})
    client = TestClient(guarded)
    assert client.post("/v1/messages", headers={"x-api-key": "sesame"}).text == "ok"
    assert client.post("/v1/messages", headers={"Authorization": "Bearer sesame"}).text == "ok"
    refused = client.post("/v1/messages", headers={"x-api-key": "wrong"})
    assert refused.status_code == 401
    assert refused.json()["error"]["type"] == "authentication_error" and refused.json()["type"] == "error"
    assert client.get("/v1/models", headers={"x-api-key": "wrong"}).json()["error"]["code"] == "invalid_api_key"


# Whole responses


def chat_response(message: dict[str, Any], finish_reason: str) -> dict[str, Any]:
    choice = {"index": 0, "message": {"role": "assistant", **message}, "finish_reason": finish_reason}
    usage = {"prompt_tokens": 9, "total_tokens": 12, "completion_tokens": 3}
    return {"id": "chatcmpl-1", "object": "chat.completion", "model": "m", "choices": [choice], "usage": usage}


def test_a_whole_reply_is_an_anthropic_message() -> None:
    message = message_of(chat_response({"content": "Hello", "tool_calls": []}, "length"))
    assert message == {
        "id": "chatcmpl-1",
        "type": "message",
        "role": "assistant",
        "content": [{"type": "text", "text": "Hello"}],
        "model": "m",
        "stop_reason": "max_tokens",
        "usage": {"input_tokens": 9, "output_tokens": 3},
    }
    assert anthropic.types.Message.model_validate(message).content[0].type == "text"


def test_a_whole_tool_call_is_a_tool_use_block_and_stops_for_it() -> None:
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
    message = message_of(chat_response({"content": None, "tool_calls": [call]}, "stop"))  # a named choice says stop
    assert message["content"] == [
        {"type": "tool_use", "id": "call_1", "name": "get_weather", "input": {"city": "Oslo"}}
    ]
    assert message["stop_reason"] == "tool_use"


def test_an_empty_reply_is_one_empty_text_block() -> None:
    message = message_of(chat_response({"content": "", "tool_calls": []}, "stop"))
    assert message["content"] == [{"type": "text", "text": ""}] and message["stop_reason"] == "end_turn"


# Streams, read by the anthropic SDK


HEAD = {"id": "chatcmpl-7", "object": "chat.completion.chunk", "created": 1, "model": "m"}


def chunk(delta: dict[str, Any], finish_reason: str | None = None) -> bytes:
    return json.dumps({**HEAD, "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason}]}).encode()


USAGE = json.dumps({**HEAD, "choices": [], "usage": {"prompt_tokens": 9, "total_tokens": 13, "completion_tokens": 4}})


def framed(batches: list[list[bytes]]) -> bytes:
    framing = MESSAGES_FACE.framing(ResponseMeta(True, "r", "m", created=1), body())
    assert isinstance(framing, MessagesFraming)
    return b"".join(framing.frame(batch, None) for batch in batches) + framing.end()


def sdk_reading(stream: bytes) -> anthropic.Anthropic:
    """The anthropic SDK, answered ``stream`` by its HTTP transport."""

    def answer(request: httpx2.Request) -> httpx2.Response:
        return httpx2.Response(200, content=stream, headers={"content-type": "text/event-stream"})

    return anthropic.Anthropic(
        base_url="http://gateway", api_key="k", http_client=httpx2.Client(transport=httpx2.MockTransport(answer))
    )


def final_message(stream: bytes) -> tuple[Any, list[str]]:
    client = sdk_reading(stream)
    with client.messages.stream(model="m", max_tokens=8, messages=USER) as events:  # type: ignore[arg-type]
        names: list[str] = [event.type for event in events]
        return events.get_final_message(), names


def test_text_chunks_are_one_text_block_with_the_usage_of_the_usage_chunk() -> None:
    stream = framed(
        [
            [chunk({"role": "assistant", "content": ""})],
            [chunk({"content": "Hel"})],
            [chunk({"content": "lo"}, "stop")],
            [USAGE.encode()],
        ]
    )
    message, names = final_message(stream)
    assert [event.split(b"\n")[0] for event in stream.split(b"\n\n") if event][:3] == [
        b"event: message_start",
        b"event: content_block_start",
        b"event: content_block_delta",
    ]
    assert message.id == "chatcmpl-7" and message.model == "m"
    assert [(block.type, getattr(block, "text", None)) for block in message.content] == [("text", "Hello")]
    assert (message.stop_reason, message.stop_sequence) == ("end_turn", None)
    assert (message.usage.input_tokens, message.usage.output_tokens) == (9, 4)
    assert "message_stop" in names and "content_block_stop" in names


def test_a_streamed_tool_call_is_a_tool_use_block_of_json_deltas_and_text_after_it_a_block_of_its_own() -> None:
    opened = {"index": 0, "id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": ""}}
    stream = framed(
        [
            [chunk({"role": "assistant", "content": ""})],
            [chunk({"content": "Looking."})],
            [chunk({"tool_calls": [opened]})],
            [chunk({"tool_calls": [{"index": 0, "function": {"arguments": '{"city": '}}]})],
            [chunk({"content": " (held)"})],
            [chunk({"tool_calls": [{"index": 0, "function": {"arguments": '"Oslo"}'}}]}, "tool_calls")],
            [USAGE.encode()],
        ]
    )
    message, _ = final_message(stream)
    blocks = [block.model_dump(exclude_none=True) for block in message.content]
    assert blocks == [
        {"type": "text", "text": "Looking."},
        {"type": "tool_use", "id": "call_1", "name": "get_weather", "input": {"city": "Oslo"}},
        {"type": "text", "text": " (held)"},
    ]
    assert message.stop_reason == "tool_use"
    assert b'"type":"input_json_delta"' in stream


def test_reasoning_is_a_thinking_block_signed_before_it_stops() -> None:
    stream = framed(
        [
            [chunk({"role": "assistant", "content": ""})],
            [chunk({"reasoning": "Hmm"})],
            [chunk({"reasoning": "."})],
            [chunk({"content": "Yes"}, "stop")],
            [USAGE.encode()],
        ]
    )
    message, _ = final_message(stream)
    thinking, text = message.content
    assert (thinking.type, thinking.thinking, text.type, text.text) == ("thinking", "Hmm.", "text", "Yes")
    assert len(thinking.signature) == 32


def test_a_tool_call_cut_short_by_max_tokens_stops_for_max_tokens() -> None:
    opened = {"index": 0, "id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"a'}}
    stream = framed(
        [[chunk({"role": "assistant", "content": ""})], [chunk({"tool_calls": [opened]}, "length")], [USAGE.encode()]]
    )
    assert b'"stop_reason":"max_tokens"' in stream


def test_a_failure_inside_a_stream_is_an_error_event_the_sdk_raises() -> None:
    failed = json.dumps({"error": {"message": "the worker died", "type": "internal_error"}}).encode()
    framing = MessagesFraming()
    stream = framing.frame([chunk({"role": "assistant", "content": ""}), failed], None) + framing.end()
    assert stream.endswith(
        b'event: error\ndata: {"error": {"message": "the worker died", "type": "api_error"}, "type": "error"}\n\n'
    )
    with pytest.raises(anthropic.APIStatusError, match="the worker died"):
        final_message(stream)


def test_an_error_ending_a_stream_is_in_anthropics_shape() -> None:
    assert MessagesFraming().error(bad_request("no")) == (
        b'event: error\ndata: {"error": {"message": "no", "type": "invalid_request_error"}, "type": "error"}\n\n'
    )


def test_a_resumable_streams_last_event_of_a_batch_carries_its_id() -> None:
    framing = MessagesFraming()
    stream = framing.frame([chunk({"role": "assistant", "content": ""}), chunk({"content": "a"})], "4.abc")
    events = [event for event in stream.split(b"\n\n") if event]
    assert [event.startswith(b"id: 4.abc\n") for event in events] == [False, False, True]


# The fields table


def test_every_field_of_vllms_messages_request_is_classified() -> None:
    assert set(MESSAGES_FIELDS) == set(AnthropicMessagesRequest.model_fields)


def test_fields_passed_on_to_the_chat_body_are_decided_by_the_chat_table() -> None:
    assert all(MESSAGES_FIELDS[name] is CHAT_FIELDS[name] for name in PASSED_ON)


def test_every_field_not_honoured_says_why() -> None:
    assert all(field.note for field in MESSAGES_FIELDS.values() if field.support is not Support.HONOURED)


def test_the_gateway_page_shows_the_table_the_code_applies() -> None:
    assert table_markdown(MESSAGES_FIELDS) in GATEWAY_PAGE.read_text(encoding="utf-8")


@pytest.mark.parametrize(
    ("fields", "effort"),
    [
        ({"output_config": {"effort": "low"}}, "low"),
        ({"thinking": {"type": "disabled"}}, "none"),
        ({"output_config": {"effort": "high"}, "thinking": {"type": "disabled"}}, "none"),  # thinking last, as vLLM
    ],
)
def test_effort_and_disabled_thinking_set_the_templates_reasoning_effort(fields: dict[str, Any], effort: str) -> None:
    assert messages_to_chat(body(**fields))["reasoning_effort"] == effort


def test_the_efforts_taken_are_vllms() -> None:
    from vllm.entrypoints.anthropic.protocol import AnthropicEffort

    assert get_args(AnthropicEffort) == EFFORTS
