"""Every field of vLLM's ``AnthropicMessagesRequest``, and what the gateway's ``/v1/messages``
does with it: one table, read by the body mapping (``gateway.messages_request``), rendered
into docs/gateway.md, and held against vLLM's own class by a test, as the OpenAI tables are
(``producer.openai_api.fields``).

A field that ``vllm serve`` hands on to its chat completions as it is (``PASSED_ON``) is
passed on here too, and the chat completions table decides it. Fields of Anthropic's API
that vLLM's class lacks are ignored, as ``vllm serve`` ignores them.
"""

from __future__ import annotations

from typing import Final

from producer.openai_api.fields import CHAT_FIELDS, Field, Support

PASSED_ON: Final = (
    "watermarking",
    "vllm_xargs",
    "chat_template_kwargs",
    "cache_salt",
    "kv_transfer_params",
    "ec_transfer_params",
)
"""vLLM's own fields, which the chat completions body carries under the same name."""

MESSAGES_FIELDS: Final[dict[str, Field]] = {
    "model": Field(Support.HONOURED, "routes the request to the queue of the workers serving that model"),
    "messages": Field(
        Support.HONOURED,
        "`user` and `assistant` turns of text, `tool_use`, `tool_result` (text) and `thinking` blocks "
        "(`redacted_thinking` skipped, as in `vllm serve`); `image` and tool-change blocks, and `system` "
        "turns (give `system`), are refused",
    ),
    "max_tokens": Field(Support.HONOURED, "required, as in Anthropic's API"),
    "metadata": Field(Support.IGNORED, "as in `vllm serve`"),
    "output_config": Field(
        Support.HONOURED,
        "`format` (a JSON schema) as `response_format`; `effort` as `reasoning_effort`, as in `vllm serve`",
    ),
    "thinking": Field(
        Support.HONOURED,
        "`enabled`: its `budget_tokens` as `thinking_token_budget`; `adaptive` pins nothing, as in "
        "`vllm serve`; `disabled` as `reasoning_effort` `none` (`vllm serve` probes the template for the "
        "effort that turns thinking off; `none` is what it finds for templates that can)",
    ),
    "stop_sequences": Field(
        Support.HONOURED,
        "as `stop`; a response they end says `end_turn`, not `stop_sequence`: the queue's events do not "
        "say which string matched",
    ),
    "stream": Field(Support.HONOURED, "Anthropic's events, as the anthropic SDK reads them"),
    "system": Field(Support.HONOURED, "a string or text blocks, joined, as the first (system) message"),
    "temperature": Field(Support.HONOURED),
    "tool_choice": Field(
        Support.HONOURED,
        "`auto`, `any` (`required`), `none`, `tool` (a named tool); `disable_parallel_tool_use` as "
        "`parallel_tool_calls`; `auto` needs the workers' `--enable-auto-tool-choice --tool-call-parser`",
    ),
    "tools": Field(Support.HONOURED, "as function tools: `input_schema` as `parameters`, `strict`"),
    "top_k": Field(Support.HONOURED),
    "top_p": Field(Support.HONOURED),
    "mm_payload": Field(Support.IGNORED, "read by `vllm serve`'s render endpoints only"),
    "return_mm_kwargs": Field(Support.IGNORED, "read by `vllm serve`'s render endpoints only"),
    **{name: CHAT_FIELDS[name] for name in PASSED_ON},
}
