"""Logprobs in the shapes ``vllm serve`` returns them, built from the events' ``TokenLogprob``.

vLLM keeps a position's logprobs as a dict ordered the token first, then the top-k
without it; its OpenAI shapes take a prefix of that order: the chat endpoint the first
``top_logprobs`` entries, the completions endpoint the first ``logprobs + 1`` (OpenAI's
rule), keyed by token text (where two tokens share a text, the first place and the last
value win, as a dict comprehension does). The event carries the top-k in rank order, so
that order is rebuilt here.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Final

import msgspec

from producer.errors import InvalidParameter
from streamq.protocol import TokenLogprob, TopLogprob


class CompletionLogprobs(msgspec.Struct):
    """``/v1/completions``' ``logprobs`` object (vLLM's ``CompletionLogProbs``); an echoed
    prompt's first token has ``null`` for its logprob and top logprobs."""

    text_offset: list[int]
    token_logprobs: list[float | None]
    tokens: list[str]
    top_logprobs: list[dict[str, float] | None]


class ChatLogprob(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int]


class ChatLogprobContent(msgspec.Struct):
    """One generated token in ``/v1/chat/completions``' ``logprobs.content``."""

    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list[ChatLogprob]


class ChatLogprobs(msgspec.Struct):
    content: list[ChatLogprobContent]


def vllm_order(entry: TokenLogprob, token_id: int) -> list[TopLogprob]:
    """The entries of ``entry``'s position in vLLM's dict order: the token, then the top-k
    without it (the token's place keeps the values the top-k gave it)."""
    first = TopLogprob(token_id, entry.token, entry.logprob)
    return [first, *(t for t in entry.top if t.token_id != token_id)]


def token_text(token_id: int, text: str, *, as_id: bool = False) -> str:
    """A token as logprobs name it: its text, or with ``as_id`` (vLLM's
    ``return_tokens_as_token_ids``) ``token_id:<id>``."""
    return f"token_id:{token_id}" if as_id else text


def completion_logprobs(
    token_ids: Sequence[int],
    entries: Sequence[TokenLogprob | None],
    text_offset: int = 0,
    *,
    top_k: int | None = None,
    first_token: str = "",
    as_ids: bool = False,
) -> CompletionLogprobs:
    """The completions endpoint's logprobs of ``token_ids``, the first at ``text_offset``
    (where the previous chunk's tokens ended: tokens' text, not the text sent so far,
    which lags behind a possible stop string). ``top_k``: the request's ``logprobs`` (each
    position lists that many and the token; ``None``: as many as the entry has). A
    ``None`` entry is an echoed prompt's first token, whose text is ``first_token``."""
    offsets: list[int] = []
    logprobs: list[float | None] = []
    tokens: list[str] = []
    tops: list[dict[str, float] | None] = []
    for token_id, entry in zip(token_ids, entries, strict=True):
        offsets.append(text_offset)
        if entry is None:
            token = token_text(token_id, first_token, as_id=as_ids)
            logprobs.append(None)
            tops.append(None)
        else:
            token = token_text(token_id, entry.token, as_id=as_ids)
            logprobs.append(entry.logprob)
            width = len(entry.top) + 1 if top_k is None or top_k < 0 else top_k + 1
            tops.append(
                {token_text(t.token_id, t.token, as_id=as_ids): t.logprob for t in vllm_order(entry, token_id)[:width]}
            )
        tokens.append(token)
        text_offset += len(token)
    return CompletionLogprobs(offsets, logprobs, tokens, tops)


def next_text_offset(logprobs: CompletionLogprobs, text_offset: int) -> int:
    """The text offset of the token after ``logprobs``' (``text_offset`` if it has none)."""
    if not logprobs.tokens:
        return text_offset
    return logprobs.text_offset[-1] + len(logprobs.tokens[-1])


def chat_logprobs(
    token_ids: Sequence[int], entries: Sequence[TokenLogprob], *, as_ids: bool = False, every: bool = False
) -> ChatLogprobs:
    """The chat endpoint's logprobs of ``token_ids`` (``as_ids``: tokens named ``token_id:<id>``;
    ``every``: each position lists all it has, the token first, as ``vllm serve`` lists
    ``logprob_token_ids``)."""
    content = []
    for token_id, entry in zip(token_ids, entries, strict=True):
        top = []
        for t in vllm_order(entry, token_id)[: len(entry.top) + every]:
            name = token_text(t.token_id, t.token, as_id=as_ids)
            top.append(ChatLogprob(name, t.logprob, _bytes(name)))
        # The token's bytes are its text's, also where it is named by id (as vLLM does).
        token = token_text(token_id, entry.token, as_id=as_ids)
        content.append(ChatLogprobContent(token, entry.logprob, _bytes(entry.token), top))
    return ChatLogprobs(content)


def _bytes(token: str) -> list[int]:
    return list(token.encode("utf-8", errors="replace"))


def prompt_logprobs(
    prompt_token_ids: Sequence[int], entries: Sequence[TokenLogprob | None]
) -> list[dict[str, dict[str, object]] | None]:
    """``prompt_logprobs`` as ``vllm serve`` returns them: per prompt token, ``null`` or an
    object from token id to ``{logprob, rank, decoded_token}`` in vLLM's dict order."""
    out: list[dict[str, dict[str, object]] | None] = []
    for token_id, entry in zip(prompt_token_ids, entries, strict=True):
        if entry is None:
            out.append(None)
            continue
        ranks = {t.token_id: rank for rank, t in enumerate(entry.top, start=1)}
        position = {str(token_id): {"logprob": entry.logprob, "rank": entry.rank, "decoded_token": entry.token}}
        for t in entry.top:
            if t.token_id != token_id:
                position[str(t.token_id)] = {"logprob": t.logprob, "rank": ranks[t.token_id], "decoded_token": t.token}
        out.append(position)
    return out


# --- Request fields ----------------------------------------------------------------
LOGPROBS_SAMPLING: Final = frozenset({"logprobs", "prompt_logprobs", "logprob_token_ids"})
"""The ``SamplingOptions`` fields the body's logprobs fields become."""


def completion_sampling(body: Mapping[str, Any]) -> dict[str, Any]:
    """The sampling fields of a ``/v1/completions`` body's ``logprobs`` (an integer: the
    sampled token's and that many more) and ``prompt_logprobs`` (vLLM's extension)."""
    logprobs = _integer(body, "logprobs")
    ids = _token_ids(body) if logprobs is not None else None  # without logprobs, vllm serve shows none
    return {"logprobs": None if ids else logprobs, "logprob_token_ids": ids, "prompt_logprobs": _prompt_logprobs(body)}


def chat_sampling(body: Mapping[str, Any]) -> dict[str, Any]:
    """The sampling fields of a ``/v1/chat/completions`` body's ``logprobs`` (a boolean),
    ``top_logprobs`` (how many most likely tokens with each) and ``prompt_logprobs``."""
    wanted = body.get("logprobs")
    if wanted is not None and not isinstance(wanted, bool):
        raise InvalidParameter(f"`logprobs` must be true or false, got {wanted!r}", param="logprobs")
    top = _integer(body, "top_logprobs")
    if top is not None and (top > 0 or top == -1) and not wanted:
        raise InvalidParameter("when using `top_logprobs`, `logprobs` must be set to true.", param="top_logprobs")
    ids = _token_ids(body)
    if ids and not wanted:
        raise InvalidParameter(
            "when using `logprob_token_ids`, `logprobs` must be set to true.", param="logprob_token_ids"
        )
    logprobs = (top or 0) if wanted and not ids else None
    return {"logprobs": logprobs, "logprob_token_ids": ids, "prompt_logprobs": _prompt_logprobs(body)}


def _token_ids(body: Mapping[str, Any]) -> list[int] | None:
    """``logprob_token_ids``: absent, or token ids (vLLM checks them against the vocabulary)."""
    ids = body.get("logprob_token_ids")
    if not ids:
        return None
    if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise InvalidParameter("`logprob_token_ids` must be a list of token ids", param="logprob_token_ids")
    return ids


def _prompt_logprobs(body: Mapping[str, Any]) -> int | None:
    value = _integer(body, "prompt_logprobs")
    if value is not None and body.get("stream") and (value > 0 or value == -1):
        raise InvalidParameter("`prompt_logprobs` are not available when `stream=True`.", param="prompt_logprobs")
    return value


def _integer(body: Mapping[str, Any], name: str) -> int | None:
    """``body[name]``: absent, ``null``, or an integer of at least -1 (-1: the whole vocabulary)."""
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidParameter(f"`{name}` must be an integer, got {value!r}", param=name)
    if value < -1:
        raise InvalidParameter(f"`{name}` must be a positive value or -1.", param=name)
    return value
