"""A bound on request bodies, enforced before a body is held whole.

Without it one client could make the gateway buffer any number of bytes (a body is
read whole before it is parsed). A declared ``Content-Length`` over the limit is
refused before a byte of the body is read; a chunked body is counted as it arrives
and refused the moment it passes the limit. Either way: 413 in OpenAI's error shape.
Uploads (``SELF_BOUNDED_PATHS``) are streamed by their route, which bounds them itself.
"""

from __future__ import annotations

import json
from typing import Final

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from producer.openai_api.errors import ApiError, ApiErrorCode

DEFAULT_MAX_BODY_BYTES: Final = 4 * 1024 * 1024
"""4 MiB: a million-character prompt of plain text (``MAX_PROMPT_CHARS``) and then some."""


SELF_BOUNDED_PATHS: Final = frozenset({"/v1/files"})
"""Routes that read their bodies as they stream and bound them themselves: ``POST /v1/files``
(``gateway.routes.files``, up to the gateway's ``--batch-max-file-bytes``)."""


class BodyTooLarge(Exception):
    """The body passed the limit while it was being read."""


class BodyLimit:
    """ASGI middleware: bodies larger than ``max_bytes`` get 413 and never reach the app
    whole; the paths in ``exempt`` pass untouched (their routes bound them)."""

    def __init__(
        self, app: ASGIApp, *, max_bytes: int = DEFAULT_MAX_BODY_BYTES, exempt: frozenset[str] = SELF_BOUNDED_PATHS
    ) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.exempt = exempt

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in self.exempt:
            await self.app(scope, receive, send)
            return
        declared = _content_length(scope)
        if declared is not None and declared > self.max_bytes:
            await self._refuse(send, f"the request body is {declared} bytes")
            return
        try:
            body, rest = await self._read(receive)
        except BodyTooLarge:
            await self._refuse(send, f"the request body is larger than {self.max_bytes} bytes")
            return
        await self.app(scope, _replay(body, rest, receive), send)

    async def _read(self, receive: Receive) -> tuple[bytes, Message | None]:
        """The whole body, counted as it comes; a disconnect on the way is handed on."""
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return b"".join(chunks), message
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                raise BodyTooLarge()
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks), None

    async def _refuse(self, send: Send, what: str) -> None:
        message = f"{what}; the limit is {self.max_bytes} bytes (the gateway's --max-body-bytes)"
        error = ApiError(413, message, code=ApiErrorCode.REQUEST_TOO_LARGE)
        payload = json.dumps(error.body()).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]
        # The unread rest of the body makes the connection unusable for another request.
        headers.append((b"connection", b"close"))
        await send({"type": "http.response.start", "status": error.status, "headers": headers})
        await send({"type": "http.response.body", "body": payload})


def _content_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None  # the server refuses it; nothing to bound here
    return None


def _replay(body: bytes, rest: Message | None, receive: Receive) -> Receive:
    """A ``receive`` that gives the app the body already read, then the real one
    (which the app listens on for a disconnect)."""
    pending: list[Message] = [{"type": "http.request", "body": body, "more_body": False}]
    if rest is not None:
        pending.append(rest)

    async def replayed() -> Message:
        if pending:
            return pending.pop(0)
        return await receive()

    return replayed
