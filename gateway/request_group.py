"""The requests in the queue behind one HTTP request: one, or one per prompt of a
``/v1/completions`` body with several (as ``vllm serve`` runs one engine request per
prompt and merges their outputs)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, Sequence

from producer.client import Completion, RequestHandle
from streamq.protocol import TERMINAL_EVENTS, ErrorEvent, Event


class RequestGroup:
    """The handles of one HTTP request's requests, in prompt order."""

    def __init__(self, handles: Sequence[RequestHandle], name: str | None = None) -> None:
        self.handles = list(handles)
        self.name = name if name is not None else (self.handles[0].request_id if self.handles else "")
        """What the response is named after (``cmpl-<name>``): the request's id, or the id
        its prompts' requests are named after (``<name>-<i>``)."""

    async def results(self) -> list[Completion]:
        """Every request's whole output, in prompt order (the first error raises)."""
        return list(await asyncio.gather(*(handle.result() for handle in self.handles)))

    async def events(self) -> AsyncGenerator[tuple[int, Event], None]:
        """Each request's events as they come, with its prompt's position, until every
        request ended or one failed."""
        if len(self.handles) == 1:
            async for event in self.handles[0]:
                yield 0, event
            return
        merged: asyncio.Queue[tuple[int, Event] | BaseException] = asyncio.Queue()

        async def follow(prompt: int, handle: RequestHandle) -> None:
            try:
                async for event in handle:
                    await merged.put((prompt, event))
            except Exception as exc:  # the reader gets it: one request failing fails the response
                await merged.put(exc)

        tasks = [asyncio.ensure_future(follow(i, handle)) for i, handle in enumerate(self.handles)]
        try:
            ended = 0
            while ended < len(tasks):
                item = await merged.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if isinstance(item[1], ErrorEvent):
                    return
                if isinstance(item[1], TERMINAL_EVENTS):
                    ended += 1
        finally:
            for task in tasks:
                task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.gather(*tasks, return_exceptions=True)

    async def close(self) -> None:
        """Close every handle (cancelling the requests that set ``cancel_on_close``)."""
        await asyncio.gather(*(handle.close() for handle in self.handles), return_exceptions=True)
