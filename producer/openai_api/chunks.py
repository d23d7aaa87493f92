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

from collections.abc import Sequence
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
from producer.openai_api.requests import PLAIN, ResponseShape
from producer.openai_api.responses import SYSTEM_FINGERPRINT, ResponseMeta, ReturnedPrompt
from streamq.protocol import ChunkEvent, ErrorEvent, FinalEvent, TokenLogprob

_encode = msgspec.json.Encoder().encode


class CompletionChoice(msgspec.Struct, kw_only=True):
    """A streamed ``/v1/completions`` choice (``token_ids`` with ``return_token_ids``, and
    ``prompt_token_ids`` on each completion's first chunk)."""

    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: None = None
    prompt_token_ids: list[int] | None = None
    token_ids: list[int] | None = None


class ChatDelta(msgspec.Struct, kw_only=True):
    role: str | UnsetType = UNSET
    content: str


class ChatChoice(msgspec.Struct, kw_only=True):
    """A streamed ``/v1/chat/completions`` choice; the last one of a completion names
    the ``stop_reason``, every one after the role's names ``token_ids`` (a list with
    ``return_token_ids``)."""

    index: int
    delta: ChatDelta | msgspec.Raw
    """The text as content, or the delta the worker's parsers made of it (JSON as vLLM wrote it)."""
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: None | UnsetType = UNSET
    token_ids: list[int] | None | UnsetType = UNSET


class StreamUsage(msgspec.Struct, omit_defaults=True):
    """The last chunk's usage, its keys in vLLM's order."""

    prompt_tokens: int
    total_tokens: int
    completion_tokens: int
    completion_tokens_details: dict[str, int] | None = None
    """``reasoning_tokens``, where the workers' reasoning parser counted them."""


class ChunkUsage(msgspec.Struct):
    """A chat chunk's own usage (``stream_options.continuous_usage_stats``): the tokens of
    its prompt and of its completion so far; ``completion_tokens_details`` is always
    present, ``null`` unless a reasoning parser counted, as ``vllm serve`` sets it."""

    prompt_tokens: int
    total_tokens: int
    completion_tokens: int
    completion_tokens_details: dict[str, int] | None = None


class _Head(msgspec.Struct):
    id: str
    object: str
    created: int
    model: str


_CLOSE: Final = b"]}"
_CLOSE_ROLE: Final = b'],"prompt_token_ids":%b,"prompt_text":%b}'
_FINGERPRINT: Final = b',"system_fingerprint":' + _encode(SYSTEM_FINGERPRINT) + b"}"
_CLOSE_LAST: Final = b"]" + _FINGERPRINT


@dataclass
class ChunkBuilder:
    """Turns one request's events, in order, into the JSON chunks of its streamed response.

    A completion request with several prompts is one response over several requests in
    the queue: each event names its ``prompt`` (its position), and choice ``prompt * n +
    index`` is its completion ``index``, as ``vllm serve`` numbers them. A final event adds
    a finish chunk for each completion of its prompt that ended without one (cancelled,
    timed out, ...); after the last prompt's, with ``include_usage``, the usage chunk
    (summed) with empty ``choices``. ``n`` is the number of completions per prompt (a chat
    stream names the role of each); ``role_sent`` for a stream resumed past its first
    event, whose client has them.
    """

    meta: ResponseMeta
    include_usage: bool
    n: int = 1
    role_sent: bool = False
    shape: ResponseShape = PLAIN
    prompts: int = 1
    _with_tokens: set[int] = field(default_factory=set)
    """Choices that have sent a token (an output before that, with none, is skipped)."""
    _finished: set[int] = field(default_factory=set)
    _started: set[int] = field(default_factory=set)
    """Choices that have sent a chunk (the first carries the echo, the prompt's token ids)."""
    _text_offsets: dict[int, int] = field(default_factory=dict)
    """Per choice, where its next token's text starts (completions' ``text_offset``)."""
    _prompt: dict[int, ReturnedPrompt] = field(default_factory=dict)
    _usage: dict[int, tuple[int, int]] = field(default_factory=dict)
    """Per prompt that ended: its prompt and completion tokens."""
    _generated: dict[int, int] = field(default_factory=dict)
    """Per choice, the tokens it has generated so far (its chunks' usage)."""
    _reasoning: dict[int, int] = field(default_factory=dict)
    """Per choice, the reasoning tokens the worker's parser counted: so far (on every chunk,
    with ``continuous_usage``), or on its last chunk; empty where none counts them."""
    _open: bytes = b""
    done: bool = False
    """Whether the response is complete: every prompt ended, or one failed."""

    def __post_init__(self) -> None:
        head = _encode(_Head(self.meta.id, self.meta.object(chunk=True), self.meta.created, self.meta.model))
        self._open = head[:-1] + b',"choices":['

    def chunks(self, event: ChunkEvent | FinalEvent | ErrorEvent, prompt: int = 0) -> list[bytes]:
        """The chunks ``event`` (of the request of ``prompt``) adds; for an error event, an
        OpenAI error body."""
        if isinstance(event, ErrorEvent):
            self.done = True
            return [_encode(request_failed(event.code, event.message).body())]
        if isinstance(event, ChunkEvent) and event.prompt_token_ids is not UNSET:
            prompt_lp = None if event.prompt_logprobs is UNSET else event.prompt_logprobs
            echo = None if event.prompt_echo is UNSET else event.prompt_echo
            self._prompt[prompt] = ReturnedPrompt(event.prompt_token_ids, prompt_lp, echo)
        if isinstance(event, ChunkEvent) and event.parsed is not UNSET and event.parsed.reasoning_tokens is not None:
            self._reasoning.setdefault(prompt * self.n + event.index, 0)  # a parser counts: the role chunks say 0
        out = [] if self.role_sent or not self.meta.chat else self._role_chunks(prompt)
        if isinstance(event, ChunkEvent):
            choice = prompt * self.n + event.index
            self._generated[choice] = self._generated.get(choice, 0) + len(event.token_ids)
            if event.token_ids:
                self._with_tokens.add(choice)
            if self.shape.echo and choice not in self._started:
                out.append(self._echo_chunk(choice, prompt, event))
            elif event.text or choice in self._with_tokens:  # nothing at all: a prefill step, as vLLM skips
                logprobs = None if event.logprobs is UNSET else self._logprobs(choice, event.token_ids, event.logprobs)
                if event.parsed is UNSET:
                    ids = self._ids(choice, prompt, event)
                    out.append(self._chunk(choice, event.text, event.finish_reason, logprobs, ids))
                elif (parsed := self._parsed_chunk(choice, prompt, event, logprobs)) is not None:
                    out.append(parsed)
            return out
        for index, reason in enumerate(event.finish_reasons):
            choice = prompt * self.n + index
            if choice not in self._finished:
                out.append(self._chunk(choice, "", reason))
        self._usage[prompt] = (event.prompt_tokens, event.completion_tokens)
        if len(self._usage) < self.prompts:
            return out
        self.done = True
        if self.include_usage:
            prompt_tokens = sum(p for p, _ in self._usage.values())
            completion = sum(c for _, c in self._usage.values())
            used = StreamUsage(prompt_tokens, prompt_tokens + completion, completion)
            if self._reasoning:
                used.completion_tokens_details = {"reasoning_tokens": sum(self._reasoning.values())}
            out.append(self._open + b'],"usage":' + _encode(used) + _FINGERPRINT)
        return out

    def _role_chunks(self, prompt: int) -> list[bytes]:
        """A chat stream's first chunks: each completion's role (with ``return_token_ids``,
        the prompt's token ids beside it), then (``echo``) the last message's content, as
        ``vllm serve`` opens a stream."""
        self.role_sent = True
        role = self.shape.role
        returned = self._prompt.get(prompt)
        ids = _encode(returned.token_ids) if self.shape.token_ids and returned is not None else b"null"
        text = b"null"
        if self.shape.prompt_text and returned is not None and returned.echo is not None:
            text = _encode(returned.echo.text)
        close = _CLOSE_ROLE % (ids, text)
        first = prompt * self.n
        chunks = [
            self._open
            + _encode(ChatChoice(index=i, delta=ChatDelta(role=role, content="")))
            + self._tail(close, first + i, prompt)
            for i in range(self.n)
        ]
        if self.shape.echo_text:
            echo = ChatDelta(content=self.shape.echo_text)
            chunks += [
                self._open + _encode(ChatChoice(index=i, delta=echo)) + self._tail(_CLOSE, first + i, prompt)
                for i in range(self.n)
            ]
        return chunks

    def _tail(self, close: bytes, choice: int, prompt: int) -> bytes:
        """A chunk's ``close`` (its bytes after the choices), with the choice's usage so far
        before the rest when the request asked for ``continuous_usage_stats``, as ``vllm
        serve`` puts it on every chunk: its prompt's tokens, and its completion's."""
        if not self.shape.continuous_usage:
            return close
        returned = self._prompt.get(prompt)
        prompt_tokens = len(returned.token_ids) if returned is not None else 0
        completion = self._generated.get(choice, 0)
        usage: ChunkUsage | StreamUsage
        if self.meta.chat:
            # A worker with a reasoning parser counts them on every chunk: from the first on, each
            # chunk's details count its choice's, 0 before it has any (as vllm serve's do).
            details = {"reasoning_tokens": self._reasoning.get(choice, 0)} if self._reasoning else None
            usage = ChunkUsage(prompt_tokens, prompt_tokens + completion, completion, details)
        else:
            usage = StreamUsage(prompt_tokens, prompt_tokens + completion, completion)
        return b'],"usage":' + _encode(usage) + close[1:]

    def _parsed_chunk(
        self, choice: int, prompt: int, event: ChunkEvent, logprobs: ChatLogprobs | CompletionLogprobs | None
    ) -> bytes | None:
        """A chat chunk whose delta the worker's parsers made (``None``: held back, as
        ``vllm serve`` holds a delta its parser returned nothing for, unless it ends the
        completion, carries logprobs or must name its tokens: ``return_token_ids``)."""
        assert event.parsed is not UNSET
        parsed = event.parsed
        if parsed.reasoning_tokens is not None:
            self._reasoning[choice] = parsed.reasoning_tokens
        finish_reason = parsed.finish_reason or event.finish_reason
        hidden = self.shape.hide_reasoning  # the tokens and their logprobs would show the reasoning
        if hidden:
            logprobs = None
        token_ids = self.shape.token_ids and not hidden
        if parsed.message is None and finish_reason is None and logprobs is None and not token_ids:
            return None
        delta = msgspec.Raw(_encode(parsed.message or {}))
        ids = self._ids(choice, prompt, event)
        if hidden and ids is not None:
            ids = (None, ids[1])
        return self._chunk(choice, "", finish_reason, logprobs, ids, delta=delta)

    def _echo_chunk(self, choice: int, prompt: int, event: ChunkEvent) -> bytes:
        """A completion's first chunk with its prompt before it (only the prompt, for
        ``max_tokens`` 0), as ``vllm serve`` echoes."""
        returned = self._prompt[prompt]
        entries: list[TokenLogprob | None] | None = None if event.logprobs is UNSET else list(event.logprobs)
        text, token_ids, entries = returned.before(self.shape, event.text, event.token_ids, entries)
        logprobs = None
        if entries is not None:
            logprobs = self._logprobs(choice, token_ids, entries, first_token=returned.first_token)
        return self._chunk(choice, text, event.finish_reason, logprobs, self._ids(choice, prompt, event))

    def _ids(self, choice: int, prompt: int, event: ChunkEvent) -> tuple[list[int] | None, list[int] | None] | None:
        """The chunk's token ids (with ``return_token_ids``), and the prompt's on a
        completion's first chunk (with ``return_token_ids`` or ``echo``, as vLLM streams them)."""
        first = choice not in self._started
        self._started.add(choice)
        if not (self.shape.token_ids or self.shape.echo):
            return None
        prompt_ids = self._prompt[prompt].token_ids if first and prompt in self._prompt else None
        return (event.token_ids if self.shape.token_ids else None), prompt_ids

    def _logprobs(
        self, choice: int, token_ids: list[int], entries: Sequence[TokenLogprob | None], first_token: str = ""
    ) -> ChatLogprobs | CompletionLogprobs:
        """The chunk's logprobs in its endpoint's shape (the event carries them)."""
        as_ids = self.shape.tokens_as_ids
        if self.meta.chat:
            entries_ = [e for e in entries if e is not None]
            return chat_logprobs(token_ids, entries_, as_ids=as_ids, every=self.shape.every_logprob)
        offset = self._text_offsets.get(choice, 0)
        logprobs = completion_logprobs(
            token_ids, entries, offset, top_k=self.shape.logprobs, first_token=first_token, as_ids=as_ids
        )
        self._text_offsets[choice] = next_text_offset(logprobs, offset)
        return logprobs

    def _chunk(
        self,
        index: int,
        text: str,
        finish_reason: str | None,
        logprobs: ChatLogprobs | CompletionLogprobs | None = None,
        ids: tuple[list[int] | None, list[int] | None] | None = None,
        delta: msgspec.Raw | None = None,
    ) -> bytes:
        """One chunk of choice ``index``; a chat chunk's delta is ``text`` as its content
        unless ``delta`` (a parsed one) is given."""
        choice: ChatChoice | CompletionChoice
        chat_lp = logprobs if isinstance(logprobs, ChatLogprobs) else None
        completion_lp = logprobs if isinstance(logprobs, CompletionLogprobs) else None
        token_ids, prompt_token_ids = ids if ids is not None else (None, None)
        if not self.meta.chat:
            choice = CompletionChoice(
                index=index,
                text=text,
                logprobs=completion_lp,
                finish_reason=finish_reason,
                token_ids=token_ids,
                prompt_token_ids=prompt_token_ids,
            )
        elif finish_reason is None:
            choice = ChatChoice(
                index=index, delta=delta or ChatDelta(content=text), logprobs=chat_lp, token_ids=token_ids
            )
        else:  # the last chunk of a chat completion names its stop_reason
            choice = ChatChoice(
                index=index,
                delta=delta or ChatDelta(content=text),
                logprobs=chat_lp,
                finish_reason=finish_reason,
                stop_reason=None,
            )
            choice.token_ids = token_ids
        prompt = index // self.n
        if finish_reason is None:
            return self._open + _encode(choice) + self._tail(_CLOSE, index, prompt)
        self._finished.add(index)
        # The fingerprint goes on the last chunk: the usage chunk when there is one.
        return self._open + _encode(choice) + self._tail(_CLOSE if self.include_usage else _CLOSE_LAST, index, prompt)
