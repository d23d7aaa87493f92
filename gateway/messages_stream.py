"""A streamed chat completion as Anthropic's stream events, as ``vllm serve`` converts it:
``message_start``, then per content block ``content_block_start``, its deltas
(``text_delta``, ``thinking_delta``, ``input_json_delta``) and ``content_block_stop``, then
``message_delta`` (the stop reason and usage, from the usage chunk) and ``message_stop``.
Each event is the anthropic package's own type, as ``event: <type>`` and ``data: <json>``
(the anthropic SDK dispatches on the event name).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from anthropic.types import (
    InputJSONDelta,
    Message,
    MessageDeltaUsage,
    RawContentBlockDeltaEvent,
    RawContentBlockStartEvent,
    RawContentBlockStopEvent,
    RawMessageDeltaEvent,
    RawMessageStartEvent,
    RawMessageStopEvent,
    RawMessageStreamEvent,
    SignatureDelta,
    TextBlock,
    TextDelta,
    ThinkingBlock,
    ThinkingDelta,
    ToolUseBlock,
    Usage,
)
from anthropic.types.raw_message_delta_event import Delta

from gateway.messages_errors import anthropic_error_body, error_of_openai_body
from gateway.messages_response import stop_reason
from producer.openai_api.errors import ApiError

Block = TextBlock | ThinkingBlock | ToolUseBlock


def sse(event: RawMessageStreamEvent, event_id: str | None = None) -> bytes:
    """One event as SSE: its type as the event name, the fields set as its data."""
    data = event.model_dump_json(exclude_unset=True)
    name = event.type
    head = b"" if event_id is None else b"id: %b\n" % event_id.encode()
    return head + b"event: %b\ndata: %b\n\n" % (name.encode(), data.encode())


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


@dataclass
class MessagesFraming:
    """The stream state of one response: which content block is open (a tool call's text is
    held back until its block closes, as ``vllm serve`` holds it), and what decides the stop
    reason."""

    started: bool = False
    failed: bool = False
    index: int = 0
    """The next content block's index."""
    open_block: str | None = None
    tool_use_id: str | None = None
    signature: str | None = None
    held: list[str] = field(default_factory=list)
    finish_reason: str | None = None
    matched: object = None
    tool_used: bool = False
    last_tool_args: list[str] = field(default_factory=list)
    tool_ids: dict[int, str] = field(default_factory=dict)

    def frame(self, chunks: list[bytes], event_id: str | None) -> bytes:
        events: list[RawMessageStreamEvent] = []
        failure = b""
        for chunk in chunks:
            data = json.loads(chunk)
            if "error" in data and "choices" not in data:  # the request failed: the stream ends here
                failure = self.error(error_of_openai_body(data))
                break
            events += self._events(data)
        framed = [sse(event, event_id if i == len(events) - 1 else None) for i, event in enumerate(events)]
        return b"".join(framed) + failure

    def end(self) -> bytes:
        if self.failed:
            return b""
        return b"".join(sse(event) for event in [*self._close_and_flush(), RawMessageStopEvent(type="message_stop")])

    def error(self, error: ApiError) -> bytes:
        self.failed = True
        return b"event: error\ndata: %b\n\n" % json.dumps(anthropic_error_body(error)).encode()

    def _events(self, chunk: dict[str, Any]) -> list[RawMessageStreamEvent]:
        events: list[RawMessageStreamEvent] = []
        if not self.started:
            self.started = True
            usage = Usage(input_tokens=0, output_tokens=0)
            message = Message(
                id=chunk["id"],
                type="message",
                role="assistant",
                content=[],
                model=chunk["model"],
                stop_reason=None,
                stop_sequence=None,
                usage=usage,
            )
            events.append(RawMessageStartEvent(type="message_start", message=message))
        if not chunk["choices"]:  # the usage chunk: the message's end
            events += self._close_and_flush()
            reason, sequence = stop_reason(
                self.finish_reason or "stop",
                self.matched,
                tool_used=self.tool_used,
                tool_complete=self.tool_used and _is_json("".join(self.last_tool_args)),
            )
            used = chunk.get("usage") or {}
            usage_delta = MessageDeltaUsage(
                input_tokens=used.get("prompt_tokens", 0), output_tokens=used.get("completion_tokens") or 0
            )
            stop = Delta(stop_reason=reason, stop_sequence=sequence)
            events.append(RawMessageDeltaEvent(type="message_delta", delta=stop, usage=usage_delta))
            return events
        choice = chunk["choices"][0]
        if choice.get("finish_reason") is not None:
            self.finish_reason, self.matched = choice["finish_reason"], choice.get("stop_reason")
        delta = choice.get("delta") or {}
        if delta.get("reasoning"):
            if self.open_block != "thinking":
                events += self._close_and_flush()
                events.append(self._start(ThinkingBlock(type="thinking", thinking="", signature="")))
            thinking = ThinkingDelta(type="thinking_delta", thinking=delta["reasoning"])
            events.append(self._delta(thinking))
        if delta.get("content"):
            if self.open_block == "tool_use":
                self.held.append(delta["content"])
            else:
                if self.open_block != "text":
                    events += self._close_and_flush()
                    events.append(self._start(TextBlock(type="text", text="")))
                events.append(self._delta(TextDelta(type="text_delta", text=delta["content"])))
        for call in delta.get("tool_calls") or []:
            events += self._tool_call(call)
        return events

    def _tool_call(self, call: dict[str, Any]) -> list[RawMessageStreamEvent]:
        """A tool call's delta: a new ``tool_use`` block when it names a new call, its
        arguments as ``input_json_delta``."""
        events: list[RawMessageStreamEvent] = []
        function = call.get("function") or {}
        call_id = call.get("id")
        if call_id is not None:
            self.tool_ids[call["index"]] = call_id
            if self.tool_use_id != call_id and function.get("name") is not None:
                events += self._close_and_flush()
                self.tool_used = True
                self.last_tool_args = []
                events.append(self._start(ToolUseBlock(type="tool_use", id=call_id, name=function["name"], input={})))
        else:
            call_id = self.tool_ids.get(call["index"])
        arguments = function.get("arguments")
        if arguments and call_id is not None and self.tool_use_id == call_id:
            self.last_tool_args.append(arguments)
            events.append(self._delta(InputJSONDelta(type="input_json_delta", partial_json=arguments)))
        return events

    def _start(self, block: Block) -> RawMessageStreamEvent:
        self.open_block = block.type
        self.tool_use_id = block.id if isinstance(block, ToolUseBlock) else None
        # A thinking block opens with an empty signature, as Anthropic's do; it comes as a
        # delta before the block stops.
        self.signature = uuid.uuid4().hex if isinstance(block, ThinkingBlock) else None
        return RawContentBlockStartEvent(type="content_block_start", index=self.index, content_block=block)

    def _delta(self, delta: TextDelta | ThinkingDelta | InputJSONDelta | SignatureDelta) -> RawMessageStreamEvent:
        return RawContentBlockDeltaEvent(type="content_block_delta", index=self.index, delta=delta)

    def _close(self) -> list[RawMessageStreamEvent]:
        """The open block's end (a thinking block's signature first)."""
        if self.open_block is None:
            return []
        events: list[RawMessageStreamEvent] = []
        if self.signature is not None:
            events.append(self._delta(SignatureDelta(type="signature_delta", signature=self.signature)))
        events.append(RawContentBlockStopEvent(type="content_block_stop", index=self.index))
        self.open_block, self.tool_use_id, self.signature = None, None, None
        self.index += 1
        return events

    def _close_and_flush(self) -> list[RawMessageStreamEvent]:
        """Close the open block, then send the text held back during a tool call as a text
        block of its own."""
        held, self.held = "".join(self.held), []
        events = self._close()
        if held:
            events.append(self._start(TextBlock(type="text", text="")))
            events.append(self._delta(TextDelta(type="text_delta", text=held)))
            events += self._close()
        return events
