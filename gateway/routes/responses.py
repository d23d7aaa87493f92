"""The Responses API routes: ``POST /v1/responses`` in front of the queue, a face over chat
completions (``gateway.responses_face``) answered by the one request path of the completion
routes (``gateway.routes.completions.respond``: admission, keys, metrics, cancel on
disconnect); and the stored responses, read back from Redis by any gateway:
``GET /v1/responses/{id}`` (whole, or its events again with ``stream=true`` and
``starting_after``), ``POST /v1/responses/{id}/cancel``.

A stored response (``store``, the default) keeps what its request asked in Redis
(``gateway.response_store``); its output is rebuilt from the request's replay log, event for
event as it was streamed, so every gateway reads the same events with the same sequence
numbers. A ``background`` response is a queued job named after its response id: the HTTP
request that created it ends at once (or follows its events, with ``stream``), the job goes
on. ``previous_response_id`` puts a stored response's input and output before the new input.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
import uuid
from collections.abc import AsyncGenerator, Mapping
from typing import Any, Final

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from openai.types.responses import Response as OpenAIResponse
from openai.types.responses import ResponseStreamEvent

from gateway import http_metrics
from gateway.auth import TENANT_STATE, Tenant
from gateway.response_store import ResponseStore, StoredResponse
from gateway.responses_face import ResponsesFace
from gateway.responses_input import chat_body
from gateway.responses_output import ResponseHead, ResponsesFraming, dump, request_id_of, response_id, sse_events
from gateway.routes.completions import Account, affinity_of, json_body, respond, submit_body
from gateway.sse import KEEPALIVE, SseResponse, with_keepalives
from gateway.state import config_of, services_of
from producer.openai_api.chunks import ChunkBuilder
from producer.openai_api.errors import ApiError, ApiErrorType, bad_request
from producer.openai_api.requests import OpenAIRequest, parse_openai_body
from producer.openai_api.responses import ResponseMeta
from streamq.protocol import PooledEvent, is_valid_request_id

RESPONSES_PATH: Final = "/v1/responses"
CANCEL_WAIT_S: Final = 30.0
"""How long a cancel waits for the request's end to be logged before it answers ``cancelled``
with the output so far unread."""

router = APIRouter()


@router.post(RESPONSES_PATH)
async def create_response(request: Request) -> Response:
    face = ResponsesFace()
    try:
        body = await json_body(request)
        if not isinstance(body, dict):
            raise bad_request("the request body must be a JSON object")
        store = body.get("store", True) is not False
        if body.get("background") and not store:
            raise bad_request("background can only be used when `store` is true", param="background")
        face.history = await _history(request, body.get("previous_response_id"))
        if body.get("background"):
            return _counted(request, await _background(request, body, face))
    except Exception as exc:
        return _counted(request, face.error_response(exc))
    response = await respond(request, face, body)  # counted there
    if store and response.status_code == 200 and face.head is not None:
        head = face.head
        stored = StoredResponse(
            body=body, model=head.model, created_at=head.created_at, history=[dict(m) for m in face.history]
        )
        await _store(request).save(head.request_id, stored)
    return response


@router.get(RESPONSES_PATH + "/{response_id}")
async def retrieve_response(request: Request, response_id: str) -> Response:
    """The stored response as it stands (``queued``, ``in_progress``, or as it ended), or
    with ``stream=true`` its events after ``starting_after`` (all, without), following it live."""
    face = ResponsesFace()
    try:
        stream = _flag(request.query_params.get("stream"), "stream")
        starting_after = _starting_after(request.query_params.get("starting_after"))
        request_id, stored = await _stored(request, response_id)
        if stream:
            return _counted(request, await _event_stream(request, request_id, stored, starting_after))
        return _counted(request, JSONResponse(dump(await _current(request, request_id, stored))))
    except Exception as exc:
        return _counted(request, face.error_response(exc))


@router.post(RESPONSES_PATH + "/{response_id}/cancel")
async def cancel_response(request: Request, response_id: str) -> Response:
    """Cancel the stored response's request; answers the response as it ended."""
    face = ResponsesFace()
    try:
        request_id, stored = await _stored(request, response_id)
        await services_of(request.app).client.cancel(request_id)
        try:
            async with asyncio.timeout(CANCEL_WAIT_S):
                response = await _ended(request, request_id, stored)
        except TimeoutError:
            response = _head(request_id, stored).response("cancelled")
        return _counted(request, JSONResponse(dump(response)))
    except Exception as exc:
        return _counted(request, face.error_response(exc))


def _counted(request: Request, response: Response) -> Response:
    """``response``, counted in the gateway's requests by its route (``/v1/responses/{response_id}``,
    not each id) and status, as ``respond`` counts the requests it answers."""
    route = request.scope.get("route")
    endpoint = getattr(route, "path", request.url.path)
    http_metrics.REQUESTS.labels(endpoint=endpoint, status=str(response.status_code)).inc()
    return response


def _store(request: Request) -> ResponseStore:
    return ResponseStore(services_of(request.app).client.redis)


def not_found(response_id: str) -> ApiError:
    """``vllm serve``'s answer for a response it does not hold."""
    return ApiError(404, f"Response with id '{response_id}' not found.", type=ApiErrorType.INVALID_REQUEST)


async def _stored(request: Request, response_id: str) -> tuple[str, StoredResponse]:
    """The request and the stored record of ``response_id``; a 404 for one that is not
    stored (``store: false``), expired, or another key's (a key stored in Redis reads only
    the responses it created)."""
    request_id = request_id_of(response_id)
    if request_id is None or not is_valid_request_id(request_id):
        raise not_found(response_id)
    services = services_of(request.app)
    tenant: Tenant | None = getattr(request.state, TENANT_STATE, None)
    if tenant is not None and tenant.record is not None and not await services.limiter.created(request_id, tenant):
        raise not_found(response_id)
    stored = await _store(request).load(request_id)
    if stored is None:
        raise not_found(response_id)
    return request_id, stored


def _flag(value: str | None, name: str) -> bool:
    if value is None or value.lower() in ("false", "0"):
        return False
    if value.lower() in ("true", "1"):
        return True
    raise bad_request(f"{name} must be true or false, got {value!r}", param=name)


def _starting_after(value: str | None) -> int:
    """``starting_after``: the sequence number of the last event the client has (-1: none)."""
    if value is None:
        return -1
    try:
        number = int(value)
    except ValueError:
        number = -2
    if number < -1:
        raise bad_request(
            f"starting_after must be the sequence_number of an event received (an integer >= 0), got {value!r}",
            param="starting_after",
        )
    return number


def _head(request_id: str, stored: StoredResponse) -> ResponseHead:
    return ResponseHead(request_id, stored.model, stored.created_at, stored.body)


def _chat_request(request: Request, stored: StoredResponse) -> OpenAIRequest:
    return parse_openai_body(chat_body(stored.body, stored.history), chat=True, limits=config_of(request.app).limits)


async def _replayed(
    request: Request, request_id: str, stored: StoredResponse, starting_after: int = -1
) -> AsyncGenerator[list[ResponseStreamEvent] | None, None]:
    """The response's events read from its replay log from the start, those after
    ``starting_after``, as they were streamed: the log's events through the chat chunks and
    the Responses framing, the same on every gateway. ``None`` now and then while it is silent."""
    params = _chat_request(request, stored)
    head = _head(request_id, stored)
    meta = ResponseMeta(True, request_id, stored.model, stored.created_at)
    chunks = ChunkBuilder(meta, include_usage=True, shape=params.shape)
    framing = ResponsesFraming(head, starting_after)
    handle = await services_of(request.app).client.follow(request_id, from_seq=0)
    try:
        async for item in with_keepalives(aiter(handle), config_of(request.app).keepalive_s):
            if item is None:
                yield None
                continue
            if isinstance(item, PooledEvent):
                continue  # a pooling request's results: never on a response's stream
            events = [event for chunk in chunks.chunks(item) for event in framing.events(json.loads(chunk))]
            if chunks.done:
                events += framing.end_events()
            yield [event for event in events if event.sequence_number > starting_after]
            if chunks.done:
                return
    finally:
        await handle.close()


async def _ended(request: Request, request_id: str, stored: StoredResponse) -> OpenAIResponse:
    """The response once its request ended: the last event's (``failed`` on an error)."""
    last: ResponseStreamEvent | None = None
    async for events in _replayed(request, request_id, stored):
        if events:
            last = events[-1]
    if last is not None and last.type == "response.completed":
        return last.response
    message = last.message if last is not None and last.type == "error" else "the request ended without output"
    return _head(request_id, stored).response("failed", error=ApiError(500, message))


async def _current(request: Request, request_id: str, stored: StoredResponse) -> OpenAIResponse:
    """The response as it stands: ``queued``, ``in_progress``, or as it ended."""
    status = await services_of(request.app).client.status(request_id)
    if status.state == "unknown":
        raise not_found(response_id(request_id))
    if status.state in ("finished", "failed"):
        return await _ended(request, request_id, stored)
    return _head(request_id, stored).response("queued" if status.state == "queued" else "in_progress")


async def _event_stream(request: Request, request_id: str, stored: StoredResponse, starting_after: int) -> Response:
    """The response's events after ``starting_after`` as SSE, following it live."""
    if not await services_of(request.app).client.exists(request_id):
        raise not_found(response_id(request_id))

    async def sse() -> AsyncGenerator[bytes, None]:
        async for events in _replayed(request, request_id, stored, starting_after):
            yield KEEPALIVE if events is None else sse_events(events)

    async def nothing() -> None:
        return None  # a stored response goes on without its reader

    return SseResponse(sse(), headers={"x-request-id": request_id}, on_close=nothing)


async def _history(request: Request, previous: object) -> list[dict[str, Any]]:
    """The chat messages of the stored conversation ``previous`` (a response id) continues:
    its own history and input (not its instructions), then its output."""
    if previous is None:
        return []
    if not isinstance(previous, str):
        raise bad_request("previous_response_id must be a string", param="previous_response_id")
    request_id, stored = await _stored(request, previous)
    status = await services_of(request.app).client.status(request_id)
    if status.state not in ("finished", "failed"):
        raise bad_request(f"response {previous!r} has not ended yet", param="previous_response_id")
    before = [m for m in chat_body(stored.body, stored.history)["messages"] if m.get("role") != "system"]
    ended = await _ended(request, request_id, stored)
    return before + output_messages(ended)


def output_messages(response: OpenAIResponse) -> list[dict[str, Any]]:
    """A response's output as chat messages: its text an assistant message, its function
    calls that message's tool calls (reasoning is left out, as ``vllm serve`` leaves it)."""
    message: dict[str, Any] = {"role": "assistant", "content": None}
    for item in response.output:
        if item.type == "message":
            text = "".join(part.text for part in item.content if part.type == "output_text")
            message["content"] = (message["content"] or "") + text
        elif item.type == "function_call":
            call = {
                "id": item.call_id,
                "type": "function",
                "function": {"name": item.name, "arguments": item.arguments},
            }
            message.setdefault("tool_calls", []).append(call)
    return [message] if message["content"] is not None or message.get("tool_calls") else []


async def _background(request: Request, body: Mapping[str, Any], face: ResponsesFace) -> Response:
    """Queue a background response: a named request (its id the response id's) that no
    disconnect cancels, admitted and counted for its key as any request; answers ``queued``
    (or, with ``stream``, its events as they come)."""
    services, config = services_of(request.app), config_of(request.app)
    params = parse_openai_body(face.openai_body(body), chat=True, limits=config.limits)
    # Token by token in the log, whatever the client reads: any reader may stream it later.
    params = dataclasses.replace(params, stream=True)
    request_id = uuid.uuid4().hex
    tenant: Tenant | None = getattr(request.state, TENANT_STATE, None)
    affinity = affinity_of(request)
    account = Account(services.limiter, tenant)
    try:
        if tenant is not None:
            account.admission = await services.limiter.admit(tenant, params.model)
        group = await submit_body(request, params, request_id, affinity, account)
        await group.close()  # named: closing leaves it running
    finally:
        await account.close()
    stored = StoredResponse(
        body=dict(body), model=params.model, created_at=int(time.time()), history=[dict(m) for m in face.history]
    )
    await _store(request).save(request_id, stored)
    if body.get("stream"):
        return await _event_stream(request, request_id, stored, -1)
    return JSONResponse(dump(_head(request_id, stored).response("queued")), headers={"x-request-id": request_id})
