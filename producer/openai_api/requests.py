"""OpenAI request bodies to ``StreamqClient.submit`` keyword arguments.

A field streamq cannot honour raises ``InvalidRequest`` naming it rather than being
dropped: a client asking for tools must learn it gets none. Values are
range-checked by vLLM on the worker, as for every streamq request, after the bounds of
``limits.RequestLimits`` (``n``, stop strings, messages) are checked here.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Final

import msgspec

from producer.openai_api.limits import DEFAULT_LIMITS, RequestLimits
from producer.openai_api.logprobs import (
    CHAT_LOGPROBS_FIELDS,
    COMPLETION_LOGPROBS_FIELDS,
    LOGPROBS_SAMPLING,
    chat_sampling,
    completion_sampling,
)
from producer.openai_api.structured import STRUCTURED_FIELDS, structured_outputs_of
from streamq.protocol import InvalidRequest, Sampling
from streamq.protocol.names import MAX_PRIORITY, MIN_PRIORITY

TRANSPORT_FIELDS: Final = frozenset({"model", "stream", "stream_options", "user"})
"""Accepted in a body but not mapped to ``submit`` arguments: they say where and how to deliver."""

# OpenAI (and vLLM-extension) names that map one to one onto ``Sampling``.
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


QUEUE_FIELDS: Final = frozenset({"priority"})
"""vLLM's ``priority`` (lower runs sooner): streamq orders its queue by it, and a worker
started with ``--scheduling-policy priority`` passes it to the engine too."""


def _queue_fields(body: Mapping[str, Any]) -> dict[str, Any]:
    """``submit``'s ``priority``, checked here (vLLM takes an integer; streamq's is 32-bit)."""
    priority = body.get("priority")
    if priority is None:
        return {}
    if not isinstance(priority, int) or isinstance(priority, bool) or not MIN_PRIORITY <= priority <= MAX_PRIORITY:
        raise InvalidRequest(f"priority must be an integer from {MIN_PRIORITY} to {MAX_PRIORITY}, got {priority!r}")
    return {"priority": priority}


def _is_off(value: Any) -> bool:
    """The neutral values of a feature streamq does not offer (asking for nothing)."""
    return value is None or value is False or value == 0 or value == {} or value == []


# Fields OpenAI defines that streamq cannot honour: accepted only with a value that
# asks for nothing, so that clients sending their defaults still work.
_UNSUPPORTED_COMMON: Final[dict[str, Callable[[Any], bool]]] = {
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
    "tools": _is_off,
    "tool_choice": lambda v: v is None or v == "none",
    "parallel_tool_calls": lambda v: True,  # meaningless without tools
    "functions": _is_off,
    "function_call": lambda v: v is None or v == "none",
}


def completion_request_to_submit_kwargs(
    body: Mapping[str, Any], *, limits: RequestLimits = DEFAULT_LIMITS
) -> dict[str, Any]:
    """``StreamqClient.submit`` keyword arguments for a ``/v1/completions`` body.

    ``prompt`` must be one string (or a list holding one string). Without
    ``max_tokens`` vLLM's default (16) applies, as OpenAI's does.
    """
    body = _require_object(body)
    known = {
        "prompt",
        "max_tokens",
        "stop",
        *_SAMPLING_FIELDS,
        *TRANSPORT_FIELDS,
        *QUEUE_FIELDS,
        *_UNSUPPORTED_COMPLETION,
    }
    known |= COMPLETION_LOGPROBS_FIELDS | STRUCTURED_FIELDS
    _reject_unknown(body, known, "/v1/completions")
    _reject_unsupported(body, _UNSUPPORTED_COMPLETION)
    best_of = body.get("best_of")
    if best_of is not None and best_of != body.get("n", 1):
        raise InvalidRequest("best_of is not supported (only best_of equal to n)")
    limits.check_sampling(body)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    if not isinstance(prompt, str):
        raise InvalidRequest("prompt must be a string (one prompt per request; token-id prompts are not supported)")
    sampling = _sampling({**body, **completion_sampling(body)}, max_tokens=body.get("max_tokens"))
    return {"prompt": prompt, **sampling, **_queue_fields(body)}


def chat_request_to_submit_kwargs(body: Mapping[str, Any], *, limits: RequestLimits = DEFAULT_LIMITS) -> dict[str, Any]:
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
        *QUEUE_FIELDS,
        *_UNSUPPORTED_CHAT,
        *CHAT_LOGPROBS_FIELDS,
        *STRUCTURED_FIELDS,
    }
    _reject_unknown(body, known, "/v1/chat/completions")
    _reject_unsupported(body, _UNSUPPORTED_CHAT)
    limits.check_sampling(body)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise InvalidRequest("messages must be a non-empty list of {role, content} objects")
    limits.check_messages(messages)
    max_tokens = body.get("max_completion_tokens")
    if max_tokens is None:
        max_tokens = body.get("max_tokens")
    chat = [_message(m, i) for i, m in enumerate(messages)]
    limits.check_message_lengths(chat)
    return {
        "messages": chat,
        **_sampling({**body, **chat_sampling(body)}, max_tokens=max_tokens),
        **_queue_fields(body),
    }


@dataclass(frozen=True)
class OpenAIRequest:
    """One ``/v1/completions`` or ``/v1/chat/completions`` body as the gateway serves it, validated."""

    chat: bool
    model: str
    stream: bool
    include_usage: bool
    submit_kwargs: dict[str, Any]
    """``StreamqClient.submit`` keyword arguments: prompt or messages, sampling."""

    @property
    def n(self) -> int:
        """How many completions the request asks for."""
        return int(self.submit_kwargs.get("n") or 1)


def parse_openai_body(body: object, *, chat: bool, limits: RequestLimits = DEFAULT_LIMITS) -> OpenAIRequest:
    """Validate a decoded JSON body that must name its model; raises ``InvalidRequest``."""
    if not isinstance(body, dict):
        raise InvalidRequest(f"the request body must be a JSON object, got {type(body).__name__}")
    to_kwargs = chat_request_to_submit_kwargs if chat else completion_request_to_submit_kwargs
    kwargs = to_kwargs(body, limits=limits)
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise InvalidRequest("'model' is required: the name of a model that /v1/models lists")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise InvalidRequest(f"'stream' must be true or false, got {stream!r}")
    options = body.get("stream_options")
    include_usage = False
    if options is not None:
        if not stream:
            raise InvalidRequest("'stream_options' is only allowed with stream=true")
        if not isinstance(options, dict) or set(options) - {"include_usage", "continuous_usage_stats"}:
            raise InvalidRequest("'stream_options' takes only include_usage")
        if options.get("continuous_usage_stats"):
            raise InvalidRequest("stream_options.continuous_usage_stats is not supported by streamq")
        include_usage = options.get("include_usage") is True
    return OpenAIRequest(chat=chat, model=model, stream=stream, include_usage=include_usage, submit_kwargs=kwargs)


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
    fields = {name: body[name] for name in _SAMPLING_FIELDS | LOGPROBS_SAMPLING if body.get(name) is not None}
    if max_tokens is not None:
        fields["max_tokens"] = max_tokens
    stop = body.get("stop")
    if stop is not None:
        fields["stop"] = [stop] if isinstance(stop, str) else stop
    if (structured := structured_outputs_of(body)) is not None:
        fields["structured_outputs"] = structured
    try:
        return msgspec.convert(fields, Sampling).to_dict()
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
