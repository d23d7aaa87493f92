"""OpenAI response bodies in the shape ``vllm serve`` returns them (the streamed chunks
are ``chunks``).

A response's id is ``cmpl-`` or ``chatcmpl-`` and the streamq request id, so every
response can be traced to its replay log. The keys are those of vLLM's responses,
including the ones streamq always leaves ``null``, so that clients that read them find
them where they look.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from typing import Any, Final, cast

import msgspec

from producer.client import Completion
from producer.openai_api.logprobs import chat_logprobs, completion_logprobs, prompt_logprobs
from producer.openai_api.requests import PLAIN, ResponseShape
from streamq.protocol import ParsedOutput, PromptEcho, TokenLogprob, WorkerRegistration


def _fingerprint() -> str:
    try:
        return f"streamq-{version('streamq')}"
    except PackageNotFoundError:
        return "streamq"


SYSTEM_FINGERPRINT: Final = _fingerprint()
"""Names the backend in ``system_fingerprint``, where ``vllm serve`` names its own."""


def response_id(request_id: str, *, chat: bool) -> str:
    return ("chatcmpl-" if chat else "cmpl-") + request_id


def usage(prompt_tokens: int, completion_tokens: int, reasoning_tokens: int | None = None) -> dict[str, Any]:
    """A whole response's usage, its keys in vLLM's order; ``reasoning_tokens`` counted by
    the workers' reasoning parser, where they have one."""
    details = None if reasoning_tokens is None else {"reasoning_tokens": reasoning_tokens}
    return {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
        "prompt_tokens_details": None,
        "completion_tokens_details": details,
    }


def reasoning_tokens(parsed: Iterable[ParsedOutput | None]) -> int | None:
    """The reasoning tokens of the completions ``parsed``; ``None`` where no reasoning parser counted them."""
    counts = [p.reasoning_tokens for p in parsed if p is not None and p.reasoning_tokens is not None]
    return sum(counts) if counts else None


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


@dataclass(frozen=True)
class ReturnedPrompt:
    """A request's prompt as its worker sent it back on the first chunk (``echo``,
    ``return_token_ids``, ``prompt_logprobs``)."""

    token_ids: list[int]
    logprobs: list[TokenLogprob | None] | None = None
    echo: PromptEcho | None = None

    @classmethod
    def of(cls, completion: Completion) -> ReturnedPrompt:
        assert completion.prompt_token_ids is not None, "the worker sends the prompt back"
        return cls(completion.prompt_token_ids, completion.prompt_logprobs, completion.prompt_echo)

    @property
    def first_token(self) -> str:
        """The first prompt token's text (the position with no logprobs)."""
        return self.echo.first_token if self.echo is not None else ""

    def before(
        self, shape: ResponseShape, text: str, token_ids: list[int], entries: list[TokenLogprob | None] | None
    ) -> tuple[str, list[int], list[TokenLogprob | None] | None]:
        """A completion's first ``text``, ``token_ids`` and their logprob ``entries`` (``None``:
        not asked for) with the prompt before them, as ``vllm serve`` echoes: only the prompt
        for ``max_tokens`` 0, and no prompt text with ``return_token_ids``."""
        assert self.echo is not None, "echo: the worker sends the prompt's text back"
        prompt_text = "" if shape.token_ids else self.echo.text
        prompt_entries = None if entries is None else list(self.logprobs or [])
        if shape.echo_only:
            return prompt_text, self.token_ids, prompt_entries
        both = None if entries is None or prompt_entries is None else [*prompt_entries, *entries]
        return prompt_text + text, [*self.token_ids, *token_ids], both


def completion_choice(
    index: int,
    text: str,
    finish_reason: str | None,
    logprobs: dict[str, Any] | None = None,
    prompt_logprobs: list[Any] | None = None,
    token_ids: list[int] | None = None,
    prompt_token_ids: list[int] | None = None,
) -> dict[str, Any]:
    """A whole ``/v1/completions`` response's choice."""
    return {
        "index": index,
        "text": text,
        "logprobs": logprobs,
        "finish_reason": finish_reason,
        "stop_reason": None,
        "token_ids": token_ids,
        "prompt_logprobs": prompt_logprobs,
        "prompt_token_ids": prompt_token_ids,
        "routed_experts": None,
    }


def chat_message_choice(
    index: int,
    text: str,
    finish_reason: str | None,
    logprobs: dict[str, Any] | None = None,
    role: str = "assistant",
    parsed: ParsedOutput | None = None,
    token_ids: list[int] | None = None,
) -> dict[str, Any]:
    """A whole ``/v1/chat/completions`` response's choice: ``text`` as its content, or the
    message the worker's parsers read (``parsed``: content, reasoning, tool calls) with
    ``text`` (an echo) before its content; ``token_ids`` with ``return_token_ids``."""
    message: dict[str, Any] = {
        "role": role,
        "content": text,
        "refusal": None,
        "annotations": None,
        "audio": None,
        "function_call": None,
        "reasoning": None,
    }
    if parsed is not None and parsed.message is not None:
        message = {**parsed.message, "role": role}
        if text:
            message["content"] = text + (message.get("content") or "")
        finish_reason = parsed.finish_reason or finish_reason
    return {
        "index": index,
        "message": message,
        "logprobs": logprobs,
        "finish_reason": finish_reason,
        "stop_reason": None,
        "token_ids": token_ids,
        "routed_experts": None,
    }


def completion_response(
    completions: Sequence[Completion],
    *,
    model: str,
    created: int | None = None,
    shape: ResponseShape = PLAIN,
    response_id: str | None = None,
) -> dict[str, Any]:
    """The non-streaming ``/v1/completions`` response body for the completions of a
    request's prompts, in order (choices numbered on across them, usage summed)."""
    choices: list[dict[str, Any]] = []
    for completion in completions:
        prompt_lp = _prompt_logprobs(completion)
        for i in range(len(completion.texts)):
            choices.append(_completion_choice(len(choices), completion, i, shape, prompt_lp))
    return _body(completions, choices, model, created, chat=False, response_id=response_id)


def chat_completion_response(
    completions: Sequence[Completion],
    *,
    model: str,
    created: int | None = None,
    shape: ResponseShape = PLAIN,
    response_id: str | None = None,
) -> dict[str, Any]:
    """The non-streaming ``/v1/chat/completions`` response body for ``completions`` (one)."""
    (completion,) = completions
    choices = []
    for i, (text, reason) in enumerate(zip(completion.texts, completion.finish_reasons, strict=True)):
        logprobs = None
        if completion.logprobs is not None:
            shaped = chat_logprobs(
                completion.token_ids[i], completion.logprobs[i], as_ids=shape.tokens_as_ids, every=shape.every_logprob
            )
            logprobs = cast(dict[str, Any], msgspec.to_builtins(shaped))
        parsed = completion.parsed[i] if completion.parsed is not None else None
        content = shape.echo_text if parsed is not None and parsed.message is not None else shape.echo_text + text
        token_ids = completion.token_ids[i] if shape.token_ids else None
        choices.append(
            chat_message_choice(i, content, reason, logprobs, role=shape.role, parsed=parsed, token_ids=token_ids)
        )
    body = _body(completions, choices, model, created, chat=True, response_id=response_id)
    if shape.token_ids:
        body["prompt_token_ids"] = completion.prompt_token_ids
    if shape.prompt_text and completion.prompt_echo is not None:
        body["prompt_text"] = completion.prompt_echo.text
    return body


def _body(
    completions: Sequence[Completion],
    choices: list[dict[str, Any]],
    model: str,
    created: int | None,
    *,
    chat: bool,
    response_id: str | None,
) -> dict[str, Any]:
    meta = ResponseMeta(chat, completions[0].request_id, model, int(time.time()) if created is None else created)
    prompt_tokens = sum(c.prompt_tokens for c in completions)
    body: dict[str, Any] = {
        "id": response_id or meta.id,
        "object": meta.object(chunk=False),
        "created": meta.created,
        "model": meta.model,
        "choices": choices,
        "service_tier": None,
        "system_fingerprint": SYSTEM_FINGERPRINT,
        "usage": usage(
            prompt_tokens,
            sum(c.completion_tokens for c in completions),
            reasoning_tokens(p for c in completions for p in c.parsed or ()),
        ),
    }
    if chat:
        body.update(prompt_logprobs=_prompt_logprobs(completions[0]), prompt_token_ids=None, prompt_text=None)
    body.update(kv_transfer_params=None, ec_transfer_params=None, metrics=None)
    return body


def _completion_choice(
    index: int, completion: Completion, i: int, shape: ResponseShape, prompt_lp: list[Any] | None
) -> dict[str, Any]:
    """Completion ``i`` of one prompt as choice ``index``: with the prompt before it for
    ``echo`` (only the prompt for ``echo`` with ``max_tokens`` 0), as ``vllm serve`` does."""
    text, token_ids = completion.texts[i], completion.token_ids[i]
    entries: list[TokenLogprob | None] | None = None if completion.logprobs is None else list(completion.logprobs[i])
    first_token = ""
    if shape.echo:
        prompt = ReturnedPrompt.of(completion)
        text, token_ids, entries = prompt.before(shape, text, token_ids, entries)
        first_token = prompt.first_token
    logprobs = None
    if entries is not None:
        shaped = completion_logprobs(
            token_ids, entries, top_k=shape.logprobs, first_token=first_token, as_ids=shape.tokens_as_ids
        )
        logprobs = cast(dict[str, Any], msgspec.to_builtins(shaped))
    return completion_choice(
        index,
        text,
        completion.finish_reasons[i],
        logprobs,
        prompt_lp,
        token_ids=completion.token_ids[i] if shape.token_ids else None,
        prompt_token_ids=completion.prompt_token_ids if shape.token_ids else None,
    )


def _prompt_logprobs(completion: Completion) -> list[Any] | None:
    if completion.prompt_logprobs is None or completion.prompt_token_ids is None:
        return None
    return prompt_logprobs(completion.prompt_token_ids, completion.prompt_logprobs)


def model_list(
    workers: Iterable[WorkerRegistration],
    allows: Callable[[str], bool] | None = None,
    *,
    waiting_for_workers: Iterable[str] = (),
) -> dict[str, Any]:
    """The ``/v1/models`` body: each model the live ``workers`` serve, once, those ``allows``
    lets through (every one, for ``None``). A LoRA adapter is listed as ``vllm serve`` lists
    it: ``root`` its path, ``parent`` its base model. Then the models with no live worker
    that still take requests (``waiting_for_workers``: their requests wait for the next
    worker), with ``workers`` 0."""
    seen: dict[str, dict[str, Any]] = {}

    def count(name: str, card: dict[str, Any]) -> dict[str, Any]:
        entry = seen.setdefault(name, {"id": name, "object": "model", "created": 0, "owned_by": "streamq", **card})
        entry["workers"] = entry.get("workers", 0) + 1
        return entry

    for worker in workers:
        if allows is None or allows(worker.model):
            entry = count(worker.model, {"root": worker.model})
            if worker.max_model_len is not None:
                entry["max_model_len"] = worker.max_model_len
        for adapter in worker.adapters:
            if allows is None or allows(adapter.name):
                count(adapter.name, {"root": adapter.path, "parent": worker.model})
    for name in waiting_for_workers:
        if name not in seen and (allows is None or allows(name)):
            seen[name] = {
                "id": name,
                "object": "model",
                "created": 0,
                "owned_by": "streamq",
                "root": name,
                "workers": 0,
            }
    return {"object": "list", "data": list(seen.values())}
