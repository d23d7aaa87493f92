"""An Anthropic Messages body as the OpenAI chat completions body that asks the same, as
``vllm serve`` maps it (``vllm/entrypoints/anthropic/serving.py``): ``system`` becomes the
first message, ``tool_use`` blocks an assistant's ``tool_calls``, ``tool_result`` blocks
``tool`` messages, ``thinking`` blocks an assistant's ``reasoning``; tools become function
tools, ``tool_choice`` OpenAI's.

Each piece is checked against the anthropic package's own request types (its TypedDicts,
validated by pydantic) before it is mapped, so a malformed block is a 400 naming where it
is, never a worker's error.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, Final

import pydantic
from anthropic.types import (
    RedactedThinkingBlockParam,
    TextBlockParam,
    ThinkingBlockParam,
    ToolChoiceAnyParam,
    ToolChoiceAutoParam,
    ToolChoiceNoneParam,
    ToolChoiceToolParam,
    ToolParam,
    ToolResultBlockParam,
    ToolUseBlockParam,
)

from gateway.messages_fields import PASSED_ON
from producer.errors import InvalidParameter

_BLOCKS: Final[dict[str, pydantic.TypeAdapter[Any]]] = {
    "text": pydantic.TypeAdapter(TextBlockParam),
    "tool_use": pydantic.TypeAdapter(ToolUseBlockParam),
    "tool_result": pydantic.TypeAdapter(ToolResultBlockParam),
    "thinking": pydantic.TypeAdapter(ThinkingBlockParam),
    "redacted_thinking": pydantic.TypeAdapter(RedactedThinkingBlockParam),
}
_REFUSED_BLOCKS: Final = {
    "image": "images are not carried by the queue (text-only messages)",
    "tool_reference": "tool references are not supported by streamq",
    "tool_addition": "tool changes are not supported by streamq: declare the tools in `tools`",
    "tool_removal": "tool changes are not supported by streamq: declare the tools in `tools`",
}
_TOOL_CHOICES: Final[dict[str, pydantic.TypeAdapter[Any]]] = {
    "auto": pydantic.TypeAdapter(ToolChoiceAutoParam),
    "any": pydantic.TypeAdapter(ToolChoiceAnyParam),
    "tool": pydantic.TypeAdapter(ToolChoiceToolParam),
    "none": pydantic.TypeAdapter(ToolChoiceNoneParam),
}
_OPENAI_TOOL_CHOICE: Final = {"auto": "auto", "any": "required", "none": "none"}
_TOOL = pydantic.TypeAdapter(ToolParam)
BILLING_HEADER: Final = "x-anthropic-billing-header"
"""Claude Code's per-request attribution line in ``system``, dropped as ``vllm serve`` drops
it: its hash would change every prompt's prefix."""

EFFORTS: Final = ("low", "medium", "high", "xhigh", "max")
"""``output_config.effort``'s values (vLLM's ``AnthropicEffort``), passed on as the chat
template's ``reasoning_effort``."""
DISABLED_THINKING_EFFORT: Final = "none"
"""``thinking.type: disabled`` as ``reasoning_effort``: what ``vllm serve`` sends a template
that honours ``none`` (it probes the template for that; a template that cannot turn
thinking off gets ``none`` here too, which it ignores)."""


def _checked(adapter: pydantic.TypeAdapter[Any], value: object, where: str, param: str) -> Any:
    """``value`` validated as ``adapter``'s type; a 400 naming the first wrong field."""
    try:
        adapter.validate_python(value)
    except pydantic.ValidationError as exc:
        error = exc.errors()[0]
        path = "".join(f"[{part}]" if isinstance(part, int) else f".{part}" for part in error["loc"])
        raise InvalidParameter(f"{where}{path}: {error['msg']}", param=param) from None
    return value


def _object(value: object, where: str, param: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise InvalidParameter(f"{where} must be an object", param=param)
    return value


def _block(block: object, where: str, param: str) -> Mapping[str, Any]:
    """A content block, its type one this gateway maps, its fields checked."""
    block = _object(block, where, param)
    kind = block.get("type")
    if kind in _REFUSED_BLOCKS:
        raise InvalidParameter(f"{where}: {kind} blocks are refused: {_REFUSED_BLOCKS[kind]}", param=param)
    if kind not in _BLOCKS:
        known = ", ".join(sorted(_BLOCKS))
        raise InvalidParameter(f"{where}.type: unknown content block type {kind!r} (known: {known})", param=param)
    checked: Mapping[str, Any] = _checked(_BLOCKS[kind], block, where, param)
    return checked


def _system(system: object) -> str | None:
    """The top-level ``system``, a string or text blocks, as one string (``None``: none)."""
    if system is None or system == "":
        return None
    if isinstance(system, str):
        return system
    if not isinstance(system, list):
        raise InvalidParameter("system must be a string or a list of text blocks", param="system")
    parts = []
    for i, block in enumerate(system):
        block = _checked(_BLOCKS["text"], _object(block, f"system[{i}]", "system"), f"system[{i}]", "system")
        if block.get("type") != "text":
            raise InvalidParameter(f"system[{i}] must be a text block", param="system")
        if block["text"] and not block["text"].startswith(BILLING_HEADER):
            parts.append(block["text"])
    return "".join(parts) or None


def _tool_result_text(block: Mapping[str, Any], where: str) -> str:
    """A ``tool_result``'s content as text: a string, or its text blocks joined by lines."""
    content = block.get("content")
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        raise InvalidParameter(f"{where}.content must be a string or a list of text blocks", param="messages")
    texts = []
    for j, item in enumerate(content):
        item = _block(item, f"{where}.content[{j}]", "messages")
        if item["type"] != "text":
            raise InvalidParameter(f"{where}.content[{j}] must be a text block", param="messages")
        texts.append(item["text"])
    return "\n".join(texts)


def _messages(messages: object) -> list[dict[str, Any]]:
    """The conversation's turns as OpenAI messages (a user turn's ``tool_result`` blocks as
    ``tool`` messages before what else it says)."""
    if not isinstance(messages, list) or not messages:
        raise InvalidParameter("messages must be a non-empty list of {role, content} objects", param="messages")
    out: list[dict[str, Any]] = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        message = _object(message, where, "messages")
        role, content = message.get("role"), message.get("content")
        if role == "system":
            raise InvalidParameter(f"{where}: give the system prompt in `system`, not as a turn", param="messages")
        if role not in ("user", "assistant"):
            raise InvalidParameter(f"{where}.role must be 'user' or 'assistant'", param="messages")
        if isinstance(content, str):
            out.append({"role": role, "content": content})
            continue
        if not isinstance(content, list):
            raise InvalidParameter(f"{where}.content must be a string or a list of content blocks", param="messages")
        texts: list[str] = []
        calls: list[dict[str, Any]] = []
        reasoning: list[str] = []
        for j, block in enumerate(content):
            block = _block(block, f"{where}.content[{j}]", "messages")
            kind = block["type"]
            if kind == "text" and block["text"]:
                texts.append(block["text"])
            elif kind == "thinking":
                reasoning.append(block["thinking"])
            elif kind == "tool_use":
                function = {"name": block["name"], "arguments": json.dumps(block["input"] or {})}
                calls.append({"id": block["id"], "type": "function", "function": function})
            elif kind == "tool_result":
                result = _tool_result_text(block, f"{where}.content[{j}]")
                if role == "user":
                    out.append({"role": "tool", "tool_call_id": block["tool_use_id"], "content": result})
                else:
                    texts.append(f"Tool result: {result}")
        turn: dict[str, Any] = {"role": role}
        if reasoning:
            turn["reasoning"] = "".join(reasoning)
        if calls:
            turn["tool_calls"] = calls
        if texts:
            turn["content"] = texts[0] if len(texts) == 1 else [{"type": "text", "text": text} for text in texts]
        elif role == "assistant":
            turn["content"] = None if calls else ""
        if "content" in turn:
            out.append(turn)
    return out


def _tools(body: Mapping[str, Any]) -> dict[str, Any]:
    """``tools`` and ``tool_choice`` as OpenAI's (``auto`` with tools and no choice)."""
    chat: dict[str, Any] = {}
    choice = body.get("tool_choice")
    if choice is not None:
        choice = _object(choice, "tool_choice", "tool_choice")
        kind = choice.get("type")
        if kind not in _TOOL_CHOICES:
            known = ", ".join(_TOOL_CHOICES)
            raise InvalidParameter(f"tool_choice.type must be one of {known}, got {kind!r}", param="tool_choice")
        _checked(_TOOL_CHOICES[kind], choice, "tool_choice", "tool_choice")
        named = {"type": "function", "function": {"name": choice.get("name")}}
        chat["tool_choice"] = named if kind == "tool" else _OPENAI_TOOL_CHOICE[kind]
        chat["parallel_tool_calls"] = not choice.get("disable_parallel_tool_use")
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list):
            raise InvalidParameter("tools must be a list of tools", param="tools")
        functions = []
        for i, tool in enumerate(tools):
            tool = _checked(_TOOL, _object(tool, f"tools[{i}]", "tools"), f"tools[{i}]", "tools")
            schema = {"type": "object", **tool["input_schema"]}
            function = {"name": tool["name"], "description": tool.get("description"), "parameters": schema}
            function["strict"] = tool.get("strict")
            functions.append({"type": "function", "function": {k: v for k, v in function.items() if v is not None}})
        chat["tools"] = functions
        chat.setdefault("tool_choice", "auto")
    return chat


def _output(body: Mapping[str, Any]) -> dict[str, Any]:
    """``output_config`` and ``thinking`` as the chat fields they set."""
    chat: dict[str, Any] = {}
    output = body.get("output_config")
    if output is not None:
        output = _object(output, "output_config", "output_config")
        effort = output.get("effort")
        if effort is not None:
            if effort not in EFFORTS:
                message = f"output_config.effort must be one of {', '.join(EFFORTS)}"
                raise InvalidParameter(message, param="output_config")
            chat["reasoning_effort"] = effort
        form = output.get("format")
        if form is not None:
            form = _object(form, "output_config.format", "output_config")
            if form.get("type", "json_schema") != "json_schema" or not isinstance(form.get("schema"), Mapping):
                message = "output_config.format must be {type: json_schema, schema: {...}}"
                raise InvalidParameter(message, param="output_config")
            schema = {"name": "json_schema", "schema": form["schema"]}
            chat["response_format"] = {"type": "json_schema", "json_schema": schema}
    thinking = body.get("thinking")
    if thinking is not None:
        thinking = _object(thinking, "thinking", "thinking")
        kind = thinking.get("type")
        if kind == "enabled":
            budget = thinking.get("budget_tokens")
            if not isinstance(budget, int) or budget < 1024 or budget >= body["max_tokens"]:
                message = "thinking.budget_tokens must be an integer of at least 1024, less than max_tokens"
                raise InvalidParameter(message, param="thinking")
            chat["thinking_token_budget"] = budget
        elif kind == "disabled":  # after output_config's effort, as vllm serve sets it
            chat["reasoning_effort"] = DISABLED_THINKING_EFFORT
        elif kind != "adaptive":
            raise InvalidParameter("thinking.type must be enabled, disabled or adaptive", param="thinking")
    return chat


def _max_tokens(body: Mapping[str, Any]) -> int:
    max_tokens = body.get("max_tokens")
    if max_tokens is None:
        raise InvalidParameter("max_tokens: field required", param="max_tokens")
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens <= 0:
        raise InvalidParameter("max_tokens must be a positive integer", param="max_tokens")
    return max_tokens


def _conversation(body: Mapping[str, Any]) -> dict[str, Any]:
    """What a Messages body and a count_tokens body share: model, messages, tools."""
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise InvalidParameter("model: field required (the name of a model that /v1/models lists)", param="model")
    system = _system(body.get("system"))
    messages = ([{"role": "system", "content": system}] if system else []) + _messages(body.get("messages"))
    passed = {name: body[name] for name in PASSED_ON if body.get(name) is not None}
    return {"model": model, "messages": messages, **_tools(body), **passed}


def messages_to_chat(body: object) -> dict[str, Any]:
    """The OpenAI chat completions body of an Anthropic Messages body; a 400
    (``InvalidParameter``) naming the field for a body ``vllm serve`` refuses or that
    this gateway cannot honour (``gateway.messages_fields``)."""
    body = _object(body, "the request body", "body")
    chat = {**_conversation(body), "max_tokens": _max_tokens(body), **_output(body)}
    for name, param in (("temperature", "temperature"), ("top_p", "top_p"), ("top_k", "top_k")):
        if body.get(name) is not None:
            chat[param] = body[name]
    stop = body.get("stop_sequences")
    if stop is not None:
        if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
            raise InvalidParameter("stop_sequences must be a list of strings", param="stop_sequences")
        chat["stop"] = stop
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise InvalidParameter("stream must be true or false", param="stream")
    if stream:
        chat |= {"stream": True, "stream_options": {"include_usage": True}}
    return chat


def count_tokens_to_chat(body: object) -> dict[str, Any]:
    """The OpenAI chat body whose rendered prompt a count_tokens body counts."""
    return _conversation(_object(body, "the request body", "body"))
