"""OpenAI response bodies in the shape ``vllm serve`` returns them (the streamed chunks
are ``chunks``).

A response's id is ``cmpl-`` or ``chatcmpl-`` and the streamq request id, so every
response can be traced to its replay log. The keys are those of vLLM's responses,
including the ones streamq always leaves ``null``, so that clients that read them find
them where they look.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from typing import Any, Final, cast

import msgspec

from producer.client import Completion
from producer.openai_api.logprobs import chat_logprobs, completion_logprobs, prompt_logprobs
from streamq.protocol import WorkerRegistration


def _fingerprint() -> str:
    try:
        return f"streamq-{version('streamq')}"
    except PackageNotFoundError:
        return "streamq"


SYSTEM_FINGERPRINT: Final = _fingerprint()
"""Names the backend in ``system_fingerprint``, where ``vllm serve`` names its own."""


def response_id(request_id: str, *, chat: bool) -> str:
    return ("chatcmpl-" if chat else "cmpl-") + request_id


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    """A whole response's usage, its keys in vLLM's order."""
    return {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
        "prompt_tokens_details": None,
        "completion_tokens_details": None,
    }


@dataclass(frozen=True)
class ResponseMeta:
    """What every response body and streamed chunk of one request names."""

    chat: bool
    request_id: str
    model: str
    created: int

    @property
    def id(self) -> str:
        return response_id(self.request_id, chat=self.chat)

    def object(self, *, chunk: bool) -> str:
        """The ``object`` of a response or, with ``chunk``, of a streamed chunk."""
        if not self.chat:
            return "text_completion"
        return "chat.completion.chunk" if chunk else "chat.completion"


def completion_choice(
    index: int,
    text: str,
    finish_reason: str | None,
    logprobs: dict[str, Any] | None = None,
    prompt_logprobs: list[Any] | None = None,
) -> dict[str, Any]:
    """A whole ``/v1/completions`` response's choice."""
    return {
        "index": index,
        "text": text,
        "logprobs": logprobs,
        "finish_reason": finish_reason,
        "stop_reason": None,
        "token_ids": None,
        "prompt_logprobs": prompt_logprobs,
        "prompt_token_ids": None,
        "routed_experts": None,
    }


def chat_message_choice(
    index: int, text: str, finish_reason: str | None, logprobs: dict[str, Any] | None = None
) -> dict[str, Any]:
    """A whole ``/v1/chat/completions`` response's choice."""
    message = {
        "role": "assistant",
        "content": text,
        "refusal": None,
        "annotations": None,
        "audio": None,
        "function_call": None,
        "reasoning": None,
    }
    return {
        "index": index,
        "message": message,
        "logprobs": logprobs,
        "finish_reason": finish_reason,
        "stop_reason": None,
        "token_ids": None,
        "routed_experts": None,
    }


def completion_response(completion: Completion, *, model: str, created: int | None = None) -> dict[str, Any]:
    """The non-streaming ``/v1/completions`` response body for ``completion``."""
    return _whole_response(completion, model, created, chat=False)


def chat_completion_response(completion: Completion, *, model: str, created: int | None = None) -> dict[str, Any]:
    """The non-streaming ``/v1/chat/completions`` response body for ``completion``."""
    return _whole_response(completion, model, created, chat=True)


def _whole_response(completion: Completion, model: str, created: int | None, *, chat: bool) -> dict[str, Any]:
    meta = ResponseMeta(chat, completion.request_id, model, int(time.time()) if created is None else created)
    prompt_lp = _prompt_logprobs(completion)
    choices = []
    for i, (text, reason) in enumerate(zip(completion.texts, completion.finish_reasons, strict=True)):
        logprobs = _logprobs(completion, i, chat=chat)
        if chat:
            choices.append(chat_message_choice(i, text, reason, logprobs))
        else:
            choices.append(completion_choice(i, text, reason, logprobs, prompt_lp))
    body: dict[str, Any] = {
        "id": meta.id,
        "object": meta.object(chunk=False),
        "created": meta.created,
        "model": meta.model,
        "choices": choices,
        "service_tier": None,
        "system_fingerprint": SYSTEM_FINGERPRINT,
        "usage": usage(completion.prompt_tokens, completion.completion_tokens),
    }
    if chat:
        body.update(prompt_logprobs=prompt_lp, prompt_token_ids=None, prompt_text=None)
    body.update(kv_transfer_params=None, ec_transfer_params=None, metrics=None)
    return body


def _logprobs(completion: Completion, index: int, *, chat: bool) -> dict[str, Any] | None:
    """Completion ``index``'s logprobs in the endpoint's shape, if they were asked for."""
    if completion.logprobs is None:
        return None
    token_ids, entries = completion.token_ids[index], completion.logprobs[index]
    shape = chat_logprobs(token_ids, entries) if chat else completion_logprobs(token_ids, entries)
    return cast(dict[str, Any], msgspec.to_builtins(shape))


def _prompt_logprobs(completion: Completion) -> list[Any] | None:
    if completion.prompt_logprobs is None or completion.prompt_token_ids is None:
        return None
    return prompt_logprobs(completion.prompt_token_ids, completion.prompt_logprobs)


def model_list(workers: Iterable[WorkerRegistration]) -> dict[str, Any]:
    """The ``/v1/models`` body: each model the live ``workers`` serve, once."""
    seen: dict[str, dict[str, Any]] = {}
    for worker in workers:
        entry = seen.setdefault(
            worker.model,
            {"id": worker.model, "object": "model", "created": 0, "owned_by": "streamq", "root": worker.model},
        )
        if worker.max_model_len is not None:
            entry["max_model_len"] = worker.max_model_len
        entry["workers"] = entry.get("workers", 0) + 1
    return {"object": "list", "data": list(seen.values())}
