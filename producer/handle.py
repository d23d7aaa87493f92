"""One request as its caller follows it: ``RequestHandle`` (its events, in order, checked,
ending with one final or error event) and ``Completion`` (its whole output).

A handle reads live events from its inbox (pub/sub) and what is missing from the replay
log; it asks its client only what ``RequestSource`` names: the log, where the job is, and
how to end or cancel it.
"""

from __future__ import annotations

import asyncio
import hashlib
import re
import time
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass
from types import TracebackType
from typing import Protocol

from msgspec import UNSET
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisClusterException
from redis.exceptions import TimeoutError as RedisTimeoutError

from producer.errors import MissingEvents, RequestError, RequestLost, RequestTimeout, redis_errors_as_streamq_errors
from producer.pooled import Pooled
from producer.subscriber import Inbox, Resync
from streamq.protocol import (
    TERMINAL_EVENTS,
    ChunkEvent,
    ErrorEvent,
    Event,
    FinalEvent,
    FinishReason,
    ParsedOutput,
    PooledEvent,
    PromptEcho,
    StreamqError,
    TokenLogprob,
    decode_event,
)
from streamq.protocol.status import RequestState

DIGEST_PATTERN = re.compile(r"[0-9a-f]{16}")
"""What ``event_digest`` returns: 16 lower-case hex digits."""


def event_digest(raw: bytes) -> str:
    """The digest of one event as Redis holds it (its JSON, byte for byte): BLAKE2b of 8
    bytes, in hex. The same in every process and every language, so a caller keeps it to
    resume exactly (``follow``'s ``after``; the gateway's SSE ids) and to tell the event it
    had from another numbered alike, which a Redis that lost writes may log in its place."""
    return hashlib.blake2b(raw, digest_size=8).hexdigest()


@dataclass
class Completion:
    """A finished request's output, assembled from its events."""

    request_id: str
    texts: list[str]
    token_ids: list[list[int]]
    finish_reasons: list[str | None]
    prompt_tokens: int
    completion_tokens: int
    logprobs: list[list[TokenLogprob]] | None = None
    """Per completion, one entry per token of ``token_ids``, when ``logprobs`` was asked for."""
    prompt_logprobs: list[TokenLogprob | None] | None = None
    """One entry per prompt token (``None`` for the first), when ``prompt_logprobs`` was asked for."""
    prompt_token_ids: list[int] | None = None
    """The prompt's tokens (after the chat template), when ``prompt_logprobs`` or ``echo`` was asked for."""
    prompt_echo: PromptEcho | None = None
    """The prompt as text, when ``echo`` was asked for."""
    worker_id: str | None = None
    """The worker that ran the request to its end (the final event's ``worker``)."""
    parsed: list[ParsedOutput | None] | None = None
    """A chat request not streamed, on a worker with a tool or reasoning parser: per
    completion, its message as the parser read it (``content``, ``reasoning``,
    ``tool_calls``) and ``tool_calls`` as its finish reason where it called tools."""
    pooled: Pooled | None = None
    """A pooling request's results (its ``inputs``' vectors)."""

    @property
    def text(self) -> str:
        """The text of the first (with ``n=1``, the only) completion."""
        return self.texts[0]

    @property
    def finish_reason(self) -> str | None:
        """Why the first (with ``n=1``, the only) completion ended: ``stop``, ``length``, ..."""
        return self.finish_reasons[0]

    @property
    def usage(self) -> Usage:
        """Its tokens, as OpenAI's ``usage`` counts them."""
        return Usage(self.prompt_tokens, self.completion_tokens, self.prompt_tokens + self.completion_tokens)


@dataclass(frozen=True)
class Usage:
    """A request's tokens: its prompt's, those it generated (every completion's), both."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class _CompletionParts:
    """What a handle has delivered so far, assembled as it goes: ``result`` returns it
    however the events were read (iterated, or by ``result`` itself, or both in turn)."""

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self.texts: dict[int, list[str]] = {}
        self.token_ids: dict[int, list[int]] = {}
        self.logprobs: dict[int, list[TokenLogprob]] | None = None
        self.prompt_logprobs: list[TokenLogprob | None] | None = None
        self.prompt_token_ids: list[int] | None = None
        self.prompt_echo: PromptEcho | None = None
        self.parsed: dict[int, ParsedOutput] = {}
        self.final: FinalEvent | None = None
        self.error: ErrorEvent | None = None
        self.pooled: PooledEvent | None = None

    def add(self, event: Event) -> None:
        """Take one event (an error event is kept, for ``completion`` to raise)."""
        if isinstance(event, ChunkEvent):
            self.texts.setdefault(event.index, []).append(event.text)
            self.token_ids.setdefault(event.index, []).extend(event.token_ids)
            if event.logprobs is not UNSET:
                self.logprobs = {} if self.logprobs is None else self.logprobs
                self.logprobs.setdefault(event.index, []).extend(event.logprobs)
            if event.prompt_logprobs is not UNSET:
                self.prompt_logprobs = event.prompt_logprobs
            if event.prompt_token_ids is not UNSET:
                self.prompt_token_ids = event.prompt_token_ids
            if event.prompt_echo is not UNSET:
                self.prompt_echo = event.prompt_echo
            if event.parsed is not UNSET and event.finish_reason is not None:
                self.parsed[event.index] = event.parsed
        elif isinstance(event, PooledEvent):
            self.pooled = event  # a take-over's may follow an earlier attempt's: the last holds
        elif isinstance(event, ErrorEvent):
            self.error = event
        else:
            self.final = event

    def completion(self) -> Completion:
        """The assembled output once the request ended; ``RequestError`` if it ended with an
        error event."""
        if self.error is not None:
            raise RequestError(self.request_id, self.error.code, self.error.message)
        final = self.final
        if final is None:
            raise StreamqError(f"request {self.request_id}: it has not ended")
        n = len(final.finish_reasons)
        return Completion(
            request_id=self.request_id,
            texts=["".join(self.texts.get(i, ())) for i in range(n)],
            token_ids=[self.token_ids.get(i, []) for i in range(n)],
            finish_reasons=final.finish_reasons,
            prompt_tokens=final.prompt_tokens,
            completion_tokens=final.completion_tokens,
            logprobs=None if self.logprobs is None else [self.logprobs.get(i, []) for i in range(n)],
            prompt_logprobs=self.prompt_logprobs,
            prompt_token_ids=self.prompt_token_ids,
            prompt_echo=self.prompt_echo,
            worker_id=final.worker,
            parsed=[self.parsed.get(i) for i in range(n)] if self.parsed else None,
            pooled=Pooled.of_event(self.pooled, final.worker) if self.pooled is not None else None,
        )


class RequestSource(Protocol):
    """What a handle asks of its client (``StreamqClient``'s own, in ``producer.client``)."""

    @property
    def silence_check_s(self) -> float:
        """How long a silent stream waits before the handle checks that its request lives."""

    async def read_log(self, request_id: str, from_seq: int) -> list[bytes]:
        """The request's logged events from ``from_seq`` on."""

    async def job_state(self, request_id: str, queue: str | None) -> RequestState:
        """Where the request's job is (``queue``: the queue it was put on, where known)."""

    async def end_queued(self, request_id: str, queue: str, reason: FinishReason) -> RequestState:
        """Take the request off ``queue`` if it is still there, and end it with ``reason``."""

    async def eviction_cause(self) -> str | None:
        """Why events may be gone, where Redis evicted keys (``memory_policy.eviction_cause``)."""

    async def unfollow(self, request_id: str, inbox: Inbox) -> None:
        """Stop delivering the request's events to ``inbox``."""

    async def cancel(self, request_id: str, *, queue: str | None = None) -> RequestState:
        """Cancel the request (``StreamqClient.cancel``)."""


class RequestHandle:
    """The events of one request, in order, ending with its final or error event.

    Iterate it (``async for event in handle``) for the events, or ``await
    handle.result()`` for the whole output. As a context manager (``async with await
    client.submit(...) as handle``) it is closed on exit: it stops following the request,
    and cancels it too if ``cancel_on_close`` is set and the request has not ended.

    Live events come from pub/sub; whatever is missing (joining late, or a gap) is
    read from the replay log. Duplicates (by sequence number) are dropped, once checked
    against what was delivered: an event numbered like one delivered but not the same
    means the log was rewritten (``MissingEvents``). A handle delivers one terminal event
    at most, and nothing after it, whatever the log holds later.
    """

    def __init__(
        self,
        source: RequestSource,
        request_id: str,
        inbox: Inbox,
        next_seq: int,
        *,
        job_queue: str,
        queue_known: bool = True,
        cancel_on_close: bool = False,
        queue_timeout_s: float | None = None,
    ) -> None:
        self.request_id = request_id
        self.job_queue = job_queue
        """The arq queue the request was put on (the client's, or its model's)."""
        self._queue_known = queue_known
        """Whether ``job_queue`` is the request's for sure (it was submitted here, or named),
        not the client's own taken for it (a request followed by id)."""
        self._queue_deadline = None if queue_timeout_s is None else time.monotonic() + queue_timeout_s
        """When the request's wait for a worker passes its ``queue_timeout_s``: a request still
        queued then is ended here (no worker may be alive to end it)."""
        self.cancel_on_close = cancel_on_close
        """If set, closing the handle before the request ended cancels the request: for
        a caller that will not read the rest, so the engine stops generating it."""
        self._source = source
        self._inbox = inbox
        self._backlog: deque[bytes] = deque()
        self._next_seq = next_seq
        self._first_seq = next_seq
        self._delivered: list[str] = []
        """The digest (``event_digest``) of each event delivered, from ``_first_seq`` on (with
        ``follow``'s ``after``: of the event before the first, as the caller had it)."""
        self._done = False
        self._closed = False
        self._parts = _CompletionParts(request_id)

    def __aiter__(self) -> AsyncIterator[Event]:
        return self._events()

    async def __aenter__(self) -> RequestHandle:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    @property
    def done(self) -> bool:
        """True once the final or error event has been seen."""
        return self._done

    @property
    def last_digest(self) -> str | None:
        """The digest (``event_digest``) of the last event delivered, as it was logged; with
        ``follow``'s ``after`` and nothing delivered yet, that digest. To resume exactly
        where this handle stopped: ``follow(request_id, from_seq=<its seq> + 1,
        after=handle.last_digest)``. ``None`` before any event."""
        return self._delivered[-1] if self._delivered else None

    def digest(self, seq: int) -> str | None:
        """The digest of event ``seq`` as this handle delivered it (``None`` for one it did
        not deliver): what the gateway labels that event's SSE ``id`` with."""
        index = seq - self._first_seq
        return self._delivered[index] if 0 <= index < len(self._delivered) else None

    async def _next_raw(self) -> bytes:
        while not self._backlog:
            wait_s = self._source.silence_check_s
            if self._queue_deadline is not None:
                wait_s = max(0.0, min(wait_s, self._queue_deadline - time.monotonic()))
            delivery = await self._inbox.get(wait_s)
            if delivery is None:
                if self._queue_deadline is not None and time.monotonic() >= self._queue_deadline:
                    await self._end_if_still_queued()
                else:
                    await self._check_alive()
                continue
            if isinstance(delivery, BaseException):
                raise StreamqError(f"lost the connection to Redis: {delivery}") from delivery
            if isinstance(delivery, Resync):
                await self._replay()
            else:
                return delivery
        return self._backlog.popleft()

    async def _check_alive(self) -> None:
        """The stream has been silent for a while: take what the log holds, else make
        sure the request is still queued or running; raise ``RequestLost`` if it is
        neither and never ended, instead of waiting forever. Redis being away is no
        verdict: the subscription reports a connection lost for good."""
        try:
            if await self._replay():
                return
            state = await self._source.job_state(self.request_id, self.job_queue if self._queue_known else None)
        except (RedisConnectionError, RedisTimeoutError, OSError, RedisClusterException):
            return  # a shard away too: its subscription says when it is gone for good
        if state in ("queued", "running") or await self._replay():  # the log again: an end may have raced
            return
        evicted = await self._source.eviction_cause()
        raise RequestLost(
            self.request_id,
            "lost",
            f"the request is no longer queued or running ({state}) and its stream ended without a final event"
            + (f"; {evicted}" if evicted else ""),
        )

    async def _end_if_still_queued(self) -> None:
        """The request's ``queue_timeout_s`` passed: if no event came and it is still queued
        (no worker took it; maybe none is alive), take it off its queue and end it with finish
        reason ``queue_timeout``, as a worker taking it now would. Either way the deadline is
        spent: a running request is its worker's to end."""
        self._queue_deadline = None
        if self._next_seq == 0 and not self._delivered:
            try:
                await self._source.end_queued(self.request_id, self.job_queue, FinishReason.QUEUE_TIMEOUT)
            except (RedisConnectionError, RedisTimeoutError, OSError, RedisClusterException):
                return  # Redis away: the watchdog and the worker's own check remain

    async def _fill_gap(self) -> bool:
        """Replace the backlog with the log from the last event delivered on (checked again
        on its way, as ``_replay`` checks it: a gap can be a rewritten log's, whose next
        events continue another version); False if the log does not hold the next expected
        event (it was lost, or trimmed)."""
        from_seq = self._next_seq - 1 if self._delivered else self._next_seq
        logged = await self._source.read_log(self.request_id, from_seq)
        index = self._next_seq - (decode_event(logged[0]).seq if logged else self._next_seq)
        if not 0 <= index < len(logged) or decode_event(logged[index]).seq != self._next_seq:
            return False
        self._backlog = deque(logged)
        return True

    async def _replay(self) -> bool:
        """Queue logged events from the next expected one (and the last one delivered, to
        check that the log still holds it); False if there are none to deliver."""
        from_seq = self._next_seq - 1 if self._delivered else self._next_seq
        logged = await self._source.read_log(self.request_id, from_seq)
        self._backlog.extendleft(reversed(logged))
        return len(logged) > self._next_seq - from_seq

    async def _start_after(self, digest: str) -> None:
        """``follow``'s check, before anything is delivered: the log still holds the event
        before the first expected, as the caller had it (``digest``); else ``MissingEvents``.
        Then queue what follows it; if that event ended the request, the handle is done."""
        seq = self._next_seq - 1
        logged = await self._source.read_log(self.request_id, seq)
        first = decode_event(logged[0]) if logged else None
        if first is None or first.seq != seq or event_digest(logged[0]) != digest:
            held = "no longer holds it" if first is None or first.seq != seq else "holds another event in its place"
            cause = await self._source.eviction_cause() or "Redis lost writes it had acknowledged, or the log expired"
            raise MissingEvents(
                f"request {self.request_id}: event {seq} is not the one the caller had: the log {held} ({cause}), "
                "so what it holds does not continue it"
            )
        self._first_seq, self._delivered = seq, [digest]
        self._backlog.extend(logged[1:])
        if isinstance(first, TERMINAL_EVENTS):  # the caller has the end: nothing follows it
            self._done = True
            self._parts.add(first)

    async def _check_delivered(self, event: Event, raw: bytes) -> None:
        """``event`` repeats one already delivered: it must be that very event."""
        index = event.seq - self._first_seq
        if 0 <= index < len(self._delivered) and self._delivered[index] != event_digest(raw):
            cause = (
                await self._source.eviction_cause() or "a crash without fsync, or a failover to a replica that lagged"
            )
            raise MissingEvents(
                f"request {self.request_id}: event {event.seq} is no longer the one delivered: Redis lost writes "
                f"it had acknowledged ({cause}) and the request went on from what it kept"
            )

    @redis_errors_as_streamq_errors
    async def _next_event(self) -> Event | None:
        """The next event in order; ``None`` once the request's last event was delivered."""
        while not self._done:
            if self._closed:
                raise StreamqError(f"request {self.request_id}: this handle is closed")
            raw = await self._next_raw()
            event = decode_event(raw)
            if event.seq < self._next_seq:
                await self._check_delivered(event, raw)
                continue
            if event.seq > self._next_seq:
                if not await self._fill_gap():
                    raise MissingEvents(f"request {self.request_id}: expected event {self._next_seq}, got {event.seq}")
                continue
            self._next_seq += 1
            self._delivered.append(event_digest(raw))
            self._done = isinstance(event, TERMINAL_EVENTS)
            self._parts.add(event)
            return event
        return None

    async def _events(self) -> AsyncIterator[Event]:
        """The events, then the handle closed; a loop left early (``break``) leaves it open,
        for another loop or ``result()``, until ``close()`` or the end of ``async with``."""
        try:
            while (event := await self._next_event()) is not None:
                yield event
        except GeneratorExit:
            raise
        except BaseException:
            await self.close()
            raise
        await self.close()

    async def cancel(self) -> RequestState:
        """Cancel the request (see ``StreamqClient.cancel``); its stream ends with a
        final event whose finish reason is ``cancelled``."""
        return await self._source.cancel(self.request_id, queue=self.job_queue)

    @redis_errors_as_streamq_errors
    async def close(self) -> None:
        """Stop following the request; cancel it too if ``cancel_on_close`` is set and it
        has not ended. Closing twice does nothing."""
        if self._closed:
            return
        self._closed = True
        await self._source.unfollow(self.request_id, self._inbox)
        if self.cancel_on_close and not self._done:
            await self.cancel()

    async def result(self, timeout: float | None = None) -> Completion:
        """Wait for the request to end and return its whole output (the events delivered
        by iterating this handle included); then close the handle.

        Raises ``RequestError`` if it ended with an error event, and ``RequestTimeout`` (a
        builtin ``TimeoutError`` too) once ``timeout`` seconds pass first. A timeout does not
        stop the request: it keeps running and this handle keeps following it (even with
        ``cancel_on_close``). Call ``result()`` again to wait on, with what was gathered
        so far kept, or ``cancel()`` to stop the request.
        """
        deadline = asyncio.timeout(timeout)
        try:
            async with deadline:
                while await self._next_event() is not None:
                    pass
        except BaseException as exc:
            if not deadline.expired():
                await self.close()
                raise
            if isinstance(exc, TimeoutError):
                raise RequestTimeout(f"request {self.request_id}: not ended within {timeout:g} s") from exc
            raise
        await self.close()
        return self._parts.completion()

    async def text(self) -> AsyncIterator[str]:
        """The request's text as it comes, chunk by chunk (with ``n`` > 1, every
        completion's, in the order they come: the events tell them apart); raises
        ``RequestError`` if it ends with an error event. For a loop that wants the words
        only: ``async for text in handle.text(): print(text, end="")``."""
        async for event in self:
            if isinstance(event, ChunkEvent):
                yield event.text
            elif isinstance(event, ErrorEvent):
                raise RequestError(self.request_id, event.code, event.message)
