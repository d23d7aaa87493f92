"""The producer library: submit prompts to streamq and follow their tokens.

    async with StreamqClient.from_url("redis://localhost:6379") as client:
        handle = await client.submit("The key to happiness is", max_tokens=32)
        async for event in handle:
            if isinstance(event, ChunkEvent):
                print(event.text, end="", flush=True)

``submit`` subscribes to the request's channel before it enqueues the job, so no
event can be missed. Imports neither vllm nor torch.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

import msgspec
from arq.connections import ArqRedis, RedisSettings, create_pool

from producer.protocol import (
    DEFAULT_QUEUE,
    JOB_FUNCTION,
    TERMINAL_EVENTS,
    WAKEUP_CHANNEL,
    ChatMessage,
    ChunkEvent,
    ErrorEvent,
    Event,
    FinalEvent,
    decode_event,
    deserialize_job,
    events_channel,
    parse_request,
    serialize_job,
)
from producer.subscriber import Delivery, EventSubscriber


class StreamqError(Exception):
    """Base of the errors this library raises."""


class RequestError(StreamqError):
    """The request ended with an error event (``code`` and ``message`` are the event's)."""

    def __init__(self, request_id: str, code: str, message: str) -> None:
        super().__init__(f"request {request_id} failed ({code}): {message}")
        self.request_id, self.code, self.message = request_id, code, message


class DuplicateRequest(StreamqError):
    """A job with this request id is queued, running, or has a stored result."""


class StreamGap(StreamqError):
    """Events went missing between two sequence numbers (the subscriber fell behind)."""


@dataclass
class Completion:
    """A finished request's output, assembled from its events."""

    request_id: str
    texts: list[str]
    token_ids: list[list[int]]
    finish_reasons: list[str | None]
    prompt_tokens: int
    completion_tokens: int

    @property
    def text(self) -> str:
        """The text of the first (with ``n=1``, the only) completion."""
        return self.texts[0]


@dataclass
class RequestHandle:
    """The events of one request, in order, ending with its final or error event.

    Duplicates (by sequence number) are dropped; a gap raises ``StreamGap``.
    """

    request_id: str
    _subscriber: EventSubscriber = field(repr=False)
    _queue: asyncio.Queue[Delivery] = field(repr=False)
    _next_seq: int | None = 0
    _done: bool = False

    def __aiter__(self) -> AsyncIterator[Event]:
        return self._events()

    async def _events(self) -> AsyncIterator[Event]:
        try:
            while not self._done:
                delivery = await self._queue.get()
                if isinstance(delivery, BaseException):
                    raise StreamqError(f"lost the connection to Redis: {delivery}") from delivery
                event = decode_event(delivery)
                if self._next_seq is None:  # tail of a request already under way
                    self._next_seq = event.seq
                if event.seq < self._next_seq:
                    continue
                if event.seq > self._next_seq:
                    raise StreamGap(f"request {self.request_id}: expected event {self._next_seq}, got {event.seq}")
                self._next_seq += 1
                self._done = isinstance(event, TERMINAL_EVENTS)
                yield event
        finally:
            await self.close()

    async def close(self) -> None:
        """Stop following the request (the request itself goes on)."""
        await self._subscriber.unsubscribe(events_channel(self.request_id), self._queue)

    async def result(self) -> Completion:
        """Wait for the request to finish and return its assembled output.

        Raises ``RequestError`` if it ended with an error event.
        """
        texts: dict[int, list[str]] = {}
        token_ids: dict[int, list[int]] = {}
        async for event in self:
            if isinstance(event, ChunkEvent):
                texts.setdefault(event.index, []).append(event.text)
                token_ids.setdefault(event.index, []).extend(event.token_ids)
            elif isinstance(event, ErrorEvent):
                raise RequestError(self.request_id, event.code, event.message)
            elif isinstance(event, FinalEvent):
                n = len(event.finish_reasons)
                return Completion(
                    request_id=self.request_id,
                    texts=["".join(texts.get(i, ())) for i in range(n)],
                    token_ids=[token_ids.get(i, []) for i in range(n)],
                    finish_reasons=event.finish_reasons,
                    prompt_tokens=event.prompt_tokens,
                    completion_tokens=event.completion_tokens,
                )
        raise StreamqError(f"request {self.request_id}: the stream ended without a final event")


class StreamqClient:
    """Submits requests to a streamq queue and follows their event channels."""

    def __init__(self, redis: ArqRedis, *, queue: str = DEFAULT_QUEUE) -> None:
        self.redis = redis
        self.queue = queue
        self._subscriber = EventSubscriber(redis)

    @classmethod
    async def connect(cls, url: str = "redis://localhost:6379", *, queue: str = DEFAULT_QUEUE) -> StreamqClient:
        """Connect to the Redis at ``url`` (``redis://`` or ``rediss://``)."""
        redis = await create_pool(
            RedisSettings.from_dsn(url),
            job_serializer=serialize_job,
            job_deserializer=deserialize_job,
            default_queue_name=queue,
        )
        return cls(redis, queue=queue)

    async def __aenter__(self) -> StreamqClient:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    async def close(self) -> None:
        await self._subscriber.close()
        await self.redis.aclose()

    async def submit(
        self,
        prompt: str | None = None,
        *,
        messages: Sequence[ChatMessage | dict[str, str]] | None = None,
        request_id: str | None = None,
        **sampling: Any,
    ) -> RequestHandle:
        """Enqueue a prompt (or chat ``messages``) and return the handle of its events.

        ``sampling`` takes ``SamplingOptions`` fields (``max_tokens``, ``temperature``,
        ...). Raises ``InvalidRequest`` (a ``ValueError``) before anything is sent
        if the request is malformed,
        and ``DuplicateRequest`` if ``request_id`` is already in use.
        """
        request = parse_request(
            {
                "request_id": request_id or uuid.uuid4().hex,
                "prompt": prompt,
                "messages": msgspec.to_builtins(list(messages)) if messages is not None else None,
                "sampling": sampling,
            }
        )
        handle = await self.follow(request.request_id)
        try:
            job = await self.redis.enqueue_job(
                JOB_FUNCTION, msgspec.to_builtins(request), _job_id=request.request_id, _queue_name=self.queue
            )
            if job is None:
                raise DuplicateRequest(f"request id {request.request_id!r} is already in use")
            await self.redis.publish(WAKEUP_CHANNEL, self.queue)
        except BaseException:
            await handle.close()
            raise
        return handle

    async def follow(self, request_id: str, *, from_start: bool = True) -> RequestHandle:
        """Follow the events of ``request_id`` from now on.

        With ``from_start=False`` the first event received sets the starting
        sequence number (for a request already under way; see ``tail``).
        """
        queue = await self._subscriber.subscribe(events_channel(request_id))
        return RequestHandle(request_id, self._subscriber, queue, _next_seq=0 if from_start else None)

