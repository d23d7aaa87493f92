"""Whole (non-streamed) responses and the model list, in the shape OpenAI clients read
and `vllm serve` returns (checked against vLLM's own response models)."""

from __future__ import annotations

import dataclasses
import time
import warnings

from producer.client import Completion
from producer.openai_api.endpoints import CHAT_COMPLETIONS, COMPLETIONS, ENDPOINTS
from producer.openai_api.responses import (
    SYSTEM_FINGERPRINT,
    chat_completion_response,
    completion_response,
    model_list,
)
from streamq.protocol import ParsedOutput, WorkerRegistration

with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)  # torch's own, raised while vLLM imports
    from vllm.entrypoints.openai.chat_completion import protocol as chat_protocol
    from vllm.entrypoints.openai.completion import protocol as completion_protocol

COMPLETION = Completion(
    request_id="r7",
    texts=["one", "two"],
    token_ids=[[1], [2, 3]],
    finish_reasons=["length", "stop"],
    prompt_tokens=4,
    completion_tokens=3,
)


def test_a_completion_response_has_one_choice_per_completion_and_the_usage() -> None:
    body = completion_response([COMPLETION], model="tiny", created=9)
    assert list(body) == [
        "id",
        "object",
        "created",
        "model",
        "choices",
        "service_tier",
        "system_fingerprint",
        "usage",
        "kv_transfer_params",
        "ec_transfer_params",
        "metrics",
    ]
    assert (body["id"], body["object"], body["created"], body["model"]) == ("cmpl-r7", "text_completion", 9, "tiny")
    assert [(c["index"], c["text"], c["finish_reason"]) for c in body["choices"]] == [
        (0, "one", "length"),
        (1, "two", "stop"),
    ]
    assert list(body["choices"][0]) == [
        "index",
        "text",
        "logprobs",
        "finish_reason",
        "stop_reason",
        "token_ids",
        "prompt_logprobs",
        "prompt_token_ids",
        "routed_experts",
    ]
    assert body["system_fingerprint"] == SYSTEM_FINGERPRINT
    assert body["usage"] == {
        "prompt_tokens": 4,
        "total_tokens": 7,
        "completion_tokens": 3,
        "prompt_tokens_details": None,
        "completion_tokens_details": None,
    }


def test_a_chat_response_answers_as_the_assistant() -> None:
    body = chat_completion_response([COMPLETION], model="tiny", created=9)
    assert (body["id"], body["object"]) == ("chatcmpl-r7", "chat.completion")
    assert [(c["message"]["role"], c["message"]["content"]) for c in body["choices"]] == [
        ("assistant", "one"),
        ("assistant", "two"),
    ]
    assert list(body["choices"][0]["message"]) == [
        "role",
        "content",
        "refusal",
        "annotations",
        "audio",
        "function_call",
        "reasoning",
    ]
    assert [k for k in body if k not in completion_response([COMPLETION], model="tiny")] == [
        "prompt_logprobs",
        "prompt_token_ids",
        "prompt_text",
    ]
    assert body["usage"]["total_tokens"] == 7


def test_created_defaults_to_now() -> None:
    before = int(time.time())
    assert before <= completion_response([COMPLETION], model="tiny")["created"] <= int(time.time())


def test_each_endpoint_builds_its_own_response() -> None:
    assert list(ENDPOINTS) == [
        "/v1/completions",
        "/v1/chat/completions",
        "/v1/embeddings",
        "/score",
        "/v1/score",
        "/rerank",
        "/v1/rerank",
    ]
    assert COMPLETIONS.to_response([COMPLETION], model="m")["object"] == "text_completion"
    assert CHAT_COMPLETIONS.to_response([COMPLETION], model="m")["object"] == "chat.completion"
    assert CHAT_COMPLETIONS.to_submit_kwargs({"messages": [{"role": "user", "content": "x"}]}) == {
        "messages": [{"role": "user", "content": "x"}]
    }


def worker(model: str, max_model_len: int | None) -> WorkerRegistration:
    return WorkerRegistration(
        worker_id=f"w-{model}-{max_model_len}", model=model, queue=f"q:{model}", max_model_len=max_model_len
    )


def test_the_model_list_names_each_model_once_with_its_worker_count() -> None:
    body = model_list([worker("a", 512), worker("b", None), worker("a", 512)])
    assert body["object"] == "list"
    assert body["data"] == [
        {
            "id": "a",
            "object": "model",
            "created": 0,
            "owned_by": "streamq",
            "root": "a",
            "max_model_len": 512,
            "workers": 2,
        },
        {"id": "b", "object": "model", "created": 0, "owned_by": "streamq", "root": "b", "workers": 1},
    ]


def test_completion_response_has_the_shape_vllm_serve_returns() -> None:
    body = completion_response([COMPLETION], model="tiny", created=123)
    parsed = completion_protocol.CompletionResponse.model_validate(body)
    assert parsed.id == "cmpl-r7" and parsed.object == "text_completion" and parsed.created == 123
    assert [(c.index, c.text, c.finish_reason) for c in parsed.choices] == [(0, "one", "length"), (1, "two", "stop")]
    assert (parsed.usage.prompt_tokens, parsed.usage.completion_tokens, parsed.usage.total_tokens) == (4, 3, 7)


def test_chat_completion_response_has_the_shape_vllm_serve_returns() -> None:
    body = chat_completion_response([COMPLETION], model="tiny")
    parsed = chat_protocol.ChatCompletionResponse.model_validate(body)
    assert parsed.id == "chatcmpl-r7" and parsed.object == "chat.completion" and parsed.model == "tiny"
    assert [(c.message.role, c.message.content, c.finish_reason) for c in parsed.choices] == [
        ("assistant", "one", "length"),
        ("assistant", "two", "stop"),
    ]
    assert parsed.usage.total_tokens == 7


def test_a_chat_response_gives_the_message_the_workers_parser_read() -> None:
    """Completion 0 called a tool (the parser's whole message, its finish reason
    ``tool_calls``); completion 1 was read as reasoning; both counted reasoning tokens."""
    call = {"id": "call-1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    parsed = [
        ParsedOutput(message={"role": "assistant", "content": None, "tool_calls": [call]}, finish_reason="tool_calls"),
        ParsedOutput(message={"role": "assistant", "content": None, "reasoning": "two"}, reasoning_tokens=2),
    ]
    body = chat_completion_response([dataclasses.replace(COMPLETION, parsed=parsed)], model="tiny")
    response = chat_protocol.ChatCompletionResponse.model_validate(body)
    first, second = response.choices
    assert first.finish_reason == "tool_calls" and first.message.content is None
    assert [c.model_dump() for c in first.message.tool_calls] == [call]
    assert (second.message.reasoning, second.message.content, second.finish_reason) == ("two", None, "stop")
    assert body["usage"]["completion_tokens_details"] == {"reasoning_tokens": 2}
