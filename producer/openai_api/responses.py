"""OpenAI response bodies in the shape ``vllm serve`` returns: whole responses and streamed chunks.

A response's id is ``cmpl-`` or ``chatcmpl-`` and the streamq request id, so every
response can be traced to its replay log.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from producer.client import Completion
from producer.openai_api.errors import request_failed
from streamq.protocol import ChunkEvent, ErrorEvent, FinalEvent, WorkerRegistration


def response_id(request_id: str, *, chat: bool) -> str:
    return ("chatcmpl-" if chat else "cmpl-") + request_id


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
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

    def body(self, choices: list[dict[str, Any]], *, chunk: bool) -> dict[str, Any]:
        """The fields a response (or, with ``chunk``, a streamed chunk) starts with."""
        kind = ("chat.completion.chunk" if chunk else "chat.completion") if self.chat else "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model, "choices": choices}


def completion_choice(index: int, text: str, finish_reason: str | None) -> dict[str, Any]:
    """A ``/v1/completions`` choice: the same in a whole response and in a chunk."""
    return {"index": index, "text": text, "logprobs": None, "finish_reason": finish_reason, "stop_reason": None}


def chat_message_choice(index: int, text: str, finish_reason: str | None) -> dict[str, Any]:
    """A whole ``/v1/chat/completions`` response's choice."""
    return {
        "index": index,
        "message": {"role": "assistant", "content": text, "refusal": None},
        "logprobs": None,
        "finish_reason": finish_reason,
        "stop_reason": None,
    }


def chat_delta_choice(index: int, text: str, finish_reason: str | None, *, first: bool) -> dict[str, Any]:
    """A streamed ``/v1/chat/completions`` choice; a choice's first delta names its role."""
    delta: dict[str, Any] = {"role": "assistant", "content": text} if first else {"content": text}
    return {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish_reason}


def completion_response(completion: Completion, *, model: str, created: int | None = None) -> dict[str, Any]:
    """The non-streaming ``/v1/completions`` response body for ``completion``."""
    return _whole_response(completion, model, created, chat=False)


def chat_completion_response(completion: Completion, *, model: str, created: int | None = None) -> dict[str, Any]:
    """The non-streaming ``/v1/chat/completions`` response body for ``completion``."""
    return _whole_response(completion, model, created, chat=True)


def _whole_response(completion: Completion, model: str, created: int | None, *, chat: bool) -> dict[str, Any]:
    meta = ResponseMeta(chat, completion.request_id, model, int(time.time()) if created is None else created)
    to_choice = chat_message_choice if chat else completion_choice
    choices = [
        to_choice(i, text, reason)
        for i, (text, reason) in enumerate(zip(completion.texts, completion.finish_reasons, strict=True))
    ]
    return {
        **meta.body(choices, chunk=False),
        "system_fingerprint": None,
        "usage": {**usage(completion.prompt_tokens, completion.completion_tokens), "prompt_tokens_details": None},
    }


@dataclass
class ChunkBuilder:
    """Turns one request's events, in order, into the chunks of its streamed response.

    One ``chunk`` event becomes one chunk, so clients that time tokens by chunk see the
    tokens as they came. The final event becomes the finish reasons not yet sent and,
    with ``include_usage``, a usage chunk with empty ``choices``.
    """

    meta: ResponseMeta
    include_usage: bool
    _finished: set[int] = field(default_factory=set)
    _role_sent: set[int] = field(default_factory=set)

    def chunks(self, event: ChunkEvent | FinalEvent | ErrorEvent) -> list[dict[str, Any]]:
        """The chunks ``event`` adds (none for bytes of a character not complete yet);
        for an error event, an OpenAI error body."""
        if isinstance(event, ChunkEvent):
            if not event.text and event.finish_reason is None:
                return []  # they come with the next text
            if event.finish_reason is not None:
                self._finished.add(event.index)
            return [self._chunk(event.index, event.text, event.finish_reason)]
        if isinstance(event, ErrorEvent):
            return [request_failed(event.code, event.message).body()]
        out = [
            self._chunk(i, "", reason)
            for i, reason in enumerate(event.finish_reasons)
            if i not in self._finished  # ended early (cancelled, timeout, ...): say so
        ]
        if self.include_usage:
            out.append({**self.meta.body([], chunk=True), "usage": usage(event.prompt_tokens, event.completion_tokens)})
        return out

    def _chunk(self, index: int, text: str, finish_reason: str | None) -> dict[str, Any]:
        if self.meta.chat:
            first = index not in self._role_sent
            self._role_sent.add(index)
            choice = chat_delta_choice(index, text, finish_reason, first=first)
        else:
            choice = completion_choice(index, text, finish_reason)
        return self.meta.body([choice], chunk=True)


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
