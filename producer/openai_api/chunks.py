"""Streamed responses as the JSON chunks ``vllm serve`` sends, chunk for chunk.

Every ``chunk`` event becomes one chunk, also when its text is empty (tokens that end
inside a multi-byte character): clients that count chunks as tokens, and time them, see
what ``vllm serve`` would send. A chat stream opens with one chunk per choice naming the
role. The keys each chunk carries are those of vLLM's (``exclude_unset``): a field left
``UNSET`` is absent, ``None`` is ``null``.

This runs once per token, so a chunk is bytes built from parts: what is the same for the
whole request (id, object, created, model) is encoded once, each chunk encodes its choice.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Final

import msgspec
from msgspec import UNSET, UnsetType

from producer.openai_api.errors import request_failed
from producer.openai_api.logprobs import (
    ChatLogprobs,
    CompletionLogprobs,
    chat_logprobs,
    completion_logprobs,
    next_text_offset,
)
from producer.openai_api.responses import SYSTEM_FINGERPRINT, ResponseMeta
from streamq.protocol import ChunkEvent, ErrorEvent, FinalEvent

ROLE: Final = "assistant"

_encode = msgspec.json.Encoder().encode


class CompletionChoice(msgspec.Struct, kw_only=True):
    """A streamed ``/v1/completions`` choice."""

    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: None = None
    prompt_token_ids: None = None
    token_ids: None = None


class ChatDelta(msgspec.Struct, kw_only=True):
    role: str | UnsetType = UNSET
    content: str


class ChatChoice(msgspec.Struct, kw_only=True):
    """A streamed ``/v1/chat/completions`` choice; the last one of a completion names
    the ``stop_reason``, every one after the role's names ``token_ids``."""

    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: None | UnsetType = UNSET
    token_ids: None | UnsetType = UNSET


class StreamUsage(msgspec.Struct):
    """The last chunk's usage, its keys in vLLM's order."""

    prompt_tokens: int
    total_tokens: int
    completion_tokens: int


class _Head(msgspec.Struct):
    id: str
    object: str
    created: int
    model: str


_CLOSE: Final = b"]}"
_CLOSE_ROLE: Final = b'],"prompt_token_ids":null,"prompt_text":null}'
_FINGERPRINT: Final = b',"system_fingerprint":' + _encode(SYSTEM_FINGERPRINT) + b"}"
_CLOSE_LAST: Final = b"]" + _FINGERPRINT


@dataclass
class ChunkBuilder:
    """Turns one request's events, in order, into the JSON chunks of its streamed response.

    The final event adds a finish chunk for each completion that ended without one
    (cancelled, timed out, ...) and, with ``include_usage``, the usage chunk with empty
    ``choices``. ``n`` is the number of completions (a chat stream names the role of
    each); ``role_sent`` for a stream resumed past its first event, whose client has them.
    """

    meta: ResponseMeta
    include_usage: bool
    n: int = 1
    role_sent: bool = False
    _with_tokens: set[int] = field(default_factory=set)
    """Completions that have sent a token (an output before that, with none, is skipped)."""
    _finished: set[int] = field(default_factory=set)
    _text_offsets: dict[int, int] = field(default_factory=dict)
    """Per completion, where its next token's text starts (completions' ``text_offset``)."""
    _open: bytes = b""

    def __post_init__(self) -> None:
        head = _encode(_Head(self.meta.id, self.meta.object(chunk=True), self.meta.created, self.meta.model))
        self._open = head[:-1] + b',"choices":['

    def chunks(self, event: ChunkEvent | FinalEvent | ErrorEvent) -> list[bytes]:
        """The chunks ``event`` adds; for an error event, an OpenAI error body."""
        if isinstance(event, ErrorEvent):
            return [_encode(request_failed(event.code, event.message).body())]
        out = [] if self.role_sent or not self.meta.chat else self._role_chunks()
        if isinstance(event, ChunkEvent):
            if event.token_ids:
                self._with_tokens.add(event.index)
            if event.text or event.index in self._with_tokens:  # nothing at all: a prefill step, as vLLM skips
                logprobs = None if event.logprobs is UNSET else self._logprobs(event)
                out.append(self._chunk(event.index, event.text, event.finish_reason, logprobs))
            return out
        for index, reason in enumerate(event.finish_reasons):
            if index not in self._finished:
                out.append(self._chunk(index, "", reason))
        if self.include_usage:
            prompt, completion = event.prompt_tokens, event.completion_tokens
            used = StreamUsage(prompt, prompt + completion, completion)
            out.append(self._open + b'],"usage":' + _encode(used) + _FINGERPRINT)
        return out

    def _role_chunks(self) -> list[bytes]:
        self.role_sent = True
        return [
            self._open + _encode(ChatChoice(index=i, delta=ChatDelta(role=ROLE, content=""))) + _CLOSE_ROLE
            for i in range(self.n)
        ]

    def _logprobs(self, event: ChunkEvent) -> ChatLogprobs | CompletionLogprobs:
        """The chunk's logprobs in its endpoint's shape (the event carries them)."""
        assert event.logprobs is not UNSET
        if self.meta.chat:
            return chat_logprobs(event.token_ids, event.logprobs)
        offset = self._text_offsets.get(event.index, 0)
        logprobs = completion_logprobs(event.token_ids, event.logprobs, offset)
        self._text_offsets[event.index] = next_text_offset(logprobs, offset)
        return logprobs

    def _chunk(
        self,
        index: int,
        text: str,
        finish_reason: str | None,
        logprobs: ChatLogprobs | CompletionLogprobs | None = None,
    ) -> bytes:
        choice: ChatChoice | CompletionChoice
        chat_lp = logprobs if isinstance(logprobs, ChatLogprobs) else None
        completion_lp = logprobs if isinstance(logprobs, CompletionLogprobs) else None
        if finish_reason is None:
            if self.meta.chat:
                choice = ChatChoice(index=index, delta=ChatDelta(content=text), logprobs=chat_lp, token_ids=None)
            else:
                choice = CompletionChoice(index=index, text=text, logprobs=completion_lp)
            return self._open + _encode(choice) + _CLOSE
        self._finished.add(index)
        if self.meta.chat:
            delta = ChatDelta(content=text)
            choice = ChatChoice(
                index=index,
                delta=delta,
                logprobs=chat_lp,
                finish_reason=finish_reason,
                stop_reason=None,
                token_ids=None,
            )
        else:
            choice = CompletionChoice(index=index, text=text, logprobs=completion_lp, finish_reason=finish_reason)
        # The fingerprint goes on the last chunk: the usage chunk when there is one.
        return self._open + _encode(choice) + (_CLOSE if self.include_usage else _CLOSE_LAST)
