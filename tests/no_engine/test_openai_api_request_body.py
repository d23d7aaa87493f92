"""A body the gateway serves: model, delivery and the submit arguments, or a 400 naming what is wrong.

The mapping of sampling fields and messages is checked in test_openai_api_requests.py.
"""

from __future__ import annotations

from typing import Any

import pytest

from producer.openai_api.requests import parse_openai_body
from streamq.protocol import InvalidRequest

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}]}
COMPLETION = {"model": "tiny", "prompt": "Hi"}


def test_a_completion_body_names_model_delivery_and_submit_arguments() -> None:
    parsed = parse_openai_body({**COMPLETION, "max_tokens": 4, "temperature": 0}, chat=False)
    assert (parsed.chat, parsed.model, parsed.stream, parsed.include_usage) == (False, "tiny", False, False)
    assert parsed.submit_kwargs == {"prompt": "Hi", "max_tokens": 4, "temperature": 0.0}


def test_a_chat_body_streams_with_usage_when_asked() -> None:
    parsed = parse_openai_body({**CHAT, "stream": True, "stream_options": {"include_usage": True}}, chat=True)
    assert (parsed.chat, parsed.stream, parsed.include_usage) == (True, True, True)
    assert parsed.submit_kwargs == {"messages": [{"role": "user", "content": "Hi"}]}


def test_usage_is_off_unless_include_usage_is_true() -> None:
    parsed = parse_openai_body({**CHAT, "stream": True, "stream_options": {"include_usage": False}}, chat=True)
    assert parsed.include_usage is False


BAD: list[tuple[object, bool, str]] = [
    (["not", "an", "object"], False, "must be a JSON object, got list"),
    ({"prompt": "Hi"}, False, "'model' is required"),
    ({**COMPLETION, "model": ""}, False, "'model' is required"),
    ({**COMPLETION, "model": 7}, False, "'model' is required"),
    ({**COMPLETION, "stream": "yes"}, False, "'stream' must be true or false"),
    ({**COMPLETION, "stream_options": {"include_usage": True}}, False, "only allowed with stream=true"),
    ({**CHAT, "stream": True, "stream_options": {"verbose": True}}, True, "takes only include_usage"),
    ({**CHAT, "stream": True, "stream_options": ["include_usage"]}, True, "takes only include_usage"),
    ({**CHAT, "stream": True, "stream_options": {"continuous_usage_stats": True}}, True, "continuous_usage_stats"),
    ({**CHAT, "frobnicate": 1}, True, "unsupported field(s) for /v1/chat/completions: frobnicate"),
    ({**COMPLETION, "echo": True}, False, "echo=True is not supported"),
    ({**CHAT, "tools": [{"type": "function"}]}, True, "tools="),
    ({"model": "tiny", "messages": [{"role": "user"}]}, True, "messages[0].content"),
    ({"model": "tiny", "messages": "Hi"}, True, "messages must be a non-empty list"),
]


@pytest.mark.parametrize(("body", "chat", "reason"), BAD)
def test_a_bad_body_is_refused_naming_what_is_wrong(body: Any, chat: bool, reason: str) -> None:
    with pytest.raises(InvalidRequest) as caught:
        parse_openai_body(body, chat=chat)
    assert reason in str(caught.value)
