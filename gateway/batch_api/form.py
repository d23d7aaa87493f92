"""A ``multipart/form-data`` body read as it streams (python-multipart's push parser): each
part is handed on as it arrives, so an upload's file goes to the storage a chunk at a time
and is never whole in memory, nor spooled to a temporary file as Starlette's ``form()`` does."""

from __future__ import annotations

from collections import deque
from collections.abc import AsyncIterable, AsyncIterator
from dataclasses import dataclass
from typing import Final

from python_multipart.exceptions import MultipartParseError
from python_multipart.multipart import MultipartParser, parse_options_header

from producer.openai_api.errors import bad_request

MAX_FIELD_BYTES: Final = 64 * 1024
"""A form field other than the file (``purpose``, ``expires_after[seconds]``) is short."""
MAX_FORM_OVERHEAD: Final = 64 * 1024
"""What a form may add around its file (boundaries, part headers, short fields): a body
declared longer than the file's limit plus this is refused before it is read."""

_Event = tuple[str, object]


class MalformedForm(Exception):
    """The body is not the ``multipart/form-data`` its ``Content-Type`` says."""


def form_boundary(content_type: str | None) -> bytes:
    """The boundary of a ``multipart/form-data`` body; a 400 for any other body."""
    kind, options = parse_options_header(content_type)
    boundary = options.get(b"boundary")
    if kind != b"multipart/form-data" or not boundary:
        raise bad_request("the body must be multipart/form-data (a `file` and a `purpose`)", param="file")
    return boundary


@dataclass
class FormPart:
    """One part of the form: its field name, its file name (for a file), and its bytes,
    which ``data`` streams (once)."""

    name: str
    filename: str | None
    _reader: StreamedForm
    _done: bool = False

    async def data(self) -> AsyncIterator[bytes]:
        while not self._done:
            kind, value = await self._reader.next_event()
            if kind == "end":
                self._done = True
            elif kind == "data":
                assert isinstance(value, bytes)
                yield value
            else:
                raise MalformedForm(f"a part ended without its end ({kind})")

    async def text(self, limit: int = MAX_FIELD_BYTES) -> str:
        """A short field's value; a 400 past ``limit`` bytes."""
        value = bytearray()
        async for chunk in self.data():
            value += chunk
            if len(value) > limit:
                raise bad_request(f"the form field {self.name!r} is longer than {limit} bytes", param=self.name)
        return value.decode("utf-8", errors="replace")

    async def skip(self) -> None:
        async for _ in self.data():
            pass


class StreamedForm:
    """Parts of a form read from ``body`` (the request's chunks) as they arrive."""

    def __init__(self, body: AsyncIterable[bytes], boundary: bytes) -> None:
        self._body = body.__aiter__()
        self._events: deque[_Event] = deque()
        self._header_name = bytearray()
        self._header_value = bytearray()
        self._headers: dict[bytes, bytes] = {}
        self._ended = False
        self._parser = MultipartParser(
            boundary,
            callbacks={
                "on_part_begin": self._part_begin,
                "on_header_field": lambda data, start, end: self._header_name.extend(data[start:end]),
                "on_header_value": lambda data, start, end: self._header_value.extend(data[start:end]),
                "on_header_end": self._header_end,
                "on_headers_finished": self._headers_finished,
                "on_part_data": lambda data, start, end: self._events.append(("data", bytes(data[start:end]))),
                "on_part_end": lambda: self._events.append(("end", None)),
                "on_end": lambda: self._events.append(("done", None)),
            },
        )

    def _part_begin(self) -> None:
        self._headers = {}

    def _header_end(self) -> None:
        self._headers[bytes(self._header_name).lower()] = bytes(self._header_value)
        self._header_name.clear()
        self._header_value.clear()

    def _headers_finished(self) -> None:
        _, options = parse_options_header(self._headers.get(b"content-disposition"))
        name = options.get(b"name", b"").decode("utf-8", errors="replace")
        filename = options.get(b"filename")
        self._events.append(("begin", (name, None if filename is None else filename.decode("utf-8", "replace"))))

    async def next_event(self) -> _Event:
        """The next thing the parser saw: ``begin``, ``data``, ``end`` (of a part), ``done``
        (of the form); reads the body as far as it takes to see one."""
        while not self._events:
            if self._ended:
                raise MalformedForm("the body ended before the form did")
            try:
                chunk = await self._body.__anext__()
            except StopAsyncIteration:
                chunk = b""
            try:
                if chunk:
                    self._parser.write(chunk)
                else:
                    self._ended = True
                    self._parser.finalize()
            except MultipartParseError as exc:
                raise MalformedForm(str(exc)) from exc
        return self._events.popleft()

    async def parts(self) -> AsyncIterator[FormPart]:
        """Each part in turn; a part its reader left unread is skipped."""
        while True:
            kind, value = await self.next_event()
            if kind == "done":
                return
            if kind != "begin":
                raise MalformedForm(f"a part's {kind} before its headers")
            assert isinstance(value, tuple)
            part = FormPart(value[0], value[1], self)
            yield part
            await part.skip()
