"""OpenAI request bodies (``producer/openai_api/requests.py``): the sampling fields and
messages map onto a streamq request; a body the gateway serves names its model, how it
is delivered (streamed, with usage) and the submit arguments; a bad one is refused with
a reason naming what is wrong."""

from __future__ import annotations

import logging
import warnings
from typing import Any

import pytest

from producer.openai_api.limits import RequestLimits
from producer.openai_api.requests import (
    SKIPPED_WHEN_EMPTY,
    TEXT_PARTS,
    chat_request_to_submit_kwargs,
    completion_request_to_submit_kwargs,
    parse_openai_body,
)
from streamq.protocol import InvalidRequest

COMPLETIONS: list[tuple[dict[str, Any], dict[str, Any]]] = [
    ({"model": "m", "prompt": "Hi"}, {"prompt": "Hi"}),
    ({"prompt": ["Hi"], "max_tokens": 5}, {"prompt": "Hi", "max_tokens": 5}),
    (
        {"prompt": "Hi", "temperature": 0, "top_p": 0.5, "n": 2, "seed": 7, "stop": "\n"},
        {"prompt": "Hi", "temperature": 0.0, "top_p": 0.5, "n": 2, "seed": 7, "stop": ["\n"]},
    ),
    (
        {"prompt": "Hi", "presence_penalty": 0.1, "frequency_penalty": -0.2, "stop": ["a", "b"]},
        {"prompt": "Hi", "presence_penalty": 0.1, "frequency_penalty": -0.2, "stop": ["a", "b"]},
    ),
    (
        {"prompt": "Hi", "ignore_eos": True, "top_k": 3, "min_p": 0.1, "repetition_penalty": 1.1, "min_tokens": 2},
        {"prompt": "Hi", "ignore_eos": True, "top_k": 3, "min_p": 0.1, "repetition_penalty": 1.1, "min_tokens": 2},
    ),
    (
        {"prompt": "Hi", "stream": False, "user": "u", "logprobs": None, "echo": False, "best_of": 1, "suffix": None},
        {"prompt": "Hi"},
    ),
    (
        {"prompt": "Hi", "stop_token_ids": [1, 2], "skip_special_tokens": False},
        {
            "prompt": "Hi",
            "stop_token_ids": [1, 2],
            "skip_special_tokens": False,
        },
    ),
    ({"prompt": "Hi", "temperature": None, "stop": None}, {"prompt": "Hi"}),
    ({"prompt": "Hi", "logprobs": 0}, {"prompt": "Hi", "logprobs": 0}),
    (
        {"prompt": "Hi", "logprobs": 3, "prompt_logprobs": 2, "stream": False},
        {"prompt": "Hi", "logprobs": 3, "prompt_logprobs": 2},
    ),
    ({"prompt": "Hi", "prompt_logprobs": 0, "stream": True}, {"prompt": "Hi", "prompt_logprobs": 0}),
]

CHATS: list[tuple[dict[str, Any], dict[str, Any]]] = [
    (
        {"messages": [{"role": "user", "content": "Hi"}], "logprobs": True},
        {"messages": [{"role": "user", "content": "Hi"}], "logprobs": 0},
    ),
    (
        {"messages": [{"role": "user", "content": "Hi"}], "logprobs": True, "top_logprobs": 5, "prompt_logprobs": 1},
        {"messages": [{"role": "user", "content": "Hi"}], "logprobs": 5, "prompt_logprobs": 1},
    ),
    (
        {"messages": [{"role": "user", "content": "Hi"}], "logprobs": False, "top_logprobs": 0},
        {"messages": [{"role": "user", "content": "Hi"}]},
    ),
    (
        {"model": "m", "messages": [{"role": "user", "content": "Hi"}]},
        {"messages": [{"role": "user", "content": "Hi"}]},
    ),
    (
        {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "max_completion_tokens": 9},
        {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 9},
    ),
    (
        {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4},
        {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4},
    ),
    (
        {
            "messages": [
                {"role": "system", "content": "Be brief.", "name": "sys"},
                {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
            ],
            "n": 3,
            "seed": 1,
            "stop": ["x"],
            "tool_choice": "none",
            "response_format": {"type": "text"},
            "logprobs": False,
            "stream": False,
        },
        {
            "messages": [
                {"role": "system", "content": "Be brief.", "name": "sys"},
                {"role": "user", "content": "a\nb"},
            ],
            "n": 3,
            "seed": 1,
            "stop": ["x"],
        },
    ),
]

BAD_COMPLETIONS: list[tuple[object, str]] = [
    ([], "must be a JSON object"),
    ({}, "prompt must be a string"),
    ({"prompt": []}, "prompt must be a string"),
    ({"prompt": [[1], "a"]}, "prompt must be a string"),
    ({"prompt": [1, -2]}, "token ids (integers >= 0)"),
    ({"prompt": [[1], []]}, "non-empty token-id lists"),
    ({"prompt": ["a"] * 257}, "prompt holds 257 prompts; the limit is 256"),
    ({"prompt": ["a", "b"]}, "a batch line takes one prompt"),
    ({"prompt": "Hi", "max_tokens": "ten"}, "max_tokens"),
    ({"prompt": "Hi", "temperature": "hot"}, "temperature"),
    ({"prompt": "Hi", "stop": [1]}, "stop"),
    ({"prompt": "Hi", "logprobs": True}, "logprobs"),
    ({"prompt": "Hi", "logprobs": -2}, "logprobs"),
    ({"prompt": "Hi", "logprobs": "2"}, "logprobs"),
    ({"prompt": "Hi", "prompt_logprobs": 1, "stream": True}, "not available when `stream=True`"),
    ({"prompt": "Hi", "prompt_logprobs": -1, "stream": True}, "not available when `stream=True`"),
    ({"prompt": "Hi", "echo": "yes"}, "`echo` must be true or false"),
    ({"prompt": "Hi", "best_of": 3}, "best_of"),
    ({"prompt": "Hi", "logit_bias": {"five": 1}}, "logit_bias contains key(s) that cannot be converted"),
    ({"prompt": "Hi", "use_beam_search": True}, "use_beam_search=True is not supported by streamq: beam search"),
    ({"prompt": "Hi", "truncate_prompt_tokens": -2}, "truncate_prompt_tokens must be an integer of -1 or more"),
    ({"prompt": "Hi", "truncate_prompt_tokens": 3, "truncation_side": "middle"}, "`truncation_side` must be"),
    ({"prompt": "Hi", "cache_salt": ""}, "'cache_salt' must be a non-empty string"),
    ({"prompt": "Hi", "cache_salt": "a/b"}, "cache_salt must be 1 to 128 characters"),
    ({"prompt": "Hi", "session_id": ""}, "session_id"),
    ({"prompt": "Hi", "suffix": "end"}, "suffix"),
]

TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}

BAD_CHATS: list[tuple[object, str]] = [
    ("text", "must be a JSON object"),
    ({}, "messages must be a non-empty list"),
    ({"messages": []}, "messages must be a non-empty list"),
    ({"messages": ["hi"]}, "messages[0] must be an object"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    (
        {"messages": [{"role": "assistant", "content": None, "tool_calls": [{"type": "custom", "custom": {}}]}]},
        "only support assistant tool_calls of type 'function'",
    ),
    ({"messages": [{"content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": "f()"}]}, "tool_calls must be a list"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": []}, "`tools` must not be an empty array"),
    ({"messages": [{"role": "user", "content": "x"}], "tool_choice": "auto"}, "`tools` must be set"),
    (
        {"messages": [{"role": "user", "content": "x"}], "tools": [TOOL], "tool_choice": "any"},
        "Invalid value for `tool_choice`",
    ),
    (
        {"messages": [{"role": "user", "content": "x"}], "tools": [TOOL], "tool_choice": {"function": {"name": "g"}}},
        "does not match any of the specified `tools`",
    ),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, "text content parts"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}, "tools"),
    ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "`logprobs` must be set to true"),
    ({"messages": [{"role": "user", "content": "x"}], "logprobs": False, "top_logprobs": 2}, "top_logprobs"),
    ({"messages": [{"role": "user", "content": "x"}], "logprobs": 1}, "logprobs"),
    ({"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 1.5}, "top_logprobs"),
    ({"messages": [{"role": "user", "content": "x"}], "prompt_logprobs": 2, "stream": True}, "prompt_logprobs"),
    ({"messages": [{"role": "user", "content": "x"}], "n": "two"}, "n"),
]


@pytest.mark.parametrize(("body", "expected"), COMPLETIONS)
def test_completion_body_maps_to_submit_kwargs(body: dict[str, Any], expected: dict[str, Any]) -> None:
    assert completion_request_to_submit_kwargs(body) == expected


@pytest.mark.parametrize(("body", "expected"), CHATS)
def test_chat_body_maps_to_submit_kwargs(body: dict[str, Any], expected: dict[str, Any]) -> None:
    assert chat_request_to_submit_kwargs(body) == expected


@pytest.mark.parametrize(("body", "reason"), BAD_COMPLETIONS)
def test_bad_completion_body_is_refused_with_its_reason(body: object, reason: str) -> None:
    with pytest.raises(InvalidRequest) as caught:
        completion_request_to_submit_kwargs(body)  # type: ignore[arg-type]
    assert reason in str(caught.value)


@pytest.mark.parametrize(("body", "reason"), BAD_CHATS)
def test_bad_chat_body_is_refused_with_its_reason(body: object, reason: str) -> None:
    with pytest.raises(InvalidRequest) as caught:
        chat_request_to_submit_kwargs(body)  # type: ignore[arg-type]
    assert reason in str(caught.value)


CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}]}
COMPLETION = {"model": "tiny", "prompt": "Hi"}


def test_a_completion_body_names_model_delivery_and_submit_arguments() -> None:
    parsed = parse_openai_body({**COMPLETION, "max_tokens": 4, "temperature": 0}, chat=False)
    assert (parsed.chat, parsed.model, parsed.stream, parsed.include_usage) == (False, "tiny", False, False)
    assert parsed.submit_kwargs == {"max_tokens": 4, "temperature": 0.0}
    assert parsed.submissions() == [{"prompt": "Hi", "max_tokens": 4, "temperature": 0.0}]


PROMPT_FORMS: list[tuple[object, list[object]]] = [
    ("Hi", ["Hi"]),
    (["Hi", "Yo"], ["Hi", "Yo"]),
    ([5, 6, 7], [[5, 6, 7]]),
    ([[5, 6], [7]], [[5, 6], [7]]),
]


@pytest.mark.parametrize(("prompt", "prompts"), PROMPT_FORMS)
def test_each_prompt_of_a_completion_body_is_a_request_of_its_own(prompt: object, prompts: list[object]) -> None:
    parsed = parse_openai_body({**COMPLETION, "prompt": prompt, "max_tokens": 2}, chat=False)
    assert parsed.submissions() == [{"prompt": p, "max_tokens": 2} for p in prompts]


def test_echo_asks_the_worker_for_the_prompt_and_its_logprobs_as_vllm_does() -> None:
    parsed = parse_openai_body({**COMPLETION, "echo": True, "logprobs": 1, "max_tokens": 0}, chat=False)
    assert parsed.submit_kwargs == {"echo": True, "logprobs": 1, "prompt_logprobs": 1, "max_tokens": 1}
    assert (parsed.shape.echo, parsed.shape.echo_only, parsed.shape.logprobs) == (True, True, 1)
    plain = parse_openai_body({**COMPLETION, "echo": True}, chat=False)
    assert plain.submit_kwargs == {"echo": True} and not plain.shape.echo_only


def test_vllms_extra_sampling_fields_reach_the_request() -> None:
    body = {
        **COMPLETION,
        "logit_bias": {"5": 2.5},
        "allowed_token_ids": [5, 6],
        "bad_words": ["no"],
        "spaces_between_special_tokens": False,
        "stream_interval": 4,
        "session_id": "conversation-9",
    }
    assert parse_openai_body(body, chat=False).submit_kwargs == {
        "logit_bias": {"5": 2.5},
        "allowed_token_ids": [5, 6],
        "bad_words": ["no"],
        "spaces_between_special_tokens": False,
        "stream_interval": 4,
        "affinity_key": "conversation-9",
    }


def test_a_chat_body_streams_with_usage_when_asked() -> None:
    parsed = parse_openai_body({**CHAT, "stream": True, "stream_options": {"include_usage": True}}, chat=True)
    assert (parsed.chat, parsed.stream, parsed.include_usage) == (True, True, True)
    assert parsed.submit_kwargs == {"messages": [{"role": "user", "content": "Hi"}]}


def test_usage_is_off_unless_include_usage_is_true() -> None:
    parsed = parse_openai_body({**CHAT, "stream": True, "stream_options": {"include_usage": False}}, chat=True)
    assert parsed.include_usage is False


@pytest.mark.parametrize("chat", [False, True])
def test_continuous_usage_stats_asks_for_the_prompt_back_to_count_it(chat: bool) -> None:
    options = {"include_usage": True, "continuous_usage_stats": True}
    parsed = parse_openai_body({**(CHAT if chat else COMPLETION), "stream": True, "stream_options": options}, chat=chat)
    assert (parsed.include_usage, parsed.shape.continuous_usage) == (True, True)
    assert parsed.submit_kwargs["return_prompt_token_ids"] is True  # the first chunk carries them, no text
    assert not parsed.shape.echo and not parsed.shape.token_ids  # which the response does not show
    assert parsed.submit_kwargs.get("reasoning_per_chunk", False) is chat  # a chat chunk's reasoning tokens too


def test_continuous_usage_stats_without_include_usage_is_off_as_in_vllm_serve() -> None:
    body = {**CHAT, "stream": True, "stream_options": {"continuous_usage_stats": True}}
    parsed = parse_openai_body(body, chat=True)
    assert (parsed.include_usage, parsed.shape.continuous_usage) == (False, False)
    assert "echo" not in parsed.submit_kwargs and "return_prompt_token_ids" not in parsed.submit_kwargs


def test_stream_options_is_ignored_when_empty_or_unknown_keys() -> None:
    assert parse_openai_body({**COMPLETION, "stream_options": {}}, chat=False).include_usage is False
    parsed = parse_openai_body({**CHAT, "stream": True, "stream_options": {"verbose": True}}, chat=True)
    assert parsed.include_usage is False


UNKNOWN_FIELDS: list[tuple[dict[str, Any], bool, str]] = [
    ({**COMPLETION, "frobnicate": 1}, False, "frobnicate"),
    ({**COMPLETION, "messages": []}, False, "messages"),
    ({**COMPLETION, "max_completion_tokens": 5}, False, "max_completion_tokens"),
    ({**CHAT, "prompt": "x"}, True, "prompt"),
    ({**CHAT, "frobnicate": 1}, True, "frobnicate"),
    (
        {"model": "tiny", "messages": [{"role": "user", "content": "x", "audio": {"id": "a"}}]},
        True,
        "messages[0].audio",
    ),
]


@pytest.mark.parametrize(("body", "chat", "name"), UNKNOWN_FIELDS)
def test_an_unknown_field_is_ignored_and_logged_as_vllm_serve_does(
    body: dict[str, Any], chat: bool, name: str, caplog: pytest.LogCaptureFixture
) -> None:
    known = {k: v for k, v in body.items() if k != name}
    if chat:
        known["messages"] = [{k: v for k, v in m.items() if k in ("role", "content")} for m in body["messages"]]
    with caplog.at_level(logging.WARNING, logger="producer.openai_api.requests"):
        parsed = parse_openai_body(body, chat=chat)
    assert parsed.submit_kwargs == parse_openai_body(known, chat=chat).submit_kwargs
    ignored = [r for r in caplog.records if "present in the request but ignored" in r.getMessage()]
    assert len(ignored) == 1 and name in ignored[0].getMessage()


@pytest.mark.parametrize(("body", "chat", "name"), UNKNOWN_FIELDS)
def test_an_unknown_field_is_refused_when_the_gateway_rejects_them(body: dict[str, Any], chat: bool, name: str) -> None:
    with pytest.raises(InvalidRequest, match="unsupported field") as caught:
        parse_openai_body(body, chat=chat, limits=RequestLimits(reject_unknown_fields=True))
    assert name in str(caught.value)


def test_a_message_sent_back_with_its_empty_response_fields_is_not_unknown() -> None:
    message = {"role": "assistant", "content": "x", "refusal": None, "audio": None, "annotations": None}
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}, message]}
    parse_openai_body(body, chat=True, limits=RequestLimits(reject_unknown_fields=True))


BAD_BODIES: list[tuple[object, bool, str]] = [
    (["not", "an", "object"], False, "must be a JSON object, got list"),
    ({"prompt": "Hi"}, False, "'model' is required"),
    ({**COMPLETION, "model": ""}, False, "'model' is required"),
    ({**COMPLETION, "model": 7}, False, "'model' is required"),
    ({**COMPLETION, "stream": "yes"}, False, "'stream' must be true or false"),
    ({**COMPLETION, "stream_options": {"include_usage": True}}, False, "only be defined when `stream=True`"),
    ({**CHAT, "stream": True, "stream_options": ["include_usage"]}, True, "'stream_options' must be an object"),
    ({**CHAT, "stream": True, "stream_options": {"include_usage": 1}}, True, "include_usage must be true or false"),
    ({**COMPLETION, "suffix": "end"}, False, "suffix='end' is not supported"),
    ({**CHAT, "tools": [{"type": "function"}]}, True, "tools[0] must be"),
    ({"model": "tiny", "messages": [{"role": "user", "content": {"text": "x"}}]}, True, "messages[0].content"),
    ({"model": "tiny", "messages": "Hi"}, True, "messages must be a non-empty list"),
]


@pytest.mark.parametrize(("body", "chat", "reason"), BAD_BODIES)
def test_a_bad_body_is_refused_naming_what_is_wrong(body: Any, chat: bool, reason: str) -> None:
    with pytest.raises(InvalidRequest) as caught:
        parse_openai_body(body, chat=chat)
    assert reason in str(caught.value)


# --- the fields vllm serve honours that the queue carries to the worker ---------------------
def test_truncation_and_the_cache_salt_go_to_the_worker_with_the_prompt() -> None:
    body = {"prompt": "Hi", "truncate_prompt_tokens": 5, "truncation_side": "left", "cache_salt": "tenant-a"}
    assert completion_request_to_submit_kwargs(body) == {
        "prompt": "Hi",
        "truncate_prompt_tokens": 5,
        "truncation_side": "left",
        "cache_salt": "tenant-a",
    }
    chat = {**CHAT, "truncate_prompt_tokens": -1, "cache_salt": "s"}
    kwargs = chat_request_to_submit_kwargs(chat)
    assert (kwargs["truncate_prompt_tokens"], kwargs["cache_salt"]) == (-1, "s")


@pytest.mark.parametrize(
    ("body", "kwargs"),
    [
        ({"reasoning_effort": "low"}, {"reasoning_effort": "low", "enable_thinking": True}),
        ({"reasoning_effort": "none"}, {"reasoning_effort": "none", "enable_thinking": False}),
        (
            {"reasoning_effort": "high", "chat_template_kwargs": {"enable_thinking": False, "reasoning_effort": "x"}},
            {"reasoning_effort": "high", "enable_thinking": False},
        ),
    ],
)
def test_reasoning_effort_is_a_template_variable_as_vllm_serve_passes_it(
    body: dict[str, Any], kwargs: dict[str, Any]
) -> None:
    assert chat_request_to_submit_kwargs({**CHAT, **body})["chat_options"] == {"kwargs": kwargs}


def test_a_reasoning_effort_vllm_serve_does_not_know_is_refused() -> None:
    with pytest.raises(InvalidRequest, match="reasoning_effort must be one of"):
        chat_request_to_submit_kwargs({**CHAT, "reasoning_effort": "extreme"})


def test_include_reasoning_false_goes_to_the_worker_and_hides_the_reasoning_tokens() -> None:
    parsed = parse_openai_body({**CHAT, "include_reasoning": False}, chat=True)
    assert parsed.submit_kwargs["include_reasoning"] is False and parsed.shape.hide_reasoning
    default = parse_openai_body({**CHAT, "include_reasoning": True}, chat=True)
    assert "include_reasoning" not in default.submit_kwargs and not default.shape.hide_reasoning


def test_return_prompt_text_asks_the_worker_for_the_prompt() -> None:
    parsed = parse_openai_body({**CHAT, "return_prompt_text": True}, chat=True)
    assert parsed.shape.prompt_text and parsed.submit_kwargs["echo"] is True


def test_a_request_id_in_the_body_names_the_request() -> None:
    assert parse_openai_body({**COMPLETION, "request_id": "mine-1"}, chat=False).request_id == "mine-1"
    assert parse_openai_body(CHAT, chat=True).request_id is None


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        ({**COMPLETION, "request_id": "has space"}, "request_id must match"),
        ({**COMPLETION, "request_id": 7}, "request_id must match"),
        ({**COMPLETION, "prompt": ["a", "b"], "request_id": "mine"}, "request_id names one request"),
    ],
)
def test_a_bad_request_id_in_the_body_is_refused(body: dict[str, Any], reason: str) -> None:
    with pytest.raises(InvalidRequest, match=reason):
        parse_openai_body(body, chat=False)


def test_logprob_token_ids_ask_for_those_tokens_instead_of_the_most_likely() -> None:
    chat = parse_openai_body({**CHAT, "logprobs": True, "top_logprobs": 2, "logprob_token_ids": [5, 9]}, chat=True)
    assert chat.submit_kwargs["logprob_token_ids"] == [5, 9] and "logprobs" not in chat.submit_kwargs
    assert chat.shape.every_logprob
    completion = parse_openai_body({**COMPLETION, "logprobs": 1, "logprob_token_ids": [5]}, chat=False)
    assert completion.submit_kwargs["logprob_token_ids"] == [5] and "logprobs" not in completion.submit_kwargs
    assert completion.shape.logprobs is None  # every entry a position has
    without = parse_openai_body({**COMPLETION, "logprob_token_ids": [5]}, chat=False)
    assert "logprob_token_ids" not in without.submit_kwargs  # no logprobs asked for: vllm serve shows none


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        ({**CHAT, "logprob_token_ids": [5]}, "`logprobs` must be set to true"),
        ({**CHAT, "logprobs": True, "logprob_token_ids": ["a"]}, "must be a list of token ids"),
    ],
)
def test_bad_logprob_token_ids_are_refused(body: dict[str, Any], reason: str) -> None:
    with pytest.raises(InvalidRequest, match=reason):
        parse_openai_body(body, chat=True)


def test_a_message_without_content_is_rendered_empty_as_vllm_serve_renders_it() -> None:
    kwargs = chat_request_to_submit_kwargs({"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant"}]})
    assert kwargs["messages"][1] == {"role": "assistant", "content": ""}


def test_content_parts_vllm_reads_as_text_are_rendered_as_its_text_and_media_refused() -> None:
    """vLLM reads a refusal, a thinking part and the Responses API's text parts as text, and
    skips a text or refusal part without its text (``vllm/renderers/chat_utils.py``); the
    parts join by newlines, as vLLM renders them for a template that takes a string."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from vllm.renderers.chat_utils import PART_TYPES_TO_SKIP_NONE_CONTENT, TEXT_PART_TYPES
    assert set(TEXT_PARTS) == TEXT_PART_TYPES and set(PART_TYPES_TO_SKIP_NONE_CONTENT) == SKIPPED_WHEN_EMPTY
    parts = [
        "plain",
        {"type": "text", "text": "a"},
        {"type": "refusal", "refusal": "no"},
        {"type": "thinking", "thinking": "hm"},
        {"type": "output_text", "text": "b"},
        {"type": "text"},
        {"type": "refusal", "refusal": None},
    ]
    kwargs = chat_request_to_submit_kwargs({"messages": [{"role": "assistant", "content": parts}]})
    assert kwargs["messages"][0]["content"] == "plain\na\nno\nhm\nb"
    for bad in ({"type": "thinking"}, {"type": "text", "text": 5}, {"type": "input_audio", "input_audio": {}}):
        with pytest.raises(InvalidRequest, match=r"messages\[0\]\.content\[0\]: only text content parts"):
            chat_request_to_submit_kwargs({"messages": [{"role": "user", "content": [bad]}]})


@pytest.mark.parametrize(
    ("field", "value", "key", "expected"),
    [
        ("max_tokens", 16.0, "max_tokens", 16),
        ("max_completion_tokens", 8.0, "max_tokens", 8),
        ("stream_interval", 1.0, "stream_interval", 1),
        ("seed", 3.0, "seed", 3),
        ("top_k", 5.0, "top_k", 5),
        ("priority", 2.0, "priority", 2),
        ("truncate_prompt_tokens", 5.0, "truncate_prompt_tokens", 5),
    ],
)
def test_a_whole_float_in_an_integer_field_is_taken_as_vllm_serve_takes_it(
    field: str, value: float, key: str, expected: int
) -> None:
    """JSON Schema's ``integer`` allows ``16.0``, and vllm serve's pydantic models take it as 16."""
    kwargs = chat_request_to_submit_kwargs({"messages": [{"role": "user", "content": "hi"}], field: value})
    assert kwargs[key] == expected and type(kwargs[key]) is int


def test_a_fractional_float_in_an_integer_field_is_refused() -> None:
    with pytest.raises(InvalidRequest, match="top_k"):
        chat_request_to_submit_kwargs({"messages": [{"role": "user", "content": "hi"}], "top_k": 5.5})


@pytest.mark.parametrize(
    "fields",
    [{"chat_template": ""}, {"chat_template": "{{ messages }}"}, {"chat_template_kwargs": {"chat_template": ""}}],
)
def test_a_request_s_own_chat_template_is_refused_even_empty(fields: dict[str, Any]) -> None:
    """``vllm serve`` refuses any template a request brings (``is not None``) unless it is
    started with ``--trust-request-chat-template``; the workers never trust one."""
    with pytest.raises(InvalidRequest, match="chat_template"):
        chat_request_to_submit_kwargs({"messages": [{"role": "user", "content": "hi"}], **fields})
