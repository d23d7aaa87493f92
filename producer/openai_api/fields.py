"""Every field of vLLM's ``CompletionRequest`` and ``ChatCompletionRequest``, and what the
gateway (and the batch command) does with it: one table, read by the request mapping
(``requests``), rendered into docs/gateway.md, and held against vLLM's own classes by a
test, so that a field a new vLLM adds fails that test until it is classified here.

- **honoured**: it changes the output as it does in ``vllm serve``;
- **ignored**: accepted and without effect, as in ``vllm serve`` (a field it reads only on
  other endpoints, or for features no streamq worker runs);
- **refused**: a 400 naming it unless it carries its default (so clients that send
  defaults still work), with the reason in the table: one that is the queue's (beam search,
  disaggregation, tensors, media, a request's own template), or ``vllm serve``'s own.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Any, Final


class Support(Enum):
    HONOURED = "honoured"
    IGNORED = "ignored"
    REFUSED = "refused"


def _is_off(value: Any) -> bool:
    """The values that ask for nothing: ``null``, false, 0, empty."""
    return value is None or value is False or value == 0 or value == {} or value == [] or value == ""


@dataclass(frozen=True)
class Field:
    """How one request field is treated."""

    support: Support
    note: str = ""
    is_default: Callable[[Any], bool] = _is_off
    """For a refused field: the values accepted all the same (its defaults)."""


def _honoured(note: str = "") -> Field:
    return Field(Support.HONOURED, note)


def _ignored(note: str) -> Field:
    return Field(Support.IGNORED, note)


def _refused(note: str, is_default: Callable[[Any], bool] = _is_off) -> Field:
    return Field(Support.REFUSED, note, is_default)


_COMMON: Final[dict[str, Field]] = {
    "model": _honoured(
        "routes the request to the queue of the workers serving that model; absent, the one model live "
        "workers serve (several: a 400 listing them)"
    ),
    "frequency_penalty": _honoured(),
    "logit_bias": _honoured("token ids as keys, clamped to -100..100"),
    "logprobs": _honoured("see [logprobs](features/logprobs.md)"),
    "max_tokens": _honoured("lowered to the model's context, as `vllm serve` lowers it; default 16"),
    "n": _honoured("at most `--max-n`"),
    "presence_penalty": _honoured(),
    "seed": _honoured(),
    "stop": _honoured("at most 64 strings"),
    "stream": _honoured(),
    "stream_options": _honoured(
        "`include_usage`; `continuous_usage_stats` (with it): every chunk's `usage`, its tokens so far"
    ),
    "temperature": _honoured(),
    "top_p": _honoured(),
    "user": _ignored("as in `vllm serve`"),
    "use_beam_search": _refused(
        "beam search runs in `vllm serve`'s front end over many engine requests, not one queued request"
    ),
    "top_k": _honoured(),
    "min_p": _honoured(),
    "repetition_penalty": _honoured(),
    "watermarking": _honoured(),
    "length_penalty": _refused("beam search only (see `use_beam_search`)", lambda v: v is None or v == 1.0),
    "stop_token_ids": _honoured(),
    "include_stop_str_in_output": _honoured(),
    "ignore_eos": _honoured(),
    "min_tokens": _honoured(),
    "skip_special_tokens": _honoured(),
    "spaces_between_special_tokens": _honoured(),
    "truncate_prompt_tokens": _honoured(
        "the prompt's tokens cut on the worker, after the template, as in `vllm serve`"
    ),
    "truncation_side": _honoured("with `truncate_prompt_tokens`"),
    "allowed_token_ids": _honoured(),
    "prompt_logprobs": _honoured("not with `stream`, as in `vllm serve`"),
    "logprob_token_ids": _honoured("each token's logprobs list those tokens', as in `vllm serve`"),
    "bad_words": _honoured(),
    "response_format": _honoured("see [structured outputs](features/structured-outputs.md)"),
    "structured_outputs": _honoured("see [structured outputs](features/structured-outputs.md)"),
    "priority": _honoured("orders the queue; see [priorities](features/priorities-and-tenants.md)"),
    "request_id": _honoured(
        "the request's id, as the `x-streamq-request-id` header names it (which wins): resumable, "
        "in its status; one prompt"
    ),
    "session_id": _honoured("the request's affinity key ([prefix-aware pickup](features/prefix-aware-pickup.md))"),
    "return_tokens_as_token_ids": _honoured("logprobs' tokens as `token_id:<id>`"),
    "return_token_ids": _honoured(
        "`token_ids` in each choice, the prompt's `prompt_token_ids` where `vllm serve` puts them"
    ),
    "routed_experts_prompt_start": _refused("routed experts are tensors (per token), which the queue does not carry"),
    "return_token_offsets": _ignored("read by `vllm serve`'s render endpoints only"),
    "mm_payload": _ignored("read by `vllm serve`'s render endpoints only"),
    "return_mm_kwargs": _ignored("read by `vllm serve`'s render endpoints only"),
    "cache_salt": _honoured("goes with the prompt into the engine, as in `vllm serve`"),
    "kv_transfer_params": _refused("disaggregated prefill is not a queue's: run it behind the worker's engine"),
    "ec_transfer_params": _refused("disaggregated encoding is not a queue's"),
    "vllm_xargs": _honoured("the engine's `extra_args`, for its custom extensions"),
    "repetition_detection": _honoured(),
    "thinking_token_budget": _honoured("for a reasoning model"),
    "stream_interval": _honoured("raises the worker's interval for this request, as in `vllm serve`"),
    "add_special_tokens": _honoured("for a text prompt (default true); token ids are sent as they are"),
}

COMPLETION_FIELDS: Final[dict[str, Field]] = {
    **_COMMON,
    "prompt": _honoured(
        "a string, a list of strings, token ids or a list of token-id lists; each prompt is its own request "
        "in the queue, at most 256"
    ),
    "echo": _honoured("the prompt's text (and its logprobs, `null` first) before the completion; `max_tokens` 0"),
    "suffix": _refused("as in `vllm serve`, for models without fill-in-the-middle rendering"),
    "prompt_embeds": _refused("tensors are not carried by the queue"),
}

CHAT_FIELDS: Final[dict[str, Field]] = {
    **_COMMON,
    "add_special_tokens": _honoured("added to the rendered template (default false: it holds them)"),
    "messages": _honoured(
        "text content (a string, or the parts vLLM reads as text: `text`, `refusal`, `thinking`, `input_text`, "
        "`output_text`), assistant `tool_calls`, tool answers"
    ),
    "top_logprobs": _honoured(),
    "max_completion_tokens": _honoured("wins over `max_tokens`"),
    "tools": _honoured("rendered and parsed on the worker by vLLM's renderer and tool parser"),
    "tool_choice": _honoured("`auto` needs the workers' `--enable-auto-tool-choice --tool-call-parser`"),
    "parallel_tool_calls": _honoured("`false`: the first call only, as in `vllm serve`"),
    "reasoning_effort": _honoured(
        "a template variable, with `enable_thinking` (unless `chat_template_kwargs` sets it), as in `vllm serve`"
    ),
    "include_reasoning": _honoured("`false`: no reasoning from the workers' reasoning parser, as in `vllm serve`"),
    "add_generation_prompt": _honoured(),
    "continue_final_message": _honoured(),
    "documents": _honoured("for a template that uses them"),
    "chat_template": _refused(
        "a request's own template (even an empty one): `vllm serve` refuses it too unless trusted",
        lambda value: value is None,
    ),
    "chat_template_kwargs": _honoured("the variables the template uses, as in `vllm serve`"),
    "media_io_kwargs": _refused("media are not carried by the queue: text-only messages"),
    "mm_processor_kwargs": _refused("media are not carried by the queue: text-only messages"),
    "return_prompt_text": _honoured("the rendered prompt's text, on the first chunk or in the response"),
    "echo": _honoured("the last message's content before the reply, when it has the reply's role"),
}

LEGACY_FIELDS: Final[dict[str, Field]] = {
    "best_of": _refused("OpenAI's legacy field, gone from vLLM: accepted when equal to `n`", lambda v: True),
    "functions": _refused("OpenAI's legacy tool field"),
    "function_call": _refused("OpenAI's legacy tool field", lambda v: v is None or v == "none"),
}
"""Fields OpenAI clients still send that vLLM's classes no longer have (``vllm serve``
ignores them; streamq accepts only their neutral values)."""

ENDPOINT_FIELDS: Final[dict[bool, Mapping[str, Field]]] = {False: COMPLETION_FIELDS, True: CHAT_FIELDS}
"""Per endpoint (``chat``), its table."""


def table_markdown(fields: Mapping[str, Field]) -> str:
    """The table of ``fields`` as docs/gateway.md shows it."""
    rows = ["| field | | note |", "|---|---|---|"]
    rows += [f"| `{name}` | {field.support.value} | {field.note} |" for name, field in fields.items()]
    return "\n".join(rows)


def chat_differences() -> dict[str, Field]:
    """The chat endpoint's fields that the completions table does not show as they are."""
    return {name: spec for name, spec in CHAT_FIELDS.items() if COMPLETION_FIELDS.get(name) is not spec}


def tally(fields: Mapping[str, Field]) -> dict[Support, int]:
    """How many fields have each support."""
    counts = dict.fromkeys(Support, 0)
    for field in fields.values():
        counts[field.support] += 1
    return counts


def summary() -> str:
    """The sentence docs/gateway.md opens its table with: how many fields of each class."""
    parts = []
    for name, fields in (("`CompletionRequest`", COMPLETION_FIELDS), ("`ChatCompletionRequest`", CHAT_FIELDS)):
        counts = tally(fields)
        parts.append(
            f"{name}'s {len(fields)}: {counts[Support.HONOURED]} honoured, {counts[Support.IGNORED]} ignored, "
            f"{counts[Support.REFUSED]} refused"
        )
    return "Of vLLM's request fields, " + "; of ".join(parts) + "."
