"""A Responses API body as the chat completions body that asks the same, as ``vllm serve``
renders one (``vllm/entrypoints/openai/responses/utils.py``): ``instructions`` a system
message, then the conversation before (``previous_response_id``), then ``input``, its items
folded into chat messages (a function call joins the assistant message before it, its
output is a tool message). Fields that mean the same in both pass as they are
(``gateway.responses_fields``); a field or item this gateway cannot carry is a 400 naming it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Final

from gateway.responses_fields import PASSED_TO_CHAT, RESPONSES_FIELDS
from producer.errors import InvalidParameter
from producer.openai_api.fields import Support

LOGPROBS_INCLUDE: Final = "message.output_text.logprobs"
TEXT_PARTS: Final = frozenset({"input_text", "output_text", "text", "reasoning_text", "summary_text"})
MESSAGE_ROLES: Final = frozenset({"user", "system", "developer", "assistant"})


def chat_body(body: object, history: Sequence[Mapping[str, Any]] = ()) -> dict[str, Any]:
    """The chat completions body of Responses ``body``, ``history`` (chat messages of the
    stored conversation it continues) before its input."""
    if not isinstance(body, Mapping):
        raise InvalidParameter("the request body must be a JSON object", param="body")
    _check_fields(body)
    chat: dict[str, Any] = {name: body[name] for name in PASSED_TO_CHAT if name in body}
    messages: list[dict[str, Any]] = []
    if body.get("instructions"):
        messages.append({"role": "system", "content": _string(body["instructions"], "instructions")})
    messages += [dict(m) for m in history if m.get("role") != "system"]  # instructions do not carry over
    messages += input_messages(body.get("input"))
    chat["messages"] = messages
    if body.get("max_output_tokens") is not None:
        chat["max_completion_tokens"] = body["max_output_tokens"]
    if body.get("stream"):
        chat["stream"] = True
        chat["stream_options"] = {"include_usage": True}  # the completed event carries the usage
    chat.update(_logprobs(body))
    chat.update(_text_format(body.get("text")))
    chat.update(_tools(body))
    template_kwargs = _reasoning_kwargs(body.get("reasoning"), chat.get("chat_template_kwargs"))
    if template_kwargs:
        chat["chat_template_kwargs"] = template_kwargs
    return chat


def _check_fields(body: Mapping[str, Any]) -> None:
    unknown = sorted(set(body) - set(RESPONSES_FIELDS) - {"conversation"})
    if unknown:
        raise InvalidParameter(f"unknown field(s): {', '.join(unknown)}", param=unknown[0])
    for name, spec in RESPONSES_FIELDS.items():
        if name not in PASSED_TO_CHAT and spec.support is Support.REFUSED and not spec.is_default(body.get(name)):
            raise InvalidParameter(f"{name} is not supported: {spec.note}", param=name)
    if body.get("conversation") is not None:
        raise InvalidParameter("conversation objects are not supported: use previous_response_id", param="conversation")
    if "input" not in body:
        raise InvalidParameter("'input' is required: a string or a list of input items", param="input")


def input_messages(value: object) -> list[dict[str, Any]]:
    """``input`` as chat messages: a string is the user's message; a list of items folds
    into messages as ``vllm serve`` folds them."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list):
        raise InvalidParameter("'input' must be a string or a list of input items", param="input")
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(value):
        where = f"input[{i}]"
        if not isinstance(item, Mapping):
            raise InvalidParameter(f"{where} must be an object", param="input")
        message = _item_message(item, where, messages[-1] if messages else None)
        if message is not None:
            messages.append(message)
    return messages


def _item_message(item: Mapping[str, Any], where: str, before: dict[str, Any] | None) -> dict[str, Any] | None:
    """The chat message of one input item, or ``None`` where it joined ``before`` (an
    assistant message that lacked that part)."""
    kind = item.get("type", "message")
    assistant = before if before is not None and before.get("role") == "assistant" else None
    if kind == "function_call":
        call = {
            "id": _string(item.get("call_id"), f"{where}.call_id"),
            "type": "function",
            "function": {
                "name": _string(item.get("name"), f"{where}.name"),
                "arguments": _string(item.get("arguments"), f"{where}.arguments"),
            },
        }
        if assistant is not None:
            assistant.setdefault("tool_calls", []).append(call)
            return None
        return {"role": "assistant", "content": None, "tool_calls": [call]}
    if kind == "function_call_output":
        output = item.get("output")
        answer = output if isinstance(output, str) else _text(output, f"{where}.output")
        return {"role": "tool", "content": answer, "tool_call_id": _string(item.get("call_id"), f"{where}.call_id")}
    if kind == "reasoning":
        if item.get("encrypted_content"):
            raise InvalidParameter(f"{where}: encrypted reasoning content is not supported", param="input")
        parts = item.get("content") or item.get("summary") or []
        reasoning = _text(parts[:1], f"{where}.content") if isinstance(parts, list) else ""
        if assistant is not None and assistant.get("reasoning") is None:
            assistant["reasoning"] = reasoning
            return None
        return {"role": "assistant", "content": None, "reasoning": reasoning}
    if kind != "message":
        raise InvalidParameter(f"{where}: unsupported input item type: {kind}", param="input")
    role = item.get("role")
    if role not in MESSAGE_ROLES:
        raise InvalidParameter(f"{where}.role must be one of {', '.join(sorted(MESSAGE_ROLES))}", param="input")
    content = item.get("content")
    text: str = content if isinstance(content, str) else _text(content, f"{where}.content")
    if role == "assistant" and assistant is not None and assistant.get("content") is None:
        assistant["content"] = text
        return None
    return {"role": role, "content": text}


def _text(parts: object, where: str) -> str:
    """Text content parts joined by newlines, as the chat mapping joins them."""
    if not isinstance(parts, list):
        raise InvalidParameter(f"{where} must be a string or a list of text parts", param="input")
    texts = []
    for j, part in enumerate(parts):
        if not isinstance(part, Mapping) or part.get("type") not in TEXT_PARTS or not isinstance(part.get("text"), str):
            kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
            raise InvalidParameter(f"{where}[{j}]: only text parts are supported, got {kind}", param="input")
        texts.append(part["text"])
    return "\n".join(texts)


def _string(value: object, where: str) -> str:
    if not isinstance(value, str):
        raise InvalidParameter(f"{where} must be a string", param=where.split("[")[0].split(".")[0])
    return value


def _logprobs(body: Mapping[str, Any]) -> dict[str, Any]:
    include = body.get("include") or []
    if not isinstance(include, list) or not all(isinstance(name, str) for name in include):
        raise InvalidParameter("'include' must be a list of strings", param="include")
    if LOGPROBS_INCLUDE not in include:
        return {}
    return {"logprobs": True, "top_logprobs": body.get("top_logprobs") or 0}


def _text_format(text: object) -> dict[str, Any]:
    """``text.format`` as the chat's ``response_format``."""
    if text is None:
        return {}
    form = text.get("format") if isinstance(text, Mapping) else None
    if form is None:
        return {}
    kind = form.get("type") if isinstance(form, Mapping) else None
    if kind == "text":
        return {}
    if kind == "json_object":
        return {"response_format": {"type": "json_object"}}
    if kind == "json_schema" and isinstance(form, Mapping):
        schema = {key: form[key] for key in ("name", "description", "schema", "strict") if key in form}
        return {"response_format": {"type": "json_schema", "json_schema": schema}}
    raise InvalidParameter("text.format.type must be text, json_object or json_schema", param="text")


def _tools(body: Mapping[str, Any]) -> dict[str, Any]:
    """Function tools and the tool choice in chat's nesting; without tools, ``auto`` and
    ``none`` mean none, as ``vllm serve`` reads them."""
    tools = body.get("tools") or []
    choice = body.get("tool_choice", "auto")
    if not isinstance(tools, list):
        raise InvalidParameter("'tools' must be a list", param="tools")
    chat_tools = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, Mapping) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, Mapping) else type(tool).__name__
            raise InvalidParameter(f"tools[{i}]: only function tools are supported, got {kind}", param="tools")
        function = {key: tool[key] for key in ("name", "description", "parameters", "strict") if key in tool}
        chat_tools.append({"type": "function", "function": function})
    if not chat_tools:
        if choice in (None, "auto", "none"):
            return {}
        raise InvalidParameter("tool_choice needs tools", param="tool_choice")
    chat: dict[str, Any] = {"tools": chat_tools}
    if isinstance(choice, Mapping) and choice.get("type") == "function":
        chat["tool_choice"] = {"type": "function", "function": {"name": choice.get("name")}}
    elif choice is not None:
        chat["tool_choice"] = choice
    return chat


def _reasoning_kwargs(reasoning: object, kwargs: object) -> dict[str, Any]:
    """The chat template's variables with ``reasoning.effort`` among them, as ``vllm serve``
    renders them (``enable_thinking`` too, unless the request set it)."""
    merged: dict[str, Any] = dict(kwargs) if isinstance(kwargs, Mapping) else {}
    effort = reasoning.get("effort") if isinstance(reasoning, Mapping) else None
    if effort is not None:
        merged.setdefault("reasoning_effort", effort)
        merged.setdefault("enable_thinking", effort != "none")
    return merged
