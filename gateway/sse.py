"""Streamed responses as Server-Sent Events, ended by ``data: [DONE]``.

Resumable requests label each event with ``id: <seq>`` (the replay log's sequence number).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import dataclass
from typing import Final

from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from gateway.disconnect import wait_for_disconnect
from producer.openai_api.chunks import ChunkBuilder
from streamq.protocol import ChunkEvent, ErrorEvent, FinalEvent

DONE: Final = b"data: [DONE]\n\n"


def sse_event(data: bytes, seq: int | None) -> bytes:
    """One SSE event of JSON ``data``; ``id:`` only on resumable streams (some clients,
    ``vllm bench serve`` among them, read every event as ``data:`` alone)."""
    if seq is None:
        return b"data: " + data + b"\n\n"
    return b"id: %d\ndata: %b\n\n" % (seq, data)


@dataclass
class SseEncoder:
    """Turns one request's events, in order, into the SSE bytes of its streamed response."""

    chunks: ChunkBuilder
    event_ids: bool

    def encode(self, event: ChunkEvent | FinalEvent | ErrorEvent, prompt: int = 0) -> bytes:
        """The SSE bytes of ``event`` (of the request of ``prompt``), with ``[DONE]`` once
        the response is complete."""
        seq = event.seq if self.event_ids else None
        text = b"".join([sse_event(chunk, seq) for chunk in self.chunks.chunks(event, prompt)])
        return text + DONE if self.chunks.done else text


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
