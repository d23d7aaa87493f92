"""The dashboard's HTTP routes: the page and its static files (public: they carry no
data), and ``/dashboard/api/*`` (an operator's key when the gateway has keys; see
``gateway.auth``):

- ``GET /dashboard/api/snapshot``: the Snapshot (``gateway.dashboard.snapshot``) as JSON;
- ``GET /dashboard/api/live``: ``event: snapshot`` with the same JSON at once and then
  every second, until the client leaves;
- ``GET /dashboard/api/requests/{id}``: the request's ``RequestStatus`` (as
  ``GET /v1/requests/{id}``);
- ``GET /dashboard/api/requests/{id}/events``: its protocol events from the first (replay
  log, then live), each ``event: <chunk|final|error>`` + ``data: <the event's JSON>``,
  ending after the terminal event;
- ``POST /dashboard/api/requests/{id}/cancel``: ``{"request_id", "cancelled"}``.

Unknown requests get 404 (``request_not_found``), malformed ids 400, in OpenAI's error
shape. Every stream here ends when its client leaves (``gateway.sse.SseResponse``): a
closed tab leaves no subscription behind.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncGenerator
from pathlib import Path

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import FileResponse, JSONResponse, PlainTextResponse, Response
from starlette.staticfiles import StaticFiles
from starlette.types import Receive, Scope, Send

from gateway.dashboard.sampler import DashboardSampler
from gateway.request_status import check_request_id, error_response, request_not_found, status_response
from gateway.sse import SseResponse
from gateway.state import services_of
from producer.client import RequestHandle
from producer.errors import StreamqError
from streamq.protocol import ErrorCode, ErrorEvent, Event, encode_event

logger = logging.getLogger("streamq.gateway.dashboard")

STATIC_DIR = Path(__file__).parent / "static"
"""The page's files (``index.html`` and what it loads), read when asked for: a gateway
installed without them still starts, and answers 404 for the page."""

router = APIRouter(prefix="/dashboard")


class _StaticFiles(StaticFiles):
    """``StaticFiles`` that answers 404, not 500, while its folder is missing."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if not Path(str(self.directory)).is_dir():
            await PlainTextResponse("the dashboard's files are not installed", status_code=404)(scope, receive, send)
            return
        await super().__call__(scope, receive, send)


def install(app: FastAPI) -> None:
    """Add the dashboard's routes and static files to the gateway ``app``; its lifespan
    starts the services they use (``gateway.state``: the ``DashboardSampler``) and stops them."""
    app.include_router(router)
    app.mount("/dashboard/static", _StaticFiles(directory=STATIC_DIR, check_dir=False), name="dashboard-static")


def _sampler(request: Request) -> DashboardSampler:
    return services_of(request.app).dashboard


@router.get("", include_in_schema=False)
@router.get("/", include_in_schema=False)
async def page() -> Response:
    index = STATIC_DIR / "index.html"
    if not index.is_file():
        return PlainTextResponse("the dashboard's files are not installed", status_code=404)
    return FileResponse(index, media_type="text/html", headers={"Cache-Control": "no-cache"})


@router.get("/api/snapshot")
async def snapshot(request: Request) -> Response:
    """The Snapshot read after this request arrived (within about a second)."""
    try:
        data = await _sampler(request).next()
    except Exception as exc:
        return error_response(exc)
    return Response(data, media_type="application/json", headers={"Cache-Control": "no-cache"})


@router.get("/api/live")
async def live(request: Request) -> Response:
    """``event: snapshot`` at once and then every second, until the client leaves."""
    return SseResponse(_live_events(_sampler(request)), headers={}, on_close=_nothing)


async def _nothing() -> None:
    return None


async def _live_events(sampler: DashboardSampler) -> AsyncGenerator[bytes, None]:
    latest = sampler.latest()
    if latest is not None:
        yield b"event: snapshot\ndata: " + latest + b"\n\n"
    while True:
        try:
            data = await sampler.next()
        except Exception as exc:  # Redis away: say so as a comment, keep the stream open
            yield b": " + str(exc).replace("\n", " ").encode() + b"\n\n"
            continue
        yield b"event: snapshot\ndata: " + data + b"\n\n"


@router.get("/api/requests/{request_id}")
async def request_status(request: Request, request_id: str) -> Response:
    try:
        return await status_response(request, request_id)
    except Exception as exc:
        return error_response(exc)


@router.get("/api/requests/{request_id}/events")
async def request_events(request: Request, request_id: str) -> Response:
    """The request's protocol events from its first (replay log, then live), each as
    ``event: <type>``; the stream ends after the terminal event."""
    client = services_of(request.app).client
    try:
        check_request_id(request_id)
        if not await client.exists(request_id):
            raise request_not_found(request_id)
        handle = await client.follow(request_id, from_seq=0)
    except Exception as exc:
        return error_response(exc)
    return SseResponse(_request_events(handle), headers={"x-request-id": request_id}, on_close=handle.close)


def _sse_event(event: Event) -> bytes:
    kind = str(type(event).__struct_config__.tag)  # chunk, final or error
    return b"event: %s\ndata: %s\n\n" % (kind.encode(), encode_event(event))


async def _request_events(handle: RequestHandle) -> AsyncGenerator[bytes, None]:
    sent = 0
    try:
        async for event in handle:
            yield _sse_event(event)
            sent += 1
    except StreamqError as exc:  # lost, or events missing: the stream still ends with an error
        code = getattr(exc, "code", ErrorCode.INTERNAL)
        message = getattr(exc, "message", str(exc))
        logger.warning("dashboard: following %s failed: %s", handle.request_id, exc)
        yield _sse_event(ErrorEvent(request_id=handle.request_id, seq=sent, code=str(code), message=str(message)))


@router.post("/api/requests/{request_id}/cancel")
async def cancel(request: Request, request_id: str) -> Response:
    """``cancelled`` is false when the request had ended already, or is unknown."""
    client = services_of(request.app).client
    try:
        check_request_id(request_id)
        outcome = await client.cancel(request_id)
    except Exception as exc:
        return error_response(exc)
    return JSONResponse({"request_id": request_id, "cancelled": outcome in ("running", "queued")})
