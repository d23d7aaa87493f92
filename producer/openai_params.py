"""OpenAI request bodies to streamq requests, and completions back to OpenAI response bodies.

The batch command (``producer/batch.py``) and the OpenAI-compatible gateway both
speak OpenAI on the outside and ``StreamqClient.submit`` on the inside; this
module is the one place that translates, so the two cannot drift apart. The
gateway should reuse it rather than map parameters itself.

Requests: ``completion_request_to_submit_kwargs`` and
``chat_request_to_submit_kwargs`` turn a ``/v1/completions`` or
``/v1/chat/completions`` body into keyword arguments for ``submit``. A field
streamq cannot honour raises ``InvalidRequest`` naming it, rather than being
dropped silently: a client asking for logprobs or tools must learn it gets none.
Fields that only steer the transport (``model``, ``stream``, ``stream_options``,
``user``) are accepted and left to the caller: it routes by model and chooses
how to deliver. Values are range-checked by vLLM on the worker, as for every
streamq request.

Responses: ``completion_response`` and ``chat_completion_response`` build the
non-streaming bodies in the shape ``vllm serve`` returns (its pydantic models'
fields that carry something here, plus the ``null`` ones OpenAI clients read).

Imports neither vllm nor torch: the producer side must install without them.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any, Final

import msgspec

from producer.client import Completion
from streamq.protocol import InvalidRequest, SamplingOptions

TRANSPORT_FIELDS: Final = frozenset({"model", "stream", "stream_options", "user"})
"""Accepted in a body but not mapped here: the caller routes and streams."""

# OpenAI (and vLLM-extension) names that map one to one onto ``SamplingOptions``.
_SAMPLING_FIELDS: Final = frozenset(
    {
        "temperature",
        "top_p",
        "n",
        "seed",
        "presence_penalty",
        "frequency_penalty",
        # vLLM's extensions to the OpenAI API, spelled as `vllm serve` takes them.
        "top_k",
        "min_p",
        "repetition_penalty",
        "min_tokens",
        "ignore_eos",
        "stop_token_ids",
        "skip_special_tokens",
        "include_stop_str_in_output",
    }
)


def _is_off(value: Any) -> bool:
    """The neutral values of a feature streamq does not offer (asking for nothing)."""
    return value is None or value is False or value == 0 or value == {} or value == []


# Fields OpenAI defines that streamq cannot honour: accepted only with a value that
# asks for nothing, so that clients sending their defaults still work.
_UNSUPPORTED_COMMON: Final[dict[str, Callable[[Any], bool]]] = {
    "logprobs": lambda v: v is None or v is False,  # 0 still asks for the sampled token's
    "logit_bias": _is_off,
}
_UNSUPPORTED_COMPLETION: Final[dict[str, Callable[[Any], bool]]] = {
    **_UNSUPPORTED_COMMON,
    "echo": _is_off,
    "suffix": lambda v: v is None or v == "",
    "best_of": lambda v: True,  # checked against n below
}
_UNSUPPORTED_CHAT: Final[dict[str, Callable[[Any], bool]]] = {
    **_UNSUPPORTED_COMMON,
    "top_logprobs": _is_off,
    "tools": _is_off,
    "tool_choice": lambda v: v is None or v == "none",
    "parallel_tool_calls": lambda v: True,  # meaningless without tools
    "functions": _is_off,
    "function_call": lambda v: v is None or v == "none",
    "response_format": lambda v: v is None or v == {"type": "text"},
}


def completion_request_to_submit_kwargs(body: Mapping[str, Any]) -> dict[str, Any]:
    """``StreamqClient.submit`` keyword arguments for a ``/v1/completions`` body.

    ``prompt`` must be one string (or a list holding one string). Without
    ``max_tokens`` vLLM's default (16) applies, as OpenAI's does.
    """
    body = _require_object(body)
    known = {"prompt", "max_tokens", "stop", *_SAMPLING_FIELDS, *TRANSPORT_FIELDS, *_UNSUPPORTED_COMPLETION}
    _reject_unknown(body, known, "/v1/completions")
    _reject_unsupported(body, _UNSUPPORTED_COMPLETION)
    best_of = body.get("best_of")
    if best_of is not None and best_of != body.get("n", 1):
        raise InvalidRequest("best_of is not supported (only best_of equal to n)")
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    if not isinstance(prompt, str):
        raise InvalidRequest("prompt must be a string (one prompt per request; token-id prompts are not supported)")
    return {"prompt": prompt, **_sampling(body, max_tokens=body.get("max_tokens"))}


def chat_request_to_submit_kwargs(body: Mapping[str, Any]) -> dict[str, Any]:
    """``StreamqClient.submit`` keyword arguments for a ``/v1/chat/completions`` body.

    Message content may be a string or a list of ``{"type": "text"}`` parts (joined).
    ``max_completion_tokens`` wins over the older ``max_tokens``, as in vLLM.
    Without either, vLLM's default (16 tokens) applies, where ``vllm serve`` would
    fill the model's context: the producer does not know the model's length.
    """
    body = _require_object(body)
    known = {
        "messages",
        "max_tokens",
        "max_completion_tokens",
        "stop",
        *_SAMPLING_FIELDS,
        *TRANSPORT_FIELDS,
        *_UNSUPPORTED_CHAT,
    }
    _reject_unknown(body, known, "/v1/chat/completions")
    _reject_unsupported(body, _UNSUPPORTED_CHAT)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise InvalidRequest("messages must be a non-empty list of {role, content} objects")
    max_tokens = body.get("max_completion_tokens")
    if max_tokens is None:
        max_tokens = body.get("max_tokens")
    return {"messages": [_message(m, i) for i, m in enumerate(messages)], **_sampling(body, max_tokens=max_tokens)}


def completion_response(completion: Completion, *, model: str, created: int | None = None) -> dict[str, Any]:
    """The non-streaming ``/v1/completions`` response body for ``completion``."""
    choices = [
        {"index": i, "text": text, "logprobs": None, "finish_reason": reason, "stop_reason": None}
        for i, (text, reason) in enumerate(zip(completion.texts, completion.finish_reasons, strict=True))
    ]
    return _response(completion, "cmpl-", "text_completion", model, created, choices)


def chat_completion_response(completion: Completion, *, model: str, created: int | None = None) -> dict[str, Any]:
    """The non-streaming ``/v1/chat/completions`` response body for ``completion``."""
    choices = [
        {
            "index": i,
            "message": {"role": "assistant", "content": text, "refusal": None},
            "logprobs": None,
            "finish_reason": reason,
            "stop_reason": None,
        }
        for i, (text, reason) in enumerate(zip(completion.texts, completion.finish_reasons, strict=True))
    ]
    return _response(completion, "chatcmpl-", "chat.completion", model, created, choices)


def _response(
    completion: Completion, id_prefix: str, kind: str, model: str, created: int | None, choices: list[dict[str, Any]]
) -> dict[str, Any]:
    # The id carries the request id, so a response can be traced to its replay log.
    return {
        "id": id_prefix + completion.request_id,
        "object": kind,
        "created": int(time.time()) if created is None else created,
        "model": model,
        "choices": choices,
        "system_fingerprint": None,
        "usage": {
            "prompt_tokens": completion.prompt_tokens,
            "completion_tokens": completion.completion_tokens,
            "total_tokens": completion.prompt_tokens + completion.completion_tokens,
            "prompt_tokens_details": None,
        },
    }


def _require_object(body: object) -> Mapping[str, Any]:
    if not isinstance(body, Mapping):
        raise InvalidRequest(f"the request body must be a JSON object, got {type(body).__name__}")
    return body


def _reject_unknown(body: Mapping[str, Any], known: set[str], endpoint: str) -> None:
    unknown = sorted(set(body) - known)
    if unknown:
        raise InvalidRequest(f"unsupported field(s) for {endpoint}: {', '.join(unknown)}")


def _reject_unsupported(body: Mapping[str, Any], neutral: Mapping[str, Callable[[Any], bool]]) -> None:
    for name, is_neutral in neutral.items():
        if name in body and not is_neutral(body[name]):
            raise InvalidRequest(f"{name}={body[name]!r} is not supported by streamq")


def _sampling(body: Mapping[str, Any], *, max_tokens: Any) -> dict[str, Any]:
    """Sampling fields, type-checked now (a bad type fails here, not on a worker)."""
    fields = {name: body[name] for name in _SAMPLING_FIELDS if body.get(name) is not None}
    if max_tokens is not None:
        fields["max_tokens"] = max_tokens
    stop = body.get("stop")
    if stop is not None:
        fields["stop"] = [stop] if isinstance(stop, str) else stop
    try:
        return msgspec.convert(fields, SamplingOptions).to_dict()
    except msgspec.ValidationError as exc:
        raise InvalidRequest(str(exc)) from None


def _message(message: object, position: int) -> dict[str, str]:
    where = f"messages[{position}]"
    if not isinstance(message, Mapping):
        raise InvalidRequest(f"{where} must be an object with role and content")
    unknown = sorted(set(message) - {"role", "content", "name"})
    if unknown:
        raise InvalidRequest(f"{where}: unsupported field(s): {', '.join(unknown)}")
    role, content = message.get("role"), message.get("content")
    if not isinstance(role, str):
        raise InvalidRequest(f"{where}.role must be a string")
    if isinstance(content, list):
        content = "".join(_text_part(part, f"{where}.content[{j}]") for j, part in enumerate(content))
    if not isinstance(content, str):
        raise InvalidRequest(f"{where}.content must be a string or a list of text parts")
    return {"role": role, "content": content}


def _text_part(part: object, where: str) -> str:
    if not isinstance(part, Mapping) or part.get("type") != "text" or not isinstance(part.get("text"), str):
        raise InvalidRequest(f"{where}: only text content parts ({{'type': 'text', 'text': ...}}) are supported")
    return str(part["text"])
