"""A chat completion as a Responses API response: whole (``whole_response``), or chunk by
chunk as the typed ``response.*`` events (``ResponsesFraming``), built from the openai
package's own types as ``vllm serve`` builds them
(``vllm/entrypoints/openai/responses/streaming_events.py``): a reasoning item, a message,
then a function call item per tool call, in the order the model wrote them.

Everything is derived from the chat chunks alone, which are derived from the request's
replay log alone: item ids are the response's id and the item's place, so a stream read
again from the log (by another gateway, after a crash) has the same events with the same
``sequence_number``s.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, Literal

import msgspec
from openai.types.responses import (
    Response,
    ResponseCompletedEvent,
    ResponseContentPartAddedEvent,
    ResponseContentPartDoneEvent,
    ResponseCreatedEvent,
    ResponseErrorEvent,
    ResponseFunctionCallArgumentsDeltaEvent,
    ResponseFunctionCallArgumentsDoneEvent,
    ResponseFunctionToolCall,
    ResponseInProgressEvent,
    ResponseOutputItem,
    ResponseOutputItemAddedEvent,
    ResponseOutputItemDoneEvent,
    ResponseOutputMessage,
    ResponseOutputText,
    ResponseReasoningItem,
    ResponseReasoningTextDeltaEvent,
    ResponseReasoningTextDoneEvent,
    ResponseStatus,
    ResponseStreamEvent,
    ResponseTextDeltaEvent,
    ResponseTextDoneEvent,
    ResponseUsage,
    response_output_text,
    response_text_delta_event,
)
from openai.types.responses.response_reasoning_item import Content as ReasoningText
from openai.types.responses.response_usage import InputTokensDetails, OutputTokensDetails
from pydantic import BaseModel, ValidationError

from producer.errors import InvalidParameter
from producer.openai_api.errors import ApiError

RESPONSE_ID_PREFIX: Final = "resp_"


def response_id(request_id: str) -> str:
    """The response id of the queued request ``request_id`` (and back: ``request_id_of``)."""
    return RESPONSE_ID_PREFIX + request_id


def request_id_of(response_id: str) -> str | None:
    """The queued request of ``response_id``; ``None`` for an id no response of the gateway has."""
    return response_id.removeprefix(RESPONSE_ID_PREFIX) if response_id.startswith(RESPONSE_ID_PREFIX) else None


def dump(model: BaseModel) -> dict[str, Any]:
    """A response or event as JSON, with the keys it was given (``vllm serve``'s own)."""
    return model.model_dump(mode="json", exclude_unset=True, by_alias=True)


@dataclass(frozen=True)
class ResponseHead:
    """What every state of one response names: its ids, when it was created, and what its
    request asked (the body as its client sent it)."""

    request_id: str
    model: str
    created_at: int
    body: Mapping[str, Any]

    @property
    def id(self) -> str:
        return response_id(self.request_id)

    def item_id(self, prefix: str, output_index: int) -> str:
        return f"{prefix}_{self.request_id}_{output_index}"

    def response(
        self,
        status: ResponseStatus,
        output: Sequence[ResponseOutputItem] = (),
        usage: ResponseUsage | None = None,
        error: ApiError | None = None,
    ) -> Response:
        """The response in ``status``, as ``vllm serve``'s ``ResponsesResponse.from_request``
        fills it (sampling values as the request asked them, or their defaults)."""
        body = self.body
        tools = body.get("tools") or []
        choice = body.get("tool_choice", "auto")
        fields: dict[str, Any] = {
            "id": self.id,
            "created_at": self.created_at,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": body.get("instructions"),
            "metadata": body.get("metadata"),
            "model": self.model,
            "object": "response",
            "output": [dump(item) for item in output],
            "parallel_tool_calls": body.get("parallel_tool_calls", True),
            "temperature": body.get("temperature", 1.0),
            "tool_choice": "none" if not tools and choice in ("auto", "none", None) else choice,
            "tools": tools,
            "top_p": body.get("top_p", 1.0),
            "background": bool(body.get("background")),
            "max_output_tokens": body.get("max_output_tokens"),
            "max_tool_calls": body.get("max_tool_calls"),
            "previous_response_id": body.get("previous_response_id"),
            "reasoning": body.get("reasoning"),
            "service_tier": body.get("service_tier", "auto"),
            "status": status,
            "text": body.get("text"),
            "top_logprobs": body.get("top_logprobs", 0),
            "truncation": body.get("truncation", "disabled"),
            "usage": None if usage is None else dump(usage),
            "user": body.get("user"),
        }
        if error is not None:
            fields["error"] = {"code": "server_error", "message": error.message}
        return Response.model_validate(fields)


def check_echoed(body: Mapping[str, Any]) -> None:
    """Refuse (400, naming the field) a body whose fields a response echoes (tools, text,
    reasoning, metadata, sampling values) in a shape the Responses API has not: found before
    the request is queued, not once its answer is written."""
    try:
        ResponseHead("check", str(body.get("model")), 0, body).response("queued")
    except ValidationError as exc:
        error = exc.errors()[0]
        field = str(error["loc"][0]) if error["loc"] else "body"
        raise InvalidParameter(f"{field}: {error['msg']}", param=field) from None


def usage_of(chat_usage: Mapping[str, Any] | None) -> ResponseUsage | None:
    """A chat usage as the Responses API counts it."""
    if not chat_usage:
        return None
    prompt, completion = chat_usage.get("prompt_tokens", 0), chat_usage.get("completion_tokens", 0)
    details = chat_usage.get("completion_tokens_details") or {}
    return ResponseUsage(
        input_tokens=prompt,
        input_tokens_details=InputTokensDetails(cached_tokens=0, cache_write_tokens=0),
        output_tokens=completion,
        output_tokens_details=OutputTokensDetails(reasoning_tokens=details.get("reasoning_tokens") or 0),
        total_tokens=prompt + completion,
    )


def status_of(finish_reason: str | None) -> ResponseStatus:
    """A completion's status from how it ended, as ``vllm serve`` tells them apart."""
    if finish_reason == "length":
        return "incomplete"
    if finish_reason == "cancelled":
        return "cancelled"
    if finish_reason in ("timeout", "queue_timeout"):
        return "failed"  # its deadline passed, or no worker started it in time
    return "completed"


def text_logprobs(chat_logprobs: Mapping[str, Any] | None) -> list[response_output_text.Logprob] | None:
    """A chat choice's logprobs as an output text's (``None``: none asked for)."""
    if not chat_logprobs or chat_logprobs.get("content") is None:
        return None
    return [
        response_output_text.Logprob(
            token=entry["token"],
            bytes=entry.get("bytes") or [],
            logprob=entry["logprob"],
            top_logprobs=[
                response_output_text.LogprobTopLogprob(
                    token=t["token"], bytes=t.get("bytes") or [], logprob=t["logprob"]
                )
                for t in entry.get("top_logprobs") or []
            ],
        )
        for entry in chat_logprobs["content"]
    ]


def _delta_logprobs(logprobs: Sequence[response_output_text.Logprob]) -> list[response_text_delta_event.Logprob]:
    return [
        response_text_delta_event.Logprob(
            token=lp.token,
            logprob=lp.logprob,
            top_logprobs=[
                response_text_delta_event.LogprobTopLogprob(token=t.token, logprob=t.logprob) for t in lp.top_logprobs
            ],
        )
        for lp in logprobs
    ]


def _reasoning_of(message: Mapping[str, Any]) -> str | None:
    reasoning = message.get("reasoning")
    return reasoning if reasoning is not None else message.get("reasoning_content")


def whole_response(chat: Mapping[str, Any], head: ResponseHead) -> Response:
    """The whole response of the whole chat completion ``chat``."""
    choice = chat["choices"][0]
    message = choice["message"]
    output: list[ResponseOutputItem] = []
    if reasoning := _reasoning_of(message):
        output.append(
            ResponseReasoningItem(
                id=head.item_id("rs", len(output)),
                type="reasoning",
                summary=[],
                content=[ReasoningText(text=reasoning, type="reasoning_text")],
                status=None,
            )
        )
    if content := message.get("content"):
        text = ResponseOutputText(
            type="output_text", text=content, annotations=[], logprobs=text_logprobs(choice.get("logprobs"))
        )
        output.append(
            ResponseOutputMessage(
                id=head.item_id("msg", len(output)),
                type="message",
                role="assistant",
                content=[text],
                status="completed",
            )
        )
    for call in message.get("tool_calls") or []:
        output.append(
            ResponseFunctionToolCall(
                id=head.item_id("fc", len(output)),
                type="function_call",
                call_id=call["id"],
                name=call["function"]["name"],
                arguments=call["function"]["arguments"],
                status="completed",
            )
        )
    status = status_of(choice.get("finish_reason"))
    error = ApiError(500, f"the request ended: {choice.get('finish_reason')}") if status == "failed" else None
    return head.response(status, output, usage_of(chat.get("usage")), error)


Kind = Literal["message", "reasoning", "function_call"]


@dataclass
class _OpenItem:
    """The output item being streamed."""

    kind: Kind
    item_id: str
    output_index: int
    tool_index: int | None = None
    call_id: str = ""
    name: str = ""
    text: str = ""
    logprobs: list[response_output_text.Logprob] = field(default_factory=list)


@dataclass
class ResponsesFraming:
    """Frames a chat stream's chunks as the Responses API's typed events: opens with
    ``response.created`` and ``response.in_progress``, opens and closes an output item as
    the model moves from reasoning to content to a tool call, and ends with
    ``response.completed`` (``incomplete``, ``cancelled``) holding every item and the usage.
    ``sequence_number`` counts from 0; ``starting_after`` drops the events a client has."""

    head: ResponseHead
    starting_after: int = -1
    opened: bool = False
    _sequence: int = 0
    _open: _OpenItem | None = None
    _output: list[ResponseOutputItem] = field(default_factory=list)
    _finish_reason: str | None = None
    _usage: ResponseUsage | None = None
    _failed: bool = False

    def frame(self, chunks: list[bytes], event_id: str | None) -> bytes:
        events: list[ResponseStreamEvent] = []
        for chunk in chunks:
            events += self.events(msgspec.json.decode(chunk))
        return self._sse(events)

    def end(self) -> bytes:
        return self._sse(self.end_events())

    def error(self, error: ApiError) -> bytes:
        return self._sse([*self._opening(), self._error_event(error)])

    def events(self, chunk: Mapping[str, Any]) -> list[ResponseStreamEvent]:
        """The events of one chat chunk (or of an error body, which ends the response)."""
        events = self._opening()
        if "error" in chunk:
            error = chunk["error"]
            events.append(self._error_event(ApiError(500, error.get("message", ""), code=error.get("code"))))
            return events
        if chunk.get("usage"):
            self._usage = usage_of(chunk["usage"])
        for choice in chunk.get("choices") or []:
            self._finish_reason = choice.get("finish_reason") or self._finish_reason
            events += self._delta(choice.get("delta") or {}, text_logprobs(choice.get("logprobs")) or [])
        return events

    def end_events(self) -> list[ResponseStreamEvent]:
        """The events that end a response: its last item closed, then ``response.completed``."""
        if self._failed:
            return []
        events = [*self._opening(), *self._close()]
        status = status_of(self._finish_reason)
        error = ApiError(500, f"the request ended: {self._finish_reason}") if status == "failed" else None
        response = self.head.response(status, self._output, self._usage, error)
        events.append(
            self._stamp(ResponseCompletedEvent(type="response.completed", sequence_number=0, response=response))
        )
        return events

    def _opening(self) -> list[ResponseStreamEvent]:
        if self.opened:
            return []
        self.opened = True
        response = self.head.response("in_progress")
        return [
            self._stamp(ResponseCreatedEvent(type="response.created", sequence_number=0, response=response)),
            self._stamp(ResponseInProgressEvent(type="response.in_progress", sequence_number=0, response=response)),
        ]

    def _error_event(self, error: ApiError) -> ResponseStreamEvent:
        self._failed = True
        return self._stamp(
            ResponseErrorEvent(
                type="error", sequence_number=0, code=error.code, message=error.message, param=error.param
            )
        )

    def _delta(
        self, delta: Mapping[str, Any], logprobs: list[response_output_text.Logprob]
    ) -> list[ResponseStreamEvent]:
        """The events of one choice's delta: a tool call, reasoning or content, in that
        order of precedence, as ``vllm serve`` resolves a delta."""
        events: list[ResponseStreamEvent] = []
        calls = [c for c in delta.get("tool_calls") or [] if c.get("function") is not None]
        reasoning = _reasoning_of(delta)
        if calls:
            for call in calls:
                index = call.get("index", 0)
                if self._open is None or self._open.kind != "function_call" or self._open.tool_index != index:
                    events += self._close()
                    events += self._start("function_call", call)
                arguments = call["function"].get("arguments") or ""
                if arguments:
                    assert self._open is not None
                    self._open.text += arguments
                    events.append(
                        self._stamp(
                            ResponseFunctionCallArgumentsDeltaEvent(
                                type="response.function_call_arguments.delta",
                                sequence_number=0,
                                output_index=self._open.output_index,
                                item_id=self._open.item_id,
                                delta=arguments,
                            )
                        )
                    )
        elif reasoning is not None:
            events += self._text_delta("reasoning", reasoning, [])
        elif delta.get("content") or (logprobs and delta.get("content") == ""):
            # A token with no text of its own (part of a character, a special token) still
            # carries its logprobs when they were asked for.
            events += self._text_delta("message", delta["content"], logprobs)
        return events

    def _text_delta(
        self, kind: Kind, text: str, logprobs: list[response_output_text.Logprob]
    ) -> list[ResponseStreamEvent]:
        events: list[ResponseStreamEvent] = []
        if self._open is None or self._open.kind != kind:
            events += self._close()
            events += self._start(kind)
        item = self._open
        assert item is not None
        item.text += text
        item.logprobs += logprobs
        at = {"output_index": item.output_index, "item_id": item.item_id}
        event: ResponseStreamEvent
        if kind == "reasoning":
            event = ResponseReasoningTextDeltaEvent.model_validate(
                {"type": "response.reasoning_text.delta", "sequence_number": 0, "content_index": 0, "delta": text, **at}
            )
        else:
            event = ResponseTextDeltaEvent.model_validate(
                {
                    "type": "response.output_text.delta",
                    "sequence_number": 0,
                    "content_index": 0,
                    "delta": text,
                    "logprobs": _delta_logprobs(logprobs),
                    **at,
                }
            )
        events.append(self._stamp(event))
        return events

    def _start(self, kind: Kind, call: Mapping[str, Any] | None = None) -> list[ResponseStreamEvent]:
        output_index = len(self._output)
        prefix = {"message": "msg", "reasoning": "rs", "function_call": "fc"}[kind]
        item = _OpenItem(kind, self.head.item_id(prefix, output_index), output_index)
        self._open = item
        added: ResponseOutputItem
        if kind == "function_call":
            assert call is not None
            item.tool_index, item.call_id = call.get("index", 0), call.get("id") or f"call_{item.item_id}"
            item.name = call["function"].get("name") or ""
            added = ResponseFunctionToolCall(
                id=item.item_id,
                type="function_call",
                call_id=item.call_id,
                name=item.name,
                arguments="",
                status="in_progress",
            )
            return [self._stamp(self._item_event("added", added))]
        part: Any
        if kind == "reasoning":
            added = ResponseReasoningItem(id=item.item_id, type="reasoning", summary=[], status="in_progress")
            part = {"type": "reasoning_text", "text": ""}
        else:
            added = ResponseOutputMessage(
                id=item.item_id, type="message", role="assistant", content=[], status="in_progress"
            )
            part = ResponseOutputText(type="output_text", text="", annotations=[], logprobs=[])
        part_added = ResponseContentPartAddedEvent(
            type="response.content_part.added",
            sequence_number=0,
            output_index=output_index,
            item_id=item.item_id,
            content_index=0,
            part=part,
        )
        return [self._stamp(self._item_event("added", added)), self._stamp(part_added)]

    def _close(self) -> list[ResponseStreamEvent]:
        """The events that close the open item, which joins the output."""
        item, self._open = self._open, None
        if item is None:
            return []
        at = {"sequence_number": 0, "output_index": item.output_index, "item_id": item.item_id}
        events: list[ResponseStreamEvent] = []
        done: ResponseOutputItem
        if item.kind == "function_call":
            events.append(
                ResponseFunctionCallArgumentsDoneEvent.model_validate(
                    {"type": "response.function_call_arguments.done", "arguments": item.text, **at}
                )
            )
            done = ResponseFunctionToolCall(
                id=item.item_id,
                type="function_call",
                call_id=item.call_id,
                name=item.name,
                arguments=item.text,
                status="completed",
            )
        else:
            part: ReasoningText | ResponseOutputText
            if item.kind == "reasoning":
                part = ReasoningText(type="reasoning_text", text=item.text)
                text_done = {"type": "response.reasoning_text.done", "text": item.text, "content_index": 0, **at}
                events.append(ResponseReasoningTextDoneEvent.model_validate(text_done))
                done = ResponseReasoningItem(
                    id=item.item_id, type="reasoning", summary=[], content=[part], status="completed"
                )
            else:
                part = ResponseOutputText(
                    type="output_text", text=item.text, annotations=[], logprobs=item.logprobs or None
                )
                text_done = {
                    "type": "response.output_text.done",
                    "text": item.text,
                    "content_index": 0,
                    "logprobs": [],
                    **at,
                }
                events.append(ResponseTextDoneEvent.model_validate(text_done))
                done = ResponseOutputMessage(
                    id=item.item_id, type="message", role="assistant", content=[part], status="completed"
                )
            part_done = {"type": "response.content_part.done", "content_index": 0, "part": part.model_dump(), **at}
            events.append(ResponseContentPartDoneEvent.model_validate(part_done))
        events.append(self._item_event("done", done))
        self._output.append(done)
        return [self._stamp(event) for event in events]

    def _item_event(self, which: Literal["added", "done"], item: ResponseOutputItem) -> ResponseStreamEvent:
        output_index = len(self._output)
        if which == "added":
            return ResponseOutputItemAddedEvent(
                type="response.output_item.added", sequence_number=0, output_index=output_index, item=item
            )
        return ResponseOutputItemDoneEvent(
            type="response.output_item.done", sequence_number=0, output_index=output_index, item=item
        )

    def _stamp(self, event: Any) -> ResponseStreamEvent:
        event.sequence_number = self._sequence
        self._sequence += 1
        return event  # type: ignore[no-any-return]

    def _sse(self, events: list[ResponseStreamEvent]) -> bytes:
        return sse_events([event for event in events if event.sequence_number > self.starting_after])


def sse_events(events: list[ResponseStreamEvent]) -> bytes:
    """The SSE bytes of ``events``: ``event:`` the type, ``data:`` the event, as ``vllm serve``
    writes them."""
    return b"".join(
        b"event: %b\ndata: %b\n\n"
        % (event.type.encode(), event.model_dump_json(exclude_unset=True, by_alias=True).encode())
        for event in events
    )
