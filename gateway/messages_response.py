"""A whole chat completion as Anthropic's ``Message``, as ``vllm serve`` converts it: the
reasoning as a ``thinking`` block, the text as a ``text`` block, each tool call as a
``tool_use`` block, the finish reason as ``stop_reason``; built as the anthropic package's
own types and dumped as ``vllm serve`` dumps them (``null`` fields left out).
"""

from __future__ import annotations

import json
import uuid
from typing import Any, Literal, TypeAlias

from anthropic.types import ContentBlock, Message, TextBlock, ThinkingBlock, ToolUseBlock, Usage

StopReason: TypeAlias = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]


def stop_reason(
    finish_reason: str | None, matched: object, *, tool_used: bool, tool_complete: bool
) -> tuple[StopReason | None, str | None]:
    """Anthropic's ``(stop_reason, stop_sequence)`` for an OpenAI finish reason (and
    ``stop_reason``, the stop string that ``matched``, if known): ``max_tokens`` always wins,
    then complete tool calls, then a stop string, as ``vllm serve`` decides."""
    if finish_reason == "length":
        return "max_tokens", None
    if finish_reason not in ("stop", "tool_calls"):
        return None, None
    if tool_complete:
        return "tool_use", None
    if isinstance(matched, str):
        return "stop_sequence", matched
    if finish_reason == "tool_calls" or tool_used:
        return "tool_use", None
    return "end_turn", None


def _input(arguments: str) -> dict[str, Any]:
    """A tool call's arguments as the ``tool_use`` block's input (``{}`` when they are not a
    JSON object: a call cut short by ``max_tokens``)."""
    try:
        parsed = json.loads(arguments)
    except ValueError:
        return {}
    return parsed if isinstance(parsed, dict) else {}


def message_of(response: dict[str, Any]) -> dict[str, Any]:
    """The Messages response of the chat completion ``response`` (its first choice)."""
    choice = response["choices"][0]
    reply = choice["message"]
    calls = reply.get("tool_calls") or []
    content: list[ContentBlock] = []
    if reply.get("reasoning"):
        content.append(ThinkingBlock(type="thinking", thinking=reply["reasoning"], signature=uuid.uuid4().hex))
    if reply.get("content"):
        content.append(TextBlock(type="text", text=reply["content"]))
    for call in calls:
        function = call["function"]
        content.append(
            ToolUseBlock(type="tool_use", id=call["id"], name=function["name"], input=_input(function["arguments"]))
        )
    if not content:  # Anthropic's shape of an empty reply: one empty text block
        content.append(TextBlock(type="text", text=""))
    reason, sequence = stop_reason(
        choice.get("finish_reason"), choice.get("stop_reason"), tool_used=bool(calls), tool_complete=bool(calls)
    )
    used = response.get("usage") or {}
    message = Message(
        id=response["id"],
        type="message",
        role="assistant",
        content=content,
        model=response["model"],
        stop_reason=reason,
        stop_sequence=sequence,
        usage=Usage(input_tokens=used.get("prompt_tokens", 0), output_tokens=used.get("completion_tokens") or 0),
    )
    return message.model_dump(mode="json", exclude_none=True)
