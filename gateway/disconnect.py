"""Noticing that an HTTP client went away, so its request can be cancelled at once.

An ASGI server tells the app about a disconnect only through ``receive()``; nothing
interrupts a handler that is waiting for a token. So every wait on the queue races a
listener on ``receive()``: before the first byte (``until_disconnected``) and while
streaming (``gateway.sse.SseResponse``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

from starlette.types import Receive

T = TypeVar("T")


class ClientGone(Exception):
    """The HTTP client disconnected before its response was ready."""


async def wait_for_disconnect(receive: Receive) -> None:
    """Return once the client has disconnected."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def until_disconnected(receive: Receive, work: Coroutine[Any, Any, T]) -> T:
    """Await ``work``; raise ``ClientGone`` (cancelling ``work``) if the client leaves first."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(wait_for_disconnect(receive))
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
