"""What the gateway itself reads from an OpenAI body: the model, and how to deliver.

Everything else (sampling, prompt or messages, features streamq refuses) is mapped by
``producer/openai_params.py``, the one translation the batch command shares, so the
two cannot drift apart. Bad values become ``InvalidRequest``, a 400.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from producer.openai_params import chat_request_to_submit_kwargs, completion_request_to_submit_kwargs
from streamq.protocol import InvalidRequest


@dataclass(frozen=True)
class GatewayRequest:
    """One ``/v1/completions`` or ``/v1/chat/completions`` request, validated."""

    chat: bool
    model: str
    stream: bool
    include_usage: bool
    submit_kwargs: dict[str, Any]
    """``StreamqClient.submit`` keyword arguments: prompt or messages, sampling."""


def parse_body(body: object, *, chat: bool) -> GatewayRequest:
    """Validate a decoded JSON body; raises ``InvalidRequest`` naming what is wrong."""
    if not isinstance(body, dict):
        raise InvalidRequest(f"the request body must be a JSON object, got {type(body).__name__}")
    kwargs = chat_request_to_submit_kwargs(body) if chat else completion_request_to_submit_kwargs(body)
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
    return GatewayRequest(chat=chat, model=model, stream=stream, include_usage=include_usage, submit_kwargs=kwargs)
