"""The completion routes: OpenAI's ``/v1/completions`` and ``/v1/chat/completions`` in
front of the queue, routed by model.

An anonymous request is cancelled when its client disconnects, as ``vllm serve`` aborts
it. A request named with ``x-streamq-request-id`` is resumable instead: its SSE events
carry ``id: <seq>.<digest>``, and the same POST with that ``Last-Event-ID`` continues it, once
the replay log is found to hold that very event (else a 409: Redis lost it).

A request for a model whose workers are all gone (scaled to zero) waits in the queue for
the next worker, up to the gateway's queue timeout; its stream opens meanwhile and carries
keep-alive comments, and one that waits past the bound ends with a 503 error.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from gateway import http_metrics
from gateway.auth import TENANT_STATE, Tenant, unauthorized
from gateway.default_model import with_default_model
from gateway.disconnect import ClientGone, until_disconnected
from gateway.faces import CHAT_COMPLETIONS_FACE, COMPLETIONS_FACE, Face
from gateway.key_limits import Admission, KeyLimiter, KeyRevoked
from gateway.request_group import RequestGroup
from gateway.sse import DONE, KEEPALIVE, EventIds, Framing, SseEncoder, SseResponse, with_keepalives
from gateway.state import config_of, services_of
from producer.client import RequestHandle
from producer.errors import MissingEvents, RequestError
from producer.handle import DIGEST_PATTERN
from producer.internal_client import InternalClient
from producer.openai_api.chunks import ChunkBuilder
from producer.openai_api.endpoints import CHAT_COMPLETIONS, COMPLETIONS, Endpoint
from producer.openai_api.errors import ApiError, ApiErrorCode, bad_request, waited_too_long
from producer.openai_api.requests import OpenAIRequest, parse_openai_body
from producer.openai_api.responses import ResponseMeta
from streamq.protocol import (
    REQUEST_ID_PATTERN,
    TERMINAL_EVENTS,
    ChunkEvent,
    ErrorEvent,
    Event,
    FinalEvent,
    FinishReason,
    PooledEvent,
    is_valid_request_id,
)
from streamq.protocol.affinity import check_affinity_key
from streamq.protocol.names import TENANT_PATTERN

REQUEST_ID_HEADER = "x-streamq-request-id"
"""Names a request (and makes it resumable); the response always carries ``x-request-id``."""
TENANT_HEADER = "x-streamq-tenant"
"""The tenant of a request whose API key is not one stored in Redis (whose name is its
tenant): fair share between tenants in the queue (see ``producer.tenants_cli``)."""
AFFINITY_KEY_HEADER = "x-streamq-affinity-key"
"""Names the request's conversation or document for prefix-aware pickup (docs/features/prefix-aware-pickup.md):
the worker that served that key gets first pick, instead of the one that served the prefix."""
AFFINITY_HEADER = "x-streamq-affinity"
"""``off`` (or ``false``, ``0``) opts the request out of prefix-aware pickup."""
AFFINITY_OFF_VALUES = frozenset({"off", "false", "0"})

router = APIRouter()


@router.post(COMPLETIONS.path)
async def completions(request: Request) -> Response:
    return await respond(request, COMPLETIONS_FACE)


@router.post(CHAT_COMPLETIONS.path)
async def chat_completions(request: Request) -> Response:
    return await respond(request, CHAT_COMPLETIONS_FACE)


@dataclass
class Account:
    """What one HTTP request holds until its response is over: its place in the gateway's
    in-progress gauge and its key's admission. ``close`` releases both, once, whichever
    way the response ends (a whole body, an error, or a stream when it closes)."""

    limiter: KeyLimiter
    tenant: Tenant | None
    admission: Admission | None = None
    _closed: bool = False

    def __post_init__(self) -> None:
        http_metrics.IN_PROGRESS.inc()

    def charge(self, prompt_tokens: int, completion_tokens: int) -> None:
        """Add what the request used to its key's tally."""
        if self.admission is not None:
            self.admission.prompt_tokens += prompt_tokens
            self.admission.completion_tokens += completion_tokens

    async def close(self, *, succeeded: bool = True) -> None:
        if self._closed:
            return
        self._closed = True
        http_metrics.IN_PROGRESS.dec()
        if self.admission is not None:
            self.admission.counted &= succeeded
            await self.limiter.finish(self.admission)


async def json_body(request: Request) -> Any:
    """The request's body as parsed JSON; a 400 when it is not JSON."""
    try:
        return json.loads(await request.body())
    except ValueError:
        raise bad_request("the request body is not valid JSON") from None


async def respond(request: Request, face: Face, body: Any = None) -> Response:
    """One request of ``face``'s API, every failure mapped to its error shape, counted in
    the gateway's metrics (a stream stays in progress until it closes). ``body``: the
    request's body, where the route has parsed it already (else it is read here)."""
    account = Account(services_of(request.app).limiter, getattr(request.state, TENANT_STATE, None))
    response: Response | None = None
    try:
        response = await _generate(request, face, account, body)
    except ClientGone:
        response = Response(status_code=499)  # nobody is listening any more
    except KeyRevoked:
        assert account.tenant is not None
        services_of(request.app).auth.forget(account.tenant.digest)
        response = face.error_response(unauthorized("incorrect API key provided"))
    except Exception as exc:
        response = face.error_response(exc)
    finally:
        if not isinstance(response, SseResponse):  # a stream's own close releases it
            await account.close(succeeded=response is not None and response.status_code == 200)
    http_metrics.REQUESTS.labels(endpoint=request.url.path, status=str(response.status_code)).inc()
    return response


def queue_tenant_of(request: Request, key: Tenant | None) -> str | None:
    """The request's tenant in the queue: its API key's name for a key stored in Redis,
    else the ``X-Streamq-Tenant`` header (checked), else none (the default tenant)."""
    if key is not None and key.record is not None:
        return key.name
    header = request.headers.get(TENANT_HEADER)
    if header is not None and TENANT_PATTERN.fullmatch(header) is None:
        raise bad_request(f"{TENANT_HEADER} must match {TENANT_PATTERN.pattern}", param=TENANT_HEADER)
    return header


def affinity_of(request: Request) -> dict[str, Any]:
    """``submit``'s affinity arguments from the ``X-Streamq-Affinity-Key`` and
    ``X-Streamq-Affinity`` headers (checked: a value the library would refuse, or one
    that is not an off value, is a 400 naming the header); empty without them."""
    kwargs: dict[str, Any] = {}
    key = request.headers.get(AFFINITY_KEY_HEADER)
    if key is not None:
        try:
            kwargs["affinity_key"] = check_affinity_key(key)
        except ValueError as exc:
            raise bad_request(f"{AFFINITY_KEY_HEADER}: {exc}", param=AFFINITY_KEY_HEADER) from None
    switch = request.headers.get(AFFINITY_HEADER)
    if switch is not None:
        if switch.strip().lower() not in AFFINITY_OFF_VALUES:
            off = ", ".join(sorted(AFFINITY_OFF_VALUES))
            raise bad_request(f"{AFFINITY_HEADER} takes only {off} (to opt out), got {switch!r}", param=AFFINITY_HEADER)
        kwargs["affinity"] = False
    return kwargs


async def _generate(request: Request, face: Face, account: Account, body: Any) -> Response:
    """Parse, admit, queue (or resume), then answer whole or as a stream."""
    arrived = time.monotonic()
    if body is None:
        body = await json_body(request)
    endpoint = face.endpoint
    openai_body = await with_default_model(request, face.openai_body(body))
    params = parse_openai_body(openai_body, chat=endpoint.chat, limits=config_of(request.app).limits)
    named = _named_request(request, params)
    affinity = affinity_of(request)  # checked before the key's limits count the request
    last_event_id = request.headers.get("last-event-id")
    if last_event_id is not None and face.resumes is not None:
        raise bad_request(face.resumes, param="Last-Event-ID")
    last_event = None if last_event_id is None else _last_event_id(last_event_id)
    if account.tenant is not None:
        account.admission = await account.limiter.admit(account.tenant, params.model, counted=last_event is None)
    if last_event is not None:
        client = services_of(request.app).client
        resumed = await _resume(client, named, *last_event, stream=params.stream, account=account)
        if resumed is None:  # the client has every event already
            return Response(DONE, media_type="text/event-stream", headers={"x-request-id": str(named)})
        group = RequestGroup([resumed])  # named: it waits to be resumed again, never cancelled on close
    else:
        group = await submit_body(request, params, named, affinity, account)
    meta = ResponseMeta(endpoint.chat, group.name, params.model, created=int(time.time()))
    try:
        if not params.stream:
            whole = await _whole(request, endpoint, params, group, meta, account)
            return JSONResponse(face.whole(whole, body), headers={"x-request-id": meta.request_id})
        opened = last_event is not None and last_event[0] >= 0  # its client has the role chunks
        framing = face.framing(meta, body)
        return await _stream(
            request,
            params,
            group,
            meta,
            account,
            framing,
            resumable=named is not None,
            opened=opened,
            arrived=arrived,
        )
    except BaseException:
        await group.close()
        raise


async def _whole(
    request: Request,
    endpoint: Endpoint,
    params: OpenAIRequest,
    group: RequestGroup,
    meta: ResponseMeta,
    account: Account,
) -> dict[str, Any]:
    """The whole OpenAI response, once every request of the group ended."""
    completions = await until_disconnected(request.receive, group.results())
    if any(_never_started(completion.finish_reasons, completion.completion_tokens) for completion in completions):
        raise waited_too_long(params.model, config_of(request.app).queue_timeout_s)
    for completion in completions:
        account.charge(completion.prompt_tokens, completion.completion_tokens)
    return endpoint.to_response(
        completions, model=params.model, created=meta.created, shape=params.shape, response_id=meta.id
    )


async def _stream(
    request: Request,
    params: OpenAIRequest,
    group: RequestGroup,
    meta: ResponseMeta,
    account: Account,
    framing: Framing,
    *,
    resumable: bool,
    opened: bool,
    arrived: float,
) -> Response:
    """The streamed response, opened once the first event came: parameters vLLM refuses
    still get a 400 rather than an error inside a 200 stream, and a request that waited
    past its bound a 503. A first event slower than the keep-alive period (no worker is
    free, or none is running yet) opens it without one, with keep-alive comments until
    events come."""
    events = with_keepalives(group.events(), config_of(request.app).keepalive_s)
    first = await until_disconnected(request.receive, anext(events))
    if first is not None:
        http_metrics.TIME_TO_FIRST_EVENT.observe(time.monotonic() - arrived)
        _raise_if_failed(first[1], params, config_of(request.app).queue_timeout_s)
    chunks = ChunkBuilder(
        meta, params.include_usage, n=params.n, role_sent=opened, shape=params.shape, prompts=len(group.handles)
    )
    encoder = SseEncoder(chunks, event_ids=_event_ids(group) if resumable else None, framing=framing)
    timed_out = waited_too_long(params.model, config_of(request.app).queue_timeout_s)

    async def close() -> None:
        await group.close()
        await account.close()

    headers = {"x-request-id": meta.request_id}
    text = _sse_text(encoder, first, events, account, timed_out=timed_out, arrived=None if first else arrived)
    return SseResponse(text, headers=headers, on_close=close)


def _event_ids(group: RequestGroup) -> EventIds:
    """The SSE ids of a resumable stream's events: ``<seq>.<digest>``, the digest of the
    event as its handle delivered it (what a resume checks the log against)."""

    def event_id(event: Event, prompt: int) -> str:
        digest = group.handles[prompt].digest(event.seq)
        return f"{event.seq}" if digest is None else f"{event.seq}.{digest}"

    return event_id


def _never_started(finish_reasons: Sequence[str | None], completion_tokens: int) -> bool:
    """A request that waited past its queue bound with no worker starting it."""
    return completion_tokens == 0 and all(reason == FinishReason.QUEUE_TIMEOUT for reason in finish_reasons)


def _raise_if_failed(event: Event, params: OpenAIRequest, queue_timeout_s: float | None) -> None:
    """The HTTP error of a request whose first event ends it in failure."""
    if isinstance(event, ErrorEvent):
        raise RequestError(event.request_id, event.code, event.message)
    if isinstance(event, FinalEvent) and _never_started(event.finish_reasons, event.completion_tokens):
        raise waited_too_long(params.model, queue_timeout_s)


def _named_request(request: Request, params: OpenAIRequest) -> str | None:
    """The request's own name (``x-streamq-request-id``, else the body's ``request_id``),
    checked; it names one request, so not a body with several prompts."""
    named = request.headers.get(REQUEST_ID_HEADER)
    if named is None:
        return params.request_id  # the body's, checked
    if not is_valid_request_id(named):
        raise bad_request(f"{REQUEST_ID_HEADER} must match {REQUEST_ID_PATTERN.pattern}", param=REQUEST_ID_HEADER)
    if len(params.prompts) > 1:
        raise bad_request(f"{REQUEST_ID_HEADER} names one request: send one prompt with it", param=REQUEST_ID_HEADER)
    return named


async def submit_body(
    request: Request, params: OpenAIRequest, named: str | None, affinity: dict[str, Any], account: Account
) -> RequestGroup:
    """Put the body's requests on the queue: one, or one per prompt (named ``<id>-<i>``
    after one id, as ``vllm serve`` names its engine requests)."""
    client = services_of(request.app).client
    tenant = account.tenant
    queue_tenant = queue_tenant_of(request, tenant)
    submissions = params.submissions()
    base = uuid.uuid4().hex

    async def submit(i: int, kwargs: dict[str, Any]) -> RequestHandle:
        request_id = named if named is not None or len(submissions) == 1 else f"{base}-{i}"
        handle = await client.submit(
            model=params.model,
            request_id=request_id,
            tenant=queue_tenant,
            stream=params.stream,  # a whole response is written in checkpoints, not token by token
            cancel_on_close=named is None,  # a named request waits to be resumed instead
            queue_timeout_s=config_of(request.app).queue_timeout_s,
            **{**kwargs, **affinity},
        )
        if tenant is not None and (named is not None or tenant.record is not None):
            # A stored key sees only its own requests' status (and resumes only its own).
            try:
                await account.limiter.claim(handle.request_id, tenant)
            except BaseException:
                await handle.close()
                raise
        return handle

    # At once: a harness's batch of prompts is queued in about one round trip.
    results = await asyncio.gather(*(submit(i, kwargs) for i, kwargs in enumerate(submissions)), return_exceptions=True)
    handles = [result for result in results if isinstance(result, RequestHandle)]
    failed = [result for result in results if isinstance(result, BaseException)]
    if failed:
        await RequestGroup(handles).close()
        raise failed[0]
    return RequestGroup(handles, name=base if len(handles) > 1 else None)


def _last_event_id(header: str) -> tuple[int, str | None]:
    """``Last-Event-ID`` as ``(seq, digest)``: ``<seq>.<digest>`` (an SSE id this gateway
    sent), or a bare ``<seq>``, or ``-1`` for the whole stream (no digest); else a 400."""
    seq, dot, digest = header.strip().partition(".")
    try:
        last_seq = int(seq)
    except ValueError:
        last_seq = -2
    if last_seq < -1 or (dot and (last_seq < 0 or not DIGEST_PATTERN.fullmatch(digest.lower()))):
        raise bad_request(
            "Last-Event-ID must be the id of an event received (<seq>.<digest>; a bare <seq>; -1 for the whole stream)",
            param="Last-Event-ID",
        )
    return last_seq, digest.lower() if dot else None


async def _resume(
    client: InternalClient,
    named: str | None,
    last_seq: int,
    digest: str | None,
    *,
    stream: bool,
    account: Account,
) -> RequestHandle | None:
    """Follow a named request from the event after ``last_seq``; ``None`` when that was
    its last event (following would wait forever for an event that never comes). With a
    ``digest`` (the event's SSE id carried it), only if the log holds that very event at
    ``last_seq``: else a 409, never a stream that continues another version of it (Redis
    lost events) or ends it twice. A bare ``seq`` is taken on trust."""
    if named is None:
        raise bad_request(
            f"Last-Event-ID needs {REQUEST_ID_HEADER} naming the request to resume", param="Last-Event-ID"
        )
    if not stream:
        raise bad_request("Last-Event-ID resumes streams only; send stream=true", param="stream")
    tenant = account.tenant
    if not await client.exists(named) or (tenant is not None and not await account.limiter.owns(named, tenant)):
        message = f"no request {named!r} to resume (unknown, or its log expired)"
        raise ApiError(404, message, code=ApiErrorCode.REQUEST_NOT_FOUND)
    if digest is None:
        last = await client.last_event(named)
        if isinstance(last, TERMINAL_EVENTS) and last.seq <= last_seq:
            return None
        return await client.follow(named, from_seq=last_seq + 1)
    try:
        handle = await client.follow(named, from_seq=last_seq + 1, after=digest)
    except MissingEvents as exc:
        message = (
            f"cannot resume after event {last_seq}: {exc}. Read the request again from its start "
            "(Last-Event-ID: -1), or send it anew"
        )
        raise ApiError(409, message, code=ApiErrorCode.MISSING_EVENTS, param="Last-Event-ID") from exc
    if handle.done:  # the event the client has ended the request
        await handle.close()
        return None
    return handle


async def _sse_text(
    encoder: SseEncoder,
    first: tuple[int, Event] | None,
    rest: AsyncIterator[tuple[int, Event] | None],
    account: Account,
    *,
    timed_out: ApiError,
    arrived: float | None,
) -> AsyncGenerator[bytes, None]:
    """The stream's bytes, tallying what the key used: the tokens it was sent, and each
    prompt's once its final event arrives (a client that leaves early pays for what it got).
    ``None`` for an event is a keep-alive; a stream opened before its first event
    (``arrived``: when its request came) ends with ``timed_out``'s error if a request of it
    waited past its queue bound. The key's admission is released before ``[DONE]``: a client
    that sends its next request the moment it reads it finds its place free."""
    item = first
    while True:
        if item is None:
            yield KEEPALIVE
        else:
            prompt, event = item
            if arrived is not None:
                http_metrics.TIME_TO_FIRST_EVENT.observe(time.monotonic() - arrived)
                arrived = None
            if isinstance(event, FinalEvent) and _never_started(event.finish_reasons, event.completion_tokens):
                await account.close(succeeded=False)
                yield encoder.framing.error(timed_out)
                return
            if isinstance(event, PooledEvent):
                continue  # a pooling request's results: never on a completions stream
            if isinstance(event, ChunkEvent):
                account.charge(0, len(event.token_ids))
            elif isinstance(event, FinalEvent):
                account.charge(event.prompt_tokens, 0)
            text = encoder.encode(event, prompt)
            if encoder.chunks.done:
                await account.close()
            if text:
                yield text
            if encoder.chunks.done:
                return
        try:
            item = await anext(rest)
        except StopAsyncIteration:
            return
