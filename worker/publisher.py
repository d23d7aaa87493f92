"""Coalesced publishing of events to the replay log and pub/sub.

Jobs never await Redis per token (a command costs about 100 µs of Python): they buffer
events and one flusher task sends all that is buffered in one command, so batches grow
with the load while an idle worker's first token goes out at once. One flusher keeps
each request's events in order; the log skips sequence numbers it holds, so retries are safe.

While a batch is in flight, a request's next DELTA may be merged into its chunk still
waiting in the buffer (``extendable``): the events per token, and with them Redis's work,
fall exactly when the load rises, while an idle worker still sends every DELTA as it comes.
Chunks are encoded when the flusher takes them, so a merged chunk is encoded once.

Where an end waits for its replicas (the log's ``durability``, ``--durable-ends``), a
request whose terminal event the flusher takes goes, with its events of that buffer, to the
end confirmer, a task of its own on a connection of its own: it logs them and waits in one
pipeline (``ReplayLog.confirm``), publishes them, and only then resolves their waiters (so
the job's settling, its callback and arq's acknowledgement come after). The other requests'
events never wait for it. With nothing to wait for, every event goes the one way, as before.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from redis.exceptions import (
    AskError,
    BusyLoadingError,
    ClusterDownError,
    MovedError,
    OutOfMemoryError,
    ReadOnlyError,
    ResponseError,
    SlotNotCoveredError,
    TryAgainError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from streamq.broker.durability import REPLICA_REPLY
from streamq.broker.replay_log import Appended, LogEvent, ReplayLog
from streamq.protocol import ChunkEvent, TokenLogprob, encode_event
from streamq.protocol.names import COALESCE_ENV
from streamq.tasks import stop_task
from worker import metrics

logger = logging.getLogger("streamq.worker")

TRANSIENT_REPLY_PREFIXES = (
    "READONLY",
    "MASTERDOWN",
    "BUSY",
    "LOADING",
    "TRYAGAIN",
    "OOM",
    "NOREPLICAS",
    "CLUSTERDOWN",
)
"""Redis error replies that pass on their own (a failover, a restart loading its data, a
slow script, memory freed by expiry, a slot moving between a cluster's shards): a batch
that meets them is sent again."""
TRANSIENT_REPLIES = (
    ReadOnlyError,
    BusyLoadingError,
    OutOfMemoryError,
    TryAgainError,
    ClusterDownError,
    MovedError,
    AskError,
    SlotNotCoveredError,
)
"""The same replies as redis-py parses them (its error classes drop the reply's first word),
with a cluster's redirects that outlived the log's own following of them."""
DEFAULT_RETRY_FOR_S = 60.0
"""How long a batch is retried through transient errors: longer than a Redis restart or
a Sentinel failover, shorter than a client's watchdog."""


def coalesce_from_env(environ: Mapping[str, str] = os.environ) -> bool:
    """``$STREAMQ_COALESCE``: anything but ``0``, ``false``, ``no`` or ``off`` (or unset) merges."""
    return environ.get(COALESCE_ENV, "1").strip().lower() not in ("0", "false", "no", "off")


class Refusal(enum.Enum):
    """Why the log refused an attempt's events (``append_and_publish``)."""

    SUPERSEDED = "superseded"
    """Another attempt owns the request, or it ended: this attempt stops, writing nothing more."""
    OUT_OF_STEP = "out of step"
    """The log lost events this attempt had written (a Redis that lost acknowledged writes):
    this attempt hands its job back, and the next one goes on from what the log holds."""


class PublishFailed(RuntimeError):
    """Events could not be logged: Redis stayed unreachable for longer than the retry
    budget, or refused them for good (a permission, a wrong key type)."""


def is_transient(exc: BaseException) -> bool:
    """True for failures worth sending the same batch again for (a wait refused on a
    replica too: a primary demoted under the connection)."""
    if isinstance(exc, (RedisConnectionError, RedisTimeoutError, OSError, *TRANSIENT_REPLIES)):
        return True
    return isinstance(exc, ResponseError) and (
        str(exc).startswith(TRANSIENT_REPLY_PREFIXES) or REPLICA_REPLY in str(exc)
    )


class EventPublisher:
    """Buffers events and flushes them in batches.

    ``on_refused`` is called with ``(request_id, attempt, refusal)`` for each attempt
    whose events the log refused, as soon as the reply says so: that attempt's job should
    stop. The refusal is also kept until the job asks (``take_refusal``): a refusal of
    an event published before ``flushed()`` was asked is known once it resolves.
    ``coalesce=False`` makes ``extendable`` always false: one event per DELTA.

    On a Redis Cluster a batch can partly fail (a shard away): the events it could not log
    go back to the front of the buffer and are sent again with the next batch, while the
    other shards' requests go on; a request whose events have failed for ``retry_for_s``
    has them dropped, and its waiters fail.

    Ends that wait (the log's ``durability`` has something to wait for) go through the end
    confirmer (``_confirm_forever``), each request's retried alone for ``retry_for_s``.
    """

    def __init__(
        self,
        log: ReplayLog,
        *,
        on_refused: Callable[[str, int, Refusal], None] | None = None,
        retry_for_s: float = DEFAULT_RETRY_FOR_S,
        retry_delay_s: float = 0.2,
        coalesce: bool = True,
    ) -> None:
        self._log = log
        self._on_refused = on_refused
        self._refusals: dict[tuple[str, int], Refusal] = {}
        self.coalesce = coalesce
        self._pending: list[LogEvent | ChunkEvent] = []
        self._generation = 0
        """Counts the buffers the flusher took: a chunk published in the current one is
        still waiting, so it may be extended."""
        self._in_flight = False
        self._deltas = 0
        """DELTAs buffered since the flusher last took the buffer, merged ones included."""
        self._pending_waiters: list[_Waiter] = []
        self._sending_waiters: list[_Waiter] = []
        """Waiters of the batch in flight: resolved when it is done, as the pending ones are
        when the batch that takes them is."""
        self._has_pending = asyncio.Event()
        self._failing_since: dict[str, float] = {}
        """Request id -> when its events first failed to reach their shard (cluster only)."""
        self._retry_for_s = retry_for_s
        self._retry_delay_s = retry_delay_s
        self._task: asyncio.Task[None] | None = None
        self._to_confirm: list[_Confirmation] = []
        """Ends handed to the confirmer, not yet taken by it."""
        self._confirming: list[_Confirmation] = []
        """Ends handed to the confirmer and not yet confirmed (queued or in flight)."""
        self._confirm_wake = asyncio.Event()
        self._confirmer: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Start the flusher task (and, where ends may wait, the end confirmer) on the running loop."""
        loop = asyncio.get_running_loop()
        self._task = loop.create_task(self._flush_forever(), name="event-publisher")
        if self._log.durability is not None:
            self._confirmer = loop.create_task(self._confirm_forever(), name="end-confirmer")

    async def close(self) -> None:
        """Flush what is buffered (failures are logged by the flusher), then stop it."""
        if self._pending or self._confirming:
            with contextlib.suppress(PublishFailed):
                await self.flushed()
        await stop_task(self._task)
        await stop_task(self._confirmer)
        self._task = self._confirmer = None

    def publish(self, request_id: str, seq: int, attempt: int, payload: bytes, *, terminal: bool = False) -> None:
        """Queue event ``seq`` of ``request_id``'s ``attempt``; returns at once (no I/O)."""
        self._pending.append(LogEvent(request_id, seq, attempt, payload, terminal))
        self._has_pending.set()

    def publish_chunk(self, event: ChunkEvent, *, deltas: int = 1) -> int:
        """Queue a chunk (of ``deltas`` engine DELTAs), still open to ``extend``; returns the
        buffer's generation, which ``extendable`` takes. The chunk is encoded when the
        flusher takes it."""
        self._pending.append(event)
        self._deltas += deltas
        self._has_pending.set()
        return self._generation

    def extendable(self, generation: int) -> bool:
        """True when a chunk published in ``generation`` is still waiting behind a batch
        in flight: merging into it delays nothing, since it could not go out sooner."""
        return self._in_flight and generation == self._generation and self.coalesce

    def extend(
        self,
        event: ChunkEvent,
        text: str,
        token_ids: Sequence[int],
        finish_reason: str | None,
        logprobs: list[TokenLogprob] | None = None,
    ) -> None:
        """Append the next DELTA of ``event``'s completion to it (``extendable`` said yes)."""
        append_delta(event, text, token_ids, finish_reason, logprobs)
        self._deltas += 1

    def flushed(self, request_id: str | None = None) -> asyncio.Future[None]:
        """A future that resolves once everything published so far has reached Redis
        (the batch in flight too), or fails with ``PublishFailed`` if it could not; with
        ``request_id``, once that request's events have (others' failing do not hold it up)."""
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        if self._pending:
            self._pending_waiters.append(_Waiter(request_id, waiter))
        elif self._in_flight:
            self._sending_waiters.append(_Waiter(request_id, waiter))
        else:
            self._settle_after_ends([_Waiter(request_id, waiter)])
        return waiter

    def take_refusal(self, request_id: str, attempt: int) -> Refusal | None:
        """Why the log refused events of ``attempt`` at ``request_id``, if it did (once)."""
        return self._refusals.pop((request_id, attempt), None)

    async def _flush_forever(self) -> None:
        while True:
            await self._has_pending.wait()
            self._has_pending.clear()
            taken, self._pending = self._pending, []
            waiters, self._pending_waiters = self._pending_waiters, []
            deltas, self._deltas = self._deltas, 0
            self._generation += 1
            batch, chunks, tokens = _encoded(taken)
            if self._failing_since:
                batch, waiters = self._drop_expired(batch, waiters)
            if self._confirmer is not None and self._log.durability is not None and self._log.durability.waits:
                batch, waiters = self._to_confirmer(batch, waiters)
                if not batch:  # ends only: the confirmer has them
                    metrics.DELTAS.inc(deltas)
                    metrics.CHUNKS.inc(chunks)
                    metrics.GENERATED_TOKENS.inc(tokens)
                    self._settle_after_ends(waiters)
                    continue
            self._sending_waiters = waiters
            started = time.perf_counter()
            self._in_flight = True
            try:
                unsent, error = await self._send(batch)
            except Exception as exc:  # the flusher must outlive any batch: fail it, loudly
                failure = exc if isinstance(exc, PublishFailed) else PublishFailed(f"{type(exc).__name__}: {exc}")
                requests = sorted({event.request_id for event in batch})
                logger.error("%d events of %d requests NOT published: %s", len(batch), len(requests), failure)
                metrics.PUBLISH_FAILURES.inc(len(batch))
                _settle(waiters, failure)
                continue
            finally:
                self._in_flight = False
            metrics.PUBLISH_SECONDS.observe(time.perf_counter() - started)
            metrics.PUBLISH_BATCH_EVENTS.observe(len(batch) - len(unsent))
            metrics.DELTAS.inc(deltas)
            metrics.CHUNKS.inc(chunks)
            metrics.GENERATED_TOKENS.inc(tokens)
            failing = {event.request_id for event in unsent}
            for request_id in {event.request_id for event in batch} - failing:
                self._failing_since.pop(request_id, None)
            if not unsent:
                self._settle_after_ends(waiters)
                continue
            now = time.monotonic()
            for request_id in failing:
                self._failing_since.setdefault(request_id, now)
            logger.warning("%d events of %d requests not logged, sent again: %s", len(unsent), len(failing), error)
            self._pending[:0] = unsent  # ahead of anything published since: each request's order holds
            carried = [waiter for waiter in waiters if waiter.request_id is None or waiter.request_id in failing]
            self._settle_after_ends([waiter for waiter in waiters if waiter not in carried])
            self._pending_waiters[:0] = carried
            self._has_pending.set()
            await asyncio.sleep(self._retry_delay_s)

    def _to_confirmer(self, batch: list[LogEvent], waiters: list[_Waiter]) -> tuple[list[LogEvent], list[_Waiter]]:
        """Hand the requests of ``batch`` that end in it (their events of the batch, their
        waiters) to the confirmer; ``batch`` and ``waiters`` without them."""
        ended = {event.request_id for event in batch if event.terminal}
        if not ended:
            return batch, waiters
        now = time.monotonic()
        for request_id in ended:
            confirmation = _Confirmation(
                request_id,
                [event for event in batch if event.request_id == request_id],
                [waiter for waiter in waiters if waiter.request_id == request_id],
                asyncio.get_running_loop().create_future(),
                now,
            )
            self._to_confirm.append(confirmation)
            self._confirming.append(confirmation)
        self._confirm_wake.set()
        rest = [event for event in batch if event.request_id not in ended]
        return rest, [waiter for waiter in waiters if waiter.request_id not in ended]

    def _settle_after_ends(self, waiters: list[_Waiter]) -> None:
        """Resolve ``waiters`` whose events reached Redis, each once the ends it also waits
        for are confirmed (a waiter of every request: every end handed to the confirmer so
        far; of one: its own), failing it if one of them failed."""
        for waiter in waiters:
            ends = [c.outcome for c in self._confirming if waiter.request_id in (None, c.request_id)]
            if not ends:
                _settle([waiter])
                continue

            def done(
                _: object, waiter: _Waiter = waiter, ends: list[asyncio.Future[PublishFailed | None]] = ends
            ) -> None:
                if all(end.done() for end in ends):
                    _settle([waiter], next((end.result() for end in ends if end.result() is not None), None))

            for end in ends:
                end.add_done_callback(done)

    async def _confirm_forever(self) -> None:
        """The end confirmer: each round takes every end handed to it, confirms them together
        (``ReplayLog.confirm``: logged, waited for, published), then resolves their waiters;
        a request whose end could not be confirmed is sent again, for ``retry_for_s``."""
        while True:
            await self._confirm_wake.wait()
            self._confirm_wake.clear()
            taken, self._to_confirm = self._to_confirm, []
            if not taken:
                continue
            retry = await self._confirm_round(taken)
            if retry:
                self._to_confirm[:0] = retry  # ahead of ends handed over since
                self._confirm_wake.set()
                await asyncio.sleep(self._retry_delay_s)

    async def _confirm_round(self, taken: list[_Confirmation]) -> list[_Confirmation]:
        """Confirm ``taken`` once; the confirmations to try again."""
        events = [event for confirmation in taken for event in confirmation.events]
        metrics.ROUND_TRIPS["confirm"].inc()
        try:
            appended = await self._log.confirm(events)
        except Exception as exc:  # the confirmer must outlive any round
            if is_transient(exc):
                logger.warning("confirming the ends of %d requests failed, retrying: %s", len(taken), exc)
                return self._retried(taken, exc)
            failure = PublishFailed(f"Redis refused the ends of {len(taken)} requests: {type(exc).__name__}: {exc}")
            logger.error("%d events of %d requests NOT published: %s", len(events), len(taken), failure)
            metrics.PUBLISH_FAILURES.inc(len(events))
            for confirmation in taken:
                self._confirmed(confirmation, failure)
            return []
        metrics.PUBLISH_BATCH_EVENTS.observe(len(events) - len(appended.unsent))
        if appended.superseded or appended.out_of_step:
            self._refused(events, appended)
        unsent = {event.request_id for event in appended.unsent}
        again = [confirmation for confirmation in taken if confirmation.request_id in unsent]
        for confirmation in taken:
            if confirmation.request_id not in unsent:
                self._confirmed(confirmation)
        if not again:
            return []
        error = appended.error
        if error is not None and not is_transient(error):
            failure = PublishFailed(f"Redis refused the ends of {len(again)} requests: {error}")
            for confirmation in again:
                self._confirmed(confirmation, failure)
            return []
        logger.warning("the ends of %d requests not confirmed, sent again: %s", len(again), error)
        return self._retried(again, error)

    def _retried(self, confirmations: list[_Confirmation], error: BaseException | None) -> list[_Confirmation]:
        """``confirmations`` to send again; those past ``retry_for_s`` fail instead."""
        now = time.monotonic()
        again = [c for c in confirmations if now - c.since < self._retry_for_s]
        expired = [c for c in confirmations if c not in again]
        if expired:
            failure = PublishFailed(
                f"could not confirm the ends of {len(expired)} requests for {self._retry_for_s:.0f}s: {error}"
            )
            events = sum(len(c.events) for c in expired)
            logger.error("%d events of %d requests NOT published: %s", events, len(expired), failure)
            metrics.PUBLISH_FAILURES.inc(events)
            for confirmation in expired:
                self._confirmed(confirmation, failure)
        return again

    def _confirmed(self, confirmation: _Confirmation, failure: PublishFailed | None = None) -> None:
        """``confirmation`` is done: its waiters resolved (failed with ``failure``)."""
        with contextlib.suppress(ValueError):
            self._confirming.remove(confirmation)
        _settle(confirmation.waiters, failure)
        if not confirmation.outcome.done():
            confirmation.outcome.set_result(failure)

    def _drop_expired(self, batch: list[LogEvent], waiters: list[_Waiter]) -> tuple[list[LogEvent], list[_Waiter]]:
        """``batch`` without the events of requests that have failed for ``retry_for_s``,
        and ``waiters`` without theirs, which fail (as does a waiter of every request)."""
        expired = {
            request_id
            for request_id, since in self._failing_since.items()
            if time.monotonic() - since >= self._retry_for_s
        }
        if not expired:
            return batch, waiters
        for request_id in expired:
            del self._failing_since[request_id]
        dropped = [event for event in batch if event.request_id in expired]
        failure = PublishFailed(f"could not publish the events of {len(expired)} requests for {self._retry_for_s:.0f}s")
        logger.error("%d events of %d requests NOT published: %s", len(dropped), len(expired), failure)
        metrics.PUBLISH_FAILURES.inc(len(dropped))
        failed = [waiter for waiter in waiters if waiter.request_id is None or waiter.request_id in expired]
        _settle(failed, failure)
        return [event for event in batch if event.request_id not in expired], [w for w in waiters if w not in failed]

    async def _send(self, batch: list[LogEvent]) -> tuple[tuple[LogEvent, ...], BaseException | None]:
        """Log ``batch``, retrying a whole failed append until the deadline; returns the
        events a cluster's failing shards left unlogged (and why), for the next flush."""
        deadline = time.monotonic() + self._retry_for_s
        attempt = 0
        while True:
            attempt += 1
            metrics.ROUND_TRIPS["publish"].inc()
            try:
                appended = await self._log.append(batch)
            except Exception as exc:
                if not is_transient(exc):
                    raise PublishFailed(f"Redis refused {len(batch)} events: {exc}") from exc
                if time.monotonic() >= deadline:
                    raise PublishFailed(
                        f"could not publish {len(batch)} events for {self._retry_for_s:.0f}s: {exc}"
                    ) from exc
                logger.warning("publish of %d events failed (attempt %d), retrying: %s", len(batch), attempt, exc)
                await asyncio.sleep(min(self._retry_delay_s * attempt, 2.0))
                continue
            if appended.superseded or appended.out_of_step:
                self._refused(batch, appended)
            if appended.error is not None and not is_transient(appended.error):
                raise PublishFailed(f"Redis refused {len(appended.unsent)} events: {appended.error}")
            return appended.unsent, appended.error

    def _refused(self, batch: list[LogEvent], appended: Appended) -> None:
        """Record (and report) each attempt whose events ``appended`` says were refused."""
        refused = dict.fromkeys(appended.out_of_step, Refusal.OUT_OF_STEP)
        refused.update(dict.fromkeys(appended.superseded, Refusal.SUPERSEDED))
        attempts = {(event.request_id, event.attempt) for event in batch if event.request_id in refused}
        for request_id, attempt in attempts:
            refusal = refused[request_id]
            logger.warning("request %s: the log refused events of attempt %d: %s", request_id, attempt, refusal.value)
            if self._refusals.get((request_id, attempt)) is not Refusal.SUPERSEDED:
                self._refusals[request_id, attempt] = refusal
            if self._on_refused is not None:
                self._on_refused(request_id, attempt, refusal)


def append_delta(
    chunk: ChunkEvent,
    text: str,
    token_ids: Sequence[int],
    finish_reason: str | None,
    logprobs: list[TokenLogprob] | None = None,
) -> None:
    """Append the next DELTA of ``chunk``'s completion to it: its text and tokens after the
    chunk's, its ``logprobs`` (if any) after the chunk's, its finish reason the chunk's."""
    chunk.text += text
    chunk.token_ids += token_ids
    chunk.finish_reason = finish_reason
    if logprobs is not None:
        chunk.logprobs = [*chunk.logprobs, *logprobs] if chunk.logprobs else logprobs


@dataclass(eq=False)
class _Confirmation:
    """One request's ends handed to the end confirmer: its events of the buffer the flusher
    took (the terminal one last), its waiters, and the outcome (the failure, or ``None``)
    that waiters of every request also wait for."""

    request_id: str
    events: list[LogEvent]
    waiters: list[_Waiter]
    outcome: asyncio.Future[PublishFailed | None]
    since: float
    """When it was handed over (monotonic): it is retried for ``retry_for_s`` from then."""


@dataclass(frozen=True, eq=False)
class _Waiter:
    """A caller of ``flushed``: the request it waits for (``None``: every one), its future."""

    request_id: str | None
    future: asyncio.Future[None]


def _settle(waiters: list[_Waiter], failure: PublishFailed | None = None) -> None:
    """Resolve ``waiters`` (fail them with ``failure``, if given)."""
    for waiter in waiters:
        if waiter.future.done():
            continue
        if failure is None:
            waiter.future.set_result(None)
        else:
            waiter.future.set_exception(failure)


def _encoded(taken: list[LogEvent | ChunkEvent]) -> tuple[list[LogEvent], int, int]:
    """The batch to send for the buffer ``taken``, with its count of chunks and tokens."""
    batch: list[LogEvent] = []
    chunks = tokens = 0
    for item in taken:
        if isinstance(item, ChunkEvent):
            batch.append(LogEvent(item.request_id, item.seq, item.attempt, encode_event(item)))
            chunks += 1
            tokens += len(item.token_ids)
        else:
            batch.append(item)
    return batch, chunks, tokens
