"""Noticing that an HTTP client went away, so its request can be cancelled at once.

An ASGI server tells the app about a disconnect only through ``receive()``; nothing
interrupts a handler that is waiting for a token. So every wait on the queue races a
listener on ``receive()``: for a streaming response (``EventStreamResponse``) and for
the waits before the first byte is sent (``until_disconnected``).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Awaitable, Callable, Coroutine
from typing import Any, TypeVar

from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

T = TypeVar("T")


class ClientGone(Exception):
    """The HTTP client disconnected before its response was ready."""


async def _disconnected(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def until_disconnected(receive: Receive, work: Coroutine[Any, Any, T]) -> T:
    """Await ``work``; raise ``ClientGone`` (cancelling ``work``) if the client leaves first."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnected(receive))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not task.done():
            task.cancel()
        await asyncio.gather(task, gone, return_exceptions=True)
    if task.cancelled():
        raise ClientGone()
    return task.result()


class EventStreamResponse(StreamingResponse):
    """``text/event-stream`` that stops at once when the client disconnects, and then
    always runs ``on_close`` (which cancels the request when nobody will read it).

    Starlette's own ``StreamingResponse`` notices a disconnect only when its next
    write fails, and leaves closing the generator to the garbage collector."""

    def __init__(
        self,
        content: AsyncGenerator[str, None],
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
        stream = asyncio.ensure_future(self.stream_response(send))
        gone = asyncio.ensure_future(_disconnected(receive))
        try:
            await asyncio.wait({stream, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (stream, gone):
                task.cancel()
            await asyncio.gather(stream, gone, return_exceptions=True)
            await self._content.aclose()
            await self._on_close()
        if not stream.cancelled() and (exc := stream.exception()) is not None and not isinstance(exc, OSError):
            raise exc
