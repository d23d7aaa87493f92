"""Every field of vLLM's ``ResponsesRequest``, and what the gateway does with it: one table,
read by the body mapping (``gateway.responses_input``), rendered into docs/gateway.md and
held against vLLM's own class by a test, as ``producer.openai_api.fields`` is for chat.

A field that means in the Responses API what it means in chat completions is passed to the
chat mapping as it is, and its row is the chat table's own (``CHAT_FIELDS``), so both
tables always say the same of it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Final

from producer.openai_api.fields import CHAT_FIELDS, Field, Support, tally


def _honoured(note: str) -> Field:
    return Field(Support.HONOURED, note)


def _ignored(note: str) -> Field:
    return Field(Support.IGNORED, note)


def _refused(note: str, is_default: Callable[[Any], bool] | None = None) -> Field:
    return Field(Support.REFUSED, note) if is_default is None else Field(Support.REFUSED, note, is_default)


PASSED_TO_CHAT: Final = (
    "model",
    "logit_bias",
    "parallel_tool_calls",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "user",
    "skip_special_tokens",
    "include_stop_str_in_output",
    "presence_penalty",
    "frequency_penalty",
    "watermarking",
    "request_id",
    "session_id",
    "media_io_kwargs",
    "mm_processor_kwargs",
    "priority",
    "mm_payload",
    "return_mm_kwargs",
    "cache_salt",
    "structured_outputs",
    "repetition_penalty",
    "seed",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "vllm_xargs",
    "kv_transfer_params",
    "ec_transfer_params",
    "chat_template_kwargs",
    "include_reasoning",
)
"""Fields the chat mapping takes under the same name and meaning."""

_OWN: Final[dict[str, Field]] = {
    "background": _honoured("a queued job that outlives the HTTP request; `GET`, `cancel` and resume it by id"),
    "include": _honoured("`message.output_text.logprobs` (with `top_logprobs`); the others ignored, as `vllm serve`"),
    "input": _honoured("a string, or message, `function_call`, `function_call_output` and `reasoning` items (text)"),
    "instructions": _honoured("a system message first; not carried over by `previous_response_id`"),
    "max_output_tokens": _honoured("the chat's `max_completion_tokens`"),
    "max_tool_calls": _ignored("`vllm serve` reads it for its built-in tools only"),
    "metadata": _honoured("kept and returned"),
    "previous_response_id": _honoured("a stored response's input and output before this input"),
    "prompt": _refused("prompt templates, as `vllm serve` refuses them"),
    "reasoning": _honoured(
        "`effort` goes to the chat template (`reasoning_effort`, `enable_thinking`), as `vllm serve`"
    ),
    "service_tier": _ignored("as in `vllm serve`"),
    "store": _honoured("`false`: the response cannot be read back (404)"),
    "stream": _honoured("the typed `response.*` events"),
    "text": _honoured("`format`: `json_schema` and `json_object` become structured outputs"),
    "tool_choice": _honoured("`auto`, `none`, `required` or a named function"),
    "tools": _honoured("function tools; built-in tools (web search, MCP, ...) are refused"),
    "top_logprobs": _honoured('with `include: ["message.output_text.logprobs"]`'),
    "truncation": _refused("`auto` is not carried by the queue", lambda v: v is None or v == "disabled"),
    "prompt_cache_key": _ignored("as in `vllm serve`"),
    "enable_response_messages": _refused("raw prompt and output messages are not carried by the queue"),
    "previous_input_messages": _refused("harmony messages: send `input` items"),
}

RESPONSES_FIELDS: Final[dict[str, Field]] = {
    **{name: CHAT_FIELDS[name] for name in PASSED_TO_CHAT},
    **_OWN,
}
"""Every field, the passed ones first."""


def summary() -> str:
    """The sentence docs/gateway.md opens the Responses table with."""
    counts = tally(RESPONSES_FIELDS)
    return (
        f"Of vLLM's `ResponsesRequest`'s {len(RESPONSES_FIELDS)} fields: {counts[Support.HONOURED]} honoured, "
        f"{counts[Support.IGNORED]} ignored, {counts[Support.REFUSED]} refused."
    )
