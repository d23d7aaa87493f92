"""Streamed responses as Server-Sent Events, ended by ``data: [DONE]``.

Resumable requests label each event with ``id: <seq>.<digest>``: the replay log's sequence
number, and the digest of the event as logged (``producer.client.event_digest``), so a resume
can check that the log still holds the event its client had.
A stream silent for a while (a request waiting for a worker to start) carries keep-alive
comments, which SSE clients skip and proxies and HTTP clients count as traffic.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Final, Protocol, TypeAlias, TypeVar

from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from gateway.disconnect import wait_for_disconnect
from producer.openai_api.chunks import ChunkBuilder
from producer.openai_api.errors import ApiError
from streamq.protocol import ChunkEvent, ErrorEvent, Event, FinalEvent

DONE: Final = b"data: [DONE]\n\n"
KEEPALIVE: Final = b": keep-alive\n\n"
"""An SSE comment: no event for the client, but bytes on the wire."""
DEFAULT_KEEPALIVE_S: Final = 10.0
"""A silent stream's keep-alive period (and how long a stream waits for its first event
before it opens without one): below the 15-30 s after which proxies and clients commonly
give up on an idle connection."""

T = TypeVar("T")

EventIds: TypeAlias = Callable[[Event, int], str]
"""The SSE ``id`` of an event (of the request of a prompt): ``<seq>.<digest>``."""


async def with_keepalives(items: AsyncIterator[T], interval_s: float) -> AsyncGenerator[T | None, None]:
    """``items`` as they come, and ``None`` each time ``interval_s`` passes without one. The
    read in progress is kept across a ``None``, never cancelled (cancelling it would end
    ``items``), and cancelled once this generator closes."""
    pending: asyncio.Future[T] | None = None
    try:
        while True:
            if pending is None:
                pending = asyncio.ensure_future(anext(items))
            done, _ = await asyncio.wait({pending}, timeout=interval_s)
            if not done:
                yield None
                continue
            read, pending = pending, None
            try:
                item = read.result()
            except StopAsyncIteration:
                return
            yield item
    finally:
        if pending is not None:
            pending.cancel()
            await asyncio.gather(pending, return_exceptions=True)


def sse_event(data: bytes, event_id: str | None) -> bytes:
    """One SSE event of JSON ``data``; ``id:`` only on resumable streams (some clients,
    ``vllm bench serve`` among them, read every event as ``data:`` alone)."""
    if event_id is None:
        return b"data: " + data + b"\n\n"
    return b"id: %b\ndata: %b\n\n" % (event_id.encode(), data)


class Framing(Protocol):
    """How a streamed response of one API frames the chat or completion chunks of the
    OpenAI mapping: OpenAI's own ``data:`` events ended by ``[DONE]``, or the events of an
    API that the gateway maps onto it (``gateway.faces``), which may keep state across a
    response's chunks."""

    def frame(self, chunks: list[bytes], event_id: str | None) -> bytes:
        """The SSE bytes of ``chunks`` (OpenAI chunk JSON, possibly none), labelled ``event_id``."""
        ...

    def end(self) -> bytes:
        """What ends the stream once the response is complete."""
        ...

    def error(self, error: ApiError) -> bytes:
        """The event that ends a stream in ``error``."""
        ...


class OpenAIFraming:
    """OpenAI's streams: each chunk a ``data:`` event, ``[DONE]`` at the end, an error as its body."""

    def frame(self, chunks: list[bytes], event_id: str | None) -> bytes:
        return b"".join([sse_event(chunk, event_id) for chunk in chunks])

    def end(self) -> bytes:
        return DONE

    def error(self, error: ApiError) -> bytes:
        return sse_event(json.dumps(error.body()).encode(), None) + DONE


@dataclass
class SseEncoder:
    """Turns one request's events, in order, into the SSE bytes of its streamed response;
    ``event_ids`` labels each on a resumable stream (``None``: no ``id:`` lines); ``framing``
    writes them in the API's own events."""

    chunks: ChunkBuilder
    event_ids: EventIds | None = None
    framing: Framing = field(default_factory=OpenAIFraming)

    def encode(self, event: ChunkEvent | FinalEvent | ErrorEvent, prompt: int = 0) -> bytes:
        """The SSE bytes of ``event`` (of the request of ``prompt``), with the stream's end
        (``[DONE]``) once the response is complete."""
        event_id = None if self.event_ids is None else self.event_ids(event, prompt)
        text = self.framing.frame(self.chunks.chunks(event, prompt), event_id)
        return text + self.framing.end() if self.chunks.done else text


class SseResponse(StreamingResponse):
    """``text/event-stream`` that stops at once when the client disconnects, and then
    always runs ``on_close`` (which cancels the request when nobody will read it).

    Starlette's own ``StreamingResponse`` notices a disconnect only when its next
    write fails, and leaves closing the generator to the garbage collector."""

    def __init__(
        self,
        content: AsyncGenerator[bytes, None],
        *,
        headers: dict[str, str],
        on_close: Callable[[], Awaitable[None]],
    ) -> None:
        super().__init__(
            content,
            media_type="text/event-stream",
            headers={**headers, "Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
        self._content = content
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        sending = asyncio.ensure_future(self.stream_response(send))
        gone = asyncio.ensure_future(wait_for_disconnect(receive))
        try:
            await asyncio.wait({sending, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (sending, gone):
                task.cancel()
            await asyncio.gather(sending, gone, return_exceptions=True)
            await self._content.aclose()
            await self._on_close()
        if not sending.cancelled() and (exc := sending.exception()) is not None and not isinstance(exc, OSError):
            raise exc
