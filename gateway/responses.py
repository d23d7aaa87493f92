"""streamq events as the SSE stream ``vllm serve`` sends (whole bodies: ``producer/openai_params.py``).

One ``chunk`` event becomes one SSE event (``choices`` with that completion's delta),
so clients that time tokens by chunk (``vllm bench serve``) see the stream as it is.
The final event becomes the finish reasons not yet sent and, when asked for
(``stream_options.include_usage``), a usage chunk with empty ``choices``; then
``data: [DONE]``. Resumable streams label each SSE event with ``id: <seq>``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from streamq.protocol import ChunkEvent, ErrorEvent, FinalEvent

DONE = "data: [DONE]\n\n"


@dataclass(frozen=True)
class ResponseShape:
    """Which OpenAI endpoint the response is for, and what it names."""

    chat: bool
    request_id: str
    model: str
    created: int

    @property
    def id(self) -> str:
        return ("chatcmpl-" if self.chat else "cmpl-") + self.request_id

    def envelope(self, choices: list[dict[str, Any]], *, chunk: bool) -> dict[str, Any]:
        kind = ("chat.completion.chunk" if chunk else "chat.completion") if self.chat else "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model, "choices": choices}


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def sse(data: dict[str, Any], seq: int | None) -> str:
    """One SSE event; ``id:`` only on resumable streams (some clients, ``vllm bench serve``
    among them, read every event as ``data:`` alone)."""
    prefix = f"id: {seq}\n" if seq is not None else ""
    return f"{prefix}data: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n"


@dataclass
class StreamEncoder:
    """Turns one request's events into SSE text, in order."""

    shape: ResponseShape
    include_usage: bool
    event_ids: bool
    _finished: set[int] = field(default_factory=set)
    _role_sent: set[int] = field(default_factory=set)

    def _choice(self, index: int, text: str, finish_reason: str | None) -> dict[str, Any]:
        if not self.shape.chat:
            return {"index": index, "text": text, "logprobs": None, "finish_reason": finish_reason, "stop_reason": None}
        delta: dict[str, Any] = {"content": text}
        if index not in self._role_sent:
            self._role_sent.add(index)
            delta = {"role": "assistant", **delta}
        return {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish_reason}

    def encode(self, event: ChunkEvent | FinalEvent | ErrorEvent) -> str:
        seq = event.seq if self.event_ids else None
        if isinstance(event, ChunkEvent):
            if not event.text and event.finish_reason is None:
                return ""  # bytes of a character not complete yet: they come with the next text
            if event.finish_reason is not None:
                self._finished.add(event.index)
            choice = self._choice(event.index, event.text, event.finish_reason)
            return sse(self.shape.envelope([choice], chunk=True), seq)
        if isinstance(event, ErrorEvent):
            error = {"message": f"{event.code}: {event.message}", "type": "internal_error", "param": None}
            return sse({"error": {**error, "code": event.code}}, seq) + DONE
        out = [
            sse(self.shape.envelope([self._choice(i, "", reason)], chunk=True), seq)
            for i, reason in enumerate(event.finish_reasons)
            if i not in self._finished  # ended early (cancelled, timeout, ...): say so
        ]
        if self.include_usage:
            body = self.shape.envelope([], chunk=True)
            out.append(sse({**body, "usage": usage(event.prompt_tokens, event.completion_tokens)}, seq))
        return "".join(out) + DONE
