"""OpenAI request bodies to ``StreamqClient.submit`` keyword arguments.

A field streamq cannot honour raises ``InvalidRequest`` naming it rather than being
dropped: a client asking for tools must learn it gets none (``fields`` says which). Values are
range-checked by vLLM on the worker, as for every streamq request, after the bounds of
``limits.RequestLimits`` (``n``, stop strings, messages) are checked here.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Final

import msgspec

from producer.errors import InvalidParameter
from producer.openai_api.fields import ENDPOINT_FIELDS, LEGACY_FIELDS, Support
from producer.openai_api.limits import DEFAULT_LIMITS, RequestLimits
from producer.openai_api.logprobs import (
    LOGPROBS_SAMPLING,
    chat_sampling,
    completion_sampling,
)
from producer.openai_api.structured import STRUCTURED_FIELDS, structured_outputs_of
from streamq.protocol import REQUEST_ID_PATTERN, ChatTemplateOptions, InvalidRequest, Sampling, is_valid_request_id
from streamq.protocol.affinity import check_affinity_key
from streamq.protocol.messages import check_cache_salt
from streamq.protocol.names import MAX_PRIORITY, MIN_PRIORITY

logger = logging.getLogger(__name__)

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
        "spaces_between_special_tokens",
        "allowed_token_ids",
        "bad_words",
        "stream_interval",
        "watermarking",
        "repetition_detection",
    }
)


def _prompt_fields(body: Mapping[str, Any]) -> dict[str, Any]:
    """``submit``'s ``truncate_prompt_tokens``, ``truncation_side`` and ``cache_salt``,
    type-checked now (the worker checks ``truncate_prompt_tokens`` against the model's context)."""
    fields: dict[str, Any] = {}
    if (keep := truncate_prompt_tokens_of(body)) is not None:
        fields["truncate_prompt_tokens"] = keep
    side = body.get("truncation_side")
    if side is not None:
        if side not in ("left", "right"):
            raise InvalidParameter(
                f"`truncation_side` must be either 'left' or 'right', got {_short(side)}", param="truncation_side"
            )
        fields["truncation_side"] = side
    if (salt := cache_salt_of(body)) is not None:
        fields["cache_salt"] = salt
    return fields


def truncate_prompt_tokens_of(body: Mapping[str, Any]) -> int | None:
    """The body's ``truncate_prompt_tokens``, type-checked (-1 or more; the worker checks it
    against the model's context)."""
    keep = body.get("truncate_prompt_tokens")
    if keep is not None and (not isinstance(keep, int) or isinstance(keep, bool) or keep < -1):
        raise InvalidParameter(
            f"truncate_prompt_tokens must be an integer of -1 or more, got {_short(keep)}",
            param="truncate_prompt_tokens",
        )
    return keep


def cache_salt_of(body: Mapping[str, Any]) -> str | None:
    """The body's ``cache_salt``, checked as vLLM checks it."""
    salt = body.get("cache_salt")
    if salt is None:
        return None
    if not isinstance(salt, str) or not salt:
        raise InvalidParameter("Parameter 'cache_salt' must be a non-empty string if provided.", param="cache_salt")
    try:
        check_cache_salt(salt)
    except ValueError as exc:
        raise InvalidParameter(str(exc), param="cache_salt") from None
    return salt


def priority_of(body: Mapping[str, Any]) -> int | None:
    """The body's ``priority``: vLLM takes an integer; streamq's is 32-bit."""
    priority = body.get("priority")
    if priority is not None and (
        not isinstance(priority, int) or isinstance(priority, bool) or not MIN_PRIORITY <= priority <= MAX_PRIORITY
    ):
        raise InvalidParameter(
            f"priority must be an integer from {MIN_PRIORITY} to {MAX_PRIORITY}, got {_short(priority)}",
            param="priority",
        )
    return priority


def _queue_fields(body: Mapping[str, Any]) -> dict[str, Any]:
    """``submit``'s ``priority`` (vLLM takes an integer; streamq's is 32-bit) and
    ``affinity_key`` (vLLM's ``session_id``: a stable identity shared by related requests)."""
    fields: dict[str, Any] = {}
    if (priority := priority_of(body)) is not None:
        fields["priority"] = priority
    session = body.get("session_id")
    if session is not None:
        try:
            fields["affinity_key"] = check_affinity_key(session)
        except ValueError as exc:
            raise InvalidParameter(f"session_id: {exc}", param="session_id") from None
    return fields


@dataclass(frozen=True)
class ResponseShape:
    """What a request asks of its response beyond the completions themselves."""

    echo: bool = False
    """The prompt's text (and its logprobs) before each completion's."""
    echo_only: bool = False
    """``echo`` with ``max_tokens`` 0: the prompt alone (one token is generated, and
    counted, as ``vllm serve`` does)."""
    tokens_as_ids: bool = False
    """``return_tokens_as_token_ids``: logprobs name tokens ``token_id:<id>``."""
    token_ids: bool = False
    """``return_token_ids``: choices carry ``token_ids`` and ``prompt_token_ids``."""
    logprobs: int | None = None
    """A completion request's ``logprobs``: how many most likely tokens each position lists
    (``None``: all it has, as for ``logprob_token_ids``)."""
    every_logprob: bool = False
    """``logprob_token_ids``: each position lists the token and those ids."""
    role: str = "assistant"
    """A chat response's role: the assistant's, or without ``add_generation_prompt`` the
    last message's (the model continues that turn)."""
    echo_text: str = ""
    """A chat request's ``echo``: the last message's content, when it has the response's role."""
    hide_reasoning: bool = False
    """A chat request's ``include_reasoning: false``: a parsed chunk names no tokens and no
    logprobs, which would show the reasoning (``vllm serve`` hides them so)."""
    prompt_text: bool = False
    """A chat request's ``return_prompt_text``: the rendered prompt on the first chunk (or
    in the response)."""
    continuous_usage: bool = False
    """``stream_options.continuous_usage_stats`` (with ``include_usage``): every chunk carries
    its prompt's and its completion's tokens so far."""

    def prompt_back(self) -> dict[str, bool]:
        """``submit``'s arguments that make the worker send the prompt back: its text
        (``echo``) where the response shows it, else its token ids alone where the response
        shows them or a chunk's usage counts them; empty when nothing needs it."""
        if self.echo or self.prompt_text:
            return {"echo": True}
        if self.token_ids or self.continuous_usage:
            return {"return_prompt_token_ids": True}
        return {}


PLAIN: Final = ResponseShape()
"""A response with nothing beyond its completions."""

Prompt = str | list[int]
"""One completion prompt: text, or token ids."""


@dataclass(frozen=True)
class CompletionBody:
    """A ``/v1/completions`` body, validated: its prompts, the ``submit`` arguments every
    prompt shares, and the response's shape."""

    prompts: list[Prompt]
    common: dict[str, Any]
    shape: ResponseShape


def parse_completion_body(body: Mapping[str, Any], *, limits: RequestLimits = DEFAULT_LIMITS) -> CompletionBody:
    """Validate a ``/v1/completions`` body; raises ``InvalidRequest`` naming what is wrong.

    ``prompt`` is a string, a list of strings, token ids or a list of token-id lists, as
    in ``vllm serve``; each prompt becomes a request of its own. Without ``max_tokens``
    vLLM's default (16) applies, as OpenAI's does.
    """
    body = _whole_numbers(_require_object(body), COMPLETION_INT_FIELDS)
    _check_fields(body, chat=False, strict=limits.reject_unknown_fields)
    limits.check_sampling(body)
    prompts = _prompts(body.get("prompt"), limits)
    shape = completion_shape(body)
    max_tokens = 1 if shape.echo_only else body.get("max_tokens")  # vLLM generates one token, echoes the prompt alone
    sampling = {**body, **completion_sampling(body)}
    if shape.echo and sampling.get("prompt_logprobs") is None:
        sampling["prompt_logprobs"] = body.get("logprobs")  # the echoed prompt's logprobs, as vLLM asks for them
    common = {**_sampling(sampling, max_tokens=max_tokens), **_prompt_fields(body), **_queue_fields(body)}
    common.update(shape.prompt_back())
    if body.get("add_special_tokens") is not None and not _flag(body, "add_special_tokens"):
        common["add_special_tokens"] = False
    return CompletionBody(prompts, common, shape)


def completion_request_to_submit_kwargs(
    body: Mapping[str, Any], *, limits: RequestLimits = DEFAULT_LIMITS
) -> dict[str, Any]:
    """``StreamqClient.submit`` keyword arguments for a ``/v1/completions`` body with one
    prompt (a batch line: one request per line)."""
    parsed = parse_completion_body(body, limits=limits)
    if len(parsed.prompts) != 1:
        raise InvalidParameter(
            f"prompt holds {len(parsed.prompts)} prompts; a batch line takes one prompt (the gateway takes several)",
            param="prompt",
        )
    return {"prompt": parsed.prompts[0], **parsed.common}


def completion_shape(body: Mapping[str, Any]) -> ResponseShape:
    """The response shape a ``/v1/completions`` body asks for."""
    echo = _flag(body, "echo")
    return ResponseShape(
        echo=echo,
        echo_only=echo and body.get("max_tokens") == 0,
        tokens_as_ids=_flag(body, "return_tokens_as_token_ids"),
        token_ids=_flag(body, "return_token_ids"),
        logprobs=None if body.get("logprob_token_ids") else body.get("logprobs"),
        every_logprob=bool(body.get("logprob_token_ids")),
    )


def chat_shape(body: Mapping[str, Any]) -> ResponseShape:
    """The response shape a (valid) ``/v1/chat/completions`` body asks for."""
    last = _message(body["messages"][-1], len(body["messages"]) - 1)
    role = "assistant" if body.get("add_generation_prompt") in (None, True) else last["role"]
    echo_text = (last["content"] or "") if _flag(body, "echo") and last["role"] == role else ""
    return ResponseShape(
        tokens_as_ids=_flag(body, "return_tokens_as_token_ids"),
        token_ids=_flag(body, "return_token_ids"),
        role=role,
        echo_text=echo_text,
        prompt_text=_flag(body, "return_prompt_text"),
        every_logprob=bool(body.get("logprob_token_ids")),
        hide_reasoning=not _flag(body, "include_reasoning", default=True),
    )


_CHAT_OPTIONS: Final = {
    "add_generation_prompt": "add_generation_prompt",
    "continue_final_message": "continue_final_message",
    "documents": "documents",
    "chat_template_kwargs": "kwargs",
}
"""Body fields that say how the messages are rendered → ``ChatTemplateOptions`` fields."""


REASONING_EFFORTS: Final = ("none", "minimal", "low", "medium", "high", "xhigh", "max")
"""``reasoning_effort``'s values, as ``vllm serve`` takes them."""


def _template_kwargs(body: Mapping[str, Any]) -> dict[str, Any] | None:
    """``chat_template_kwargs`` with ``reasoning_effort`` added as ``vllm serve`` adds it: as a
    template variable of its own (over the request's), and ``enable_thinking`` (unless the
    request set it) true for any effort but ``none``."""
    kwargs = body.get("chat_template_kwargs")
    if isinstance(kwargs, Mapping) and kwargs.get("chat_template") is not None:
        raise InvalidParameter(
            "a request's own chat template (chat_template_kwargs.chat_template) is refused, as `vllm serve` "
            "refuses one it is not told to trust",
            param="chat_template_kwargs",
        )
    effort = body.get("reasoning_effort")
    if effort is None:
        return kwargs
    if effort not in REASONING_EFFORTS:
        raise InvalidParameter(
            f"reasoning_effort must be one of {', '.join(REASONING_EFFORTS)}, got {_short(effort)}",
            param="reasoning_effort",
        )
    if kwargs is not None and not isinstance(kwargs, Mapping):
        raise InvalidParameter("chat_template_kwargs must be an object", param="chat_template_kwargs")
    merged = {**(kwargs or {}), "reasoning_effort": effort}
    merged.setdefault("enable_thinking", effort != "none")
    return merged


def _chat_options(body: Mapping[str, Any]) -> dict[str, Any]:
    """``submit``'s ``chat_options`` for a body that sets any, checked now."""
    given = {option: body[name] for name, option in _CHAT_OPTIONS.items() if body.get(name) is not None}
    if (kwargs := _template_kwargs(body)) is not None:
        given["kwargs"] = kwargs
    if not given:
        return {}
    try:
        options = msgspec.convert(given, ChatTemplateOptions)
    except (msgspec.ValidationError, ValueError) as exc:
        raise InvalidRequest(str(exc)) from None
    return {"chat_options": msgspec.to_builtins(options)} if msgspec.to_builtins(options) else {}


def chat_request_to_submit_kwargs(body: Mapping[str, Any], *, limits: RequestLimits = DEFAULT_LIMITS) -> dict[str, Any]:
    """``StreamqClient.submit`` keyword arguments for a ``/v1/chat/completions`` body.

    Message content may be a string or a list of ``{"type": "text"}`` parts (joined).
    ``max_completion_tokens`` wins over the older ``max_tokens``, as in vLLM.
    Without either, vLLM's default (16 tokens) applies, where ``vllm serve`` would
    fill the model's context: the producer does not know the model's length.
    """
    body = _whole_numbers(_require_object(body), CHAT_INT_FIELDS)
    _check_fields(body, chat=True, strict=limits.reject_unknown_fields)
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
    sampling = {**body, **chat_sampling(body)}
    if _flag(body, "echo") and sampling.get("prompt_logprobs") is None:
        sampling["prompt_logprobs"] = body.get("top_logprobs") or 0  # as vLLM asks for them with echo
    special = {"add_special_tokens": True} if _flag(body, "add_special_tokens") else {}
    prompt_back = chat_shape(body).prompt_back()  # the rendered prompt's text, or its token ids alone
    return {
        "messages": chat,
        **special,
        **prompt_back,
        **_chat_options(body),
        **_tools(body),
        **_sampling(sampling, max_tokens=max_tokens),
        **_prompt_fields(body),
        **({"include_reasoning": False} if not _flag(body, "include_reasoning", default=True) else {}),
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
    """``StreamqClient.submit`` keyword arguments every prompt shares: sampling, messages."""
    prompts: list[Prompt] = field(default_factory=list)
    """A completion request's prompts, each its own request (empty for chat)."""
    shape: ResponseShape = PLAIN
    request_id: str | None = None
    """The body's ``request_id``: names the request as the gateway's ``x-streamq-request-id``
    header does (which wins, as ``vllm serve``'s ``X-Request-Id`` wins over it)."""

    @property
    def n(self) -> int:
        """How many completions each prompt asks for."""
        return int(self.submit_kwargs.get("n") or 1)

    def submissions(self) -> list[dict[str, Any]]:
        """``submit`` keyword arguments per request in the queue: one per prompt, or the chat's one."""
        if self.chat:
            return [self.submit_kwargs]
        return [{"prompt": prompt, **self.submit_kwargs} for prompt in self.prompts]


def parse_openai_body(body: object, *, chat: bool, limits: RequestLimits = DEFAULT_LIMITS) -> OpenAIRequest:
    """Validate a decoded JSON body that must name its model; raises ``InvalidRequest``."""
    if not isinstance(body, dict):
        raise InvalidRequest(f"the request body must be a JSON object, got {type(body).__name__}")
    prompts: list[Prompt] = []
    shape = PLAIN
    if chat:
        kwargs = chat_request_to_submit_kwargs(body, limits=limits)
        shape = chat_shape(body)
    else:
        parsed = parse_completion_body(body, limits=limits)
        prompts, kwargs, shape = parsed.prompts, parsed.common, parsed.shape
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise InvalidRequest("'model' is required: the name of a model that /v1/models lists")
    stream = body.get("stream") or False  # null: false, as vllm serve reads it
    if not isinstance(stream, bool):
        raise InvalidRequest(f"'stream' must be true or false, got {stream!r}")
    request_id = body.get("request_id")
    if request_id is not None:
        if not isinstance(request_id, str) or not is_valid_request_id(request_id):
            raise InvalidParameter(f"request_id must match {REQUEST_ID_PATTERN.pattern}", param="request_id")
        if len(prompts) > 1:
            raise InvalidParameter("request_id names one request: send one prompt with it", param="request_id")
    include_usage, continuous_usage = _stream_options(body.get("stream_options"), stream)
    if continuous_usage:
        shape = replace(shape, continuous_usage=True)
        if not kwargs.get("echo"):  # the first chunk brings the prompt's token ids, which usage counts
            kwargs = {**kwargs, "return_prompt_token_ids": True}
        if chat:  # and each chunk its reasoning tokens so far, where a reasoning parser counts them
            kwargs = {**kwargs, "reasoning_per_chunk": True}
    return OpenAIRequest(
        chat=chat,
        model=model,
        stream=stream,
        include_usage=include_usage,
        submit_kwargs=kwargs,
        prompts=prompts,
        shape=shape,
        request_id=request_id,
    )


def _stream_options(options: object, stream: bool) -> tuple[bool, bool]:
    """``include_usage`` and ``continuous_usage_stats`` (which only counts with
    ``include_usage``), as ``vllm serve`` reads ``stream_options``."""
    if not options:
        return False, False
    if not stream:
        raise InvalidParameter("Stream options can only be defined when `stream=True`.", param="stream_options")
    if not isinstance(options, Mapping):
        raise InvalidParameter("'stream_options' must be an object", param="stream_options")
    flags = {}
    for name in ("include_usage", "continuous_usage_stats"):
        value = options.get(name)
        if value is not None and not isinstance(value, bool):
            raise InvalidParameter(f"stream_options.{name} must be true or false, got {_short(value)}", param=name)
        flags[name] = value is True
    return flags["include_usage"], flags["include_usage"] and flags["continuous_usage_stats"]


def unknown_fields(body: Mapping[str, Any], *, chat: bool) -> list[str]:
    """The fields of ``body`` no table names: top-level names, and ``messages[i].name`` for
    a message's (a chat body's messages that are objects)."""
    table = ENDPOINT_FIELDS[chat]
    unknown = sorted(set(body) - set(table) - set(LEGACY_FIELDS) - STRUCTURED_FIELDS)
    messages = body.get("messages") if chat else None
    if isinstance(messages, list):
        for position, message in enumerate(messages):
            if isinstance(message, Mapping):
                extra = sorted(
                    name
                    for name, value in message.items()
                    if name not in _MESSAGE_FIELDS and not (name in _RESPONSE_ONLY_FIELDS and value is None)
                )
                unknown += [f"messages[{position}].{name}" for name in extra]
    return unknown


def _check_fields(body: Mapping[str, Any], *, chat: bool, strict: bool) -> None:
    """Refuse a refused field that asks for something; a field no table names is ignored,
    named in the log once (as ``vllm serve`` logs it), or with ``strict`` refused."""
    endpoint = "/v1/chat/completions" if chat else "/v1/completions"
    table = ENDPOINT_FIELDS[chat]
    if unknown := unknown_fields(body, chat=chat):
        if strict:
            raise InvalidRequest(f"unsupported field(s) for {endpoint}: {', '.join(unknown)}")
        # vLLM's words (at its debug level); a warning here, which the gateway shows unconfigured
        logger.warning("The following fields were present in the request but ignored: %s", unknown)
    for name, value in body.items():
        spec = table.get(name) or LEGACY_FIELDS.get(name)
        if spec is not None and spec.support is Support.REFUSED and not spec.is_default(value):
            raise InvalidParameter(f"{name}={_short(value)} is not supported by streamq: {spec.note}", param=name)
    best_of = body.get("best_of")
    if best_of is not None and best_of != body.get("n", 1):
        raise InvalidParameter("best_of is not supported (only best_of equal to n)", param="best_of")


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _flag(body: Mapping[str, Any], name: str, *, default: bool = False) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise InvalidParameter(f"`{name}` must be true or false, got {_short(value)}", param=name)
    return value


def _is_token_id(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _prompts(value: object, limits: RequestLimits) -> list[Prompt]:
    """A completion body's ``prompt`` as a list of prompts, in ``vllm serve``'s forms."""
    prompts: list[Prompt]
    if isinstance(value, str):
        prompts = [value]
    elif isinstance(value, list) and value and all(isinstance(p, str) for p in value):
        prompts = list(value)
    elif isinstance(value, list) and value and all(_is_token_id(t) for t in value):
        prompts = [list(value)]
    elif (
        isinstance(value, list)
        and value
        and all(isinstance(p, list) and p and all(_is_token_id(t) for t in p) for p in value)
    ):
        prompts = [list(p) for p in value]
    else:
        raise InvalidParameter(
            "prompt must be a string, a list of strings, a list of token ids (integers >= 0) "
            "or a list of non-empty token-id lists",
            param="prompt",
        )
    limits.check_prompts(prompts)
    return prompts


_INT_FIELDS: Final = frozenset(
    {
        "max_tokens",
        "n",
        "best_of",
        "seed",
        "top_k",
        "min_tokens",
        "prompt_logprobs",
        "truncate_prompt_tokens",
        "priority",
        "stream_interval",
        "thinking_token_budget",
    }
)
COMPLETION_INT_FIELDS: Final = _INT_FIELDS | {"logprobs"}
"""The integer fields of vLLM's ``CompletionRequest`` (its ``logprobs`` is a count)."""
CHAT_INT_FIELDS: Final = _INT_FIELDS | {"max_completion_tokens", "top_logprobs"}
"""The integer fields of vLLM's ``ChatCompletionRequest`` (its ``logprobs`` is a switch)."""


def _whole_numbers(body: Mapping[str, Any], names: frozenset[str]) -> Mapping[str, Any]:
    """``body`` with a whole float in an integer field (``16.0``) made an integer, as
    ``vllm serve``'s pydantic models take it (JSON Schema's ``integer`` allows ``1.0``); any
    other float is left for the checks to refuse."""
    whole = {
        name: int(value)
        for name in names & body.keys()
        if isinstance(value := body[name], float) and value.is_integer()
    }
    return {**body, **whole} if whole else body


def _require_object(body: object) -> Mapping[str, Any]:
    if not isinstance(body, Mapping):
        raise InvalidRequest(f"the request body must be a JSON object, got {type(body).__name__}")
    return body


def _sampling(body: Mapping[str, Any], *, max_tokens: Any) -> dict[str, Any]:
    """Sampling fields, type-checked now (a bad type fails here, not on a worker)."""
    fields = {name: body[name] for name in _SAMPLING_FIELDS | LOGPROBS_SAMPLING if body.get(name) is not None}
    if (bias := body.get("logit_bias")) is not None:
        fields["logit_bias"] = _logit_bias(bias)
    if (budget := body.get("thinking_token_budget")) is not None and budget != -1:  # -1: unlimited, as unset
        fields["thinking_token_budget"] = budget
    if (xargs := body.get("vllm_xargs")) is not None:
        fields["extra_args"] = xargs
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


def _logit_bias(bias: object) -> dict[str, float]:
    """OpenAI's ``logit_bias`` (token ids as the object's keys), checked."""
    if not isinstance(bias, Mapping):
        raise InvalidParameter("logit_bias must be an object from token id to bias", param="logit_bias")
    try:
        return {str(int(token)): float(value) for token, value in bias.items()}
    except (TypeError, ValueError):
        raise InvalidParameter(
            "logit_bias contains key(s) that cannot be converted to integers, or values that are not numbers",
            param="logit_bias",
        ) from None


def _message(message: object, position: int) -> dict[str, Any]:
    """One message as ``ChatMessage`` takes it: text content; an assistant turn's
    ``tool_calls`` (its content may then be null) and ``reasoning``, a tool's
    ``tool_call_id``; ``name``. Other fields are not rendered (``unknown_fields`` names them)."""
    where = f"messages[{position}]"
    if not isinstance(message, Mapping):
        raise InvalidRequest(f"{where} must be an object with role and content")
    role, content = message.get("role"), message.get("content")
    if not isinstance(role, str):
        raise InvalidRequest(f"{where}.role must be a string")
    if isinstance(content, list):
        # Text parts joined by newlines, as vLLM renders them for a template that takes a string.
        texts = (_text_part(part, f"{where}.content[{j}]") for j, part in enumerate(content))
        content = "\n".join(text for text in texts if text is not None)
    calls = message.get("tool_calls")
    if calls is not None and not (isinstance(calls, list) and all(isinstance(c, Mapping) for c in calls)):
        raise InvalidRequest(f"{where}.tool_calls must be a list of tool call objects")
    if (
        role == "assistant"
        and calls
        and any(
            call.get("type", "function") != "function" or not isinstance(call.get("function"), Mapping)
            for call in calls
        )
    ):
        raise InvalidParameter(
            "chat completions only support assistant tool_calls of type 'function'.", param="tool_calls"
        )
    if content is None and not calls:
        content = ""  # no content renders as none, as vLLM renders it
    if not isinstance(content, str) and not (content is None and calls):
        raise InvalidRequest(f"{where}.content must be a string or a list of text parts")
    parsed: dict[str, Any] = {"role": role, "content": content}
    if message.get("reasoning") is not None and not isinstance(message["reasoning"], str):
        raise InvalidRequest(f"{where}.reasoning must be a string")
    for name in ("tool_calls", "tool_call_id", "name", "reasoning"):
        if message.get(name) is not None:
            parsed[name] = message[name]
    return parsed


_MESSAGE_FIELDS: Final = frozenset({"role", "content", "name", "tool_calls", "tool_call_id", "reasoning"})
"""A message's fields that are rendered; others are ignored (``unknown_fields``)."""

_RESPONSE_ONLY_FIELDS: Final = frozenset({"refusal", "annotations", "audio", "function_call", "reasoning"})
"""Fields of a response's message: a message sent back as it came (the openai SDK's
tool-calling examples do) carries them, empty, even to a gateway that rejects unknown
fields (``reasoning`` with text is rendered)."""

_TOOL_CHOICES: Final = ("none", "auto", "required")


def _tools(body: Mapping[str, Any]) -> dict[str, Any]:
    """``submit``'s ``tools`` for a body with tools, checked as ``vllm serve`` checks them
    (the worker's vLLM checks the rest: the tools' schemas, its own flags)."""
    tools, choice, parallel = body.get("tools"), body.get("tool_choice"), body.get("parallel_tool_calls")
    if tools is None:
        if choice is not None and choice != "none":
            raise InvalidParameter("When using `tool_choice`, `tools` must be set.", param="tool_choice")
        return {}
    if not isinstance(tools, list) or not tools:
        raise InvalidParameter(
            "`tools` must not be an empty array. Either provide at least one tool or omit the field entirely.",
            param="tools",
        )
    names = set()
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, Mapping) else None
        if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
            raise InvalidParameter(
                f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ...}}}}", param="tools"
            )
        names.add(function["name"])
    if isinstance(choice, Mapping):
        function = choice.get("function")
        name = function.get("name") if isinstance(function, Mapping) else None
        if name not in names:
            raise InvalidParameter(
                "The tool specified in `tool_choice` does not match any of the specified `tools`", param="tool_choice"
            )
    elif choice is not None and choice not in _TOOL_CHOICES:
        raise InvalidParameter(
            f'Invalid value for `tool_choice`: {_short(choice)}! Only named tools, "none", "auto" or "required" '
            "are supported.",
            param="tool_choice",
        )
    if parallel is not None and not isinstance(parallel, bool):
        raise InvalidParameter("`parallel_tool_calls` must be true or false", param="parallel_tool_calls")
    options = {"tools": tools, "tool_choice": "auto" if choice is None else choice, "parallel_tool_calls": parallel}
    return {"tools": {k: v for k, v in options.items() if v is not None}}


TEXT_PARTS: Final = {
    "text": "text",
    "input_text": "text",
    "output_text": "text",
    "refusal": "refusal",
    "thinking": "thinking",
}
"""The content parts vLLM reads as text (its ``TEXT_PART_TYPES``), each with the key that holds
its text."""
SKIPPED_WHEN_EMPTY: Final = frozenset({"text", "refusal"})
"""Parts vLLM skips when their text is missing (``PART_TYPES_TO_SKIP_NONE_CONTENT``)."""


def _text_part(part: object, where: str) -> str | None:
    """A content part's text as vLLM renders it for a template that takes a string: a
    plain string, or a part of a text type (a refusal, a thinking part, ...); ``None`` for
    one vLLM skips. Media parts are refused (no multimodal model serves here)."""
    if isinstance(part, str):
        return part
    kind = part.get("type") if isinstance(part, Mapping) else None
    key = TEXT_PARTS.get(kind) if isinstance(kind, str) else None
    if key is not None and isinstance(part, Mapping):
        text = part.get(key)
        if isinstance(text, str):
            return text
        if text is None and kind in SKIPPED_WHEN_EMPTY:
            return None
    raise InvalidRequest(f"{where}: only text content parts ({{'type': 'text', 'text': ...}}) are supported")
