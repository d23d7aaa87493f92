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
end confirmer (``worker/end_confirmer.py``); the other requests' events never wait for it.
With nothing to wait for, every event goes the one way.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import os
import time
from collections.abc import Callable, Mapping, Sequence

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
from streamq.env_vars import COALESCE_ENV
from streamq.environment import flag_from_env
from streamq.protocol import ChunkEvent, TokenLogprob, encode_event
from streamq.tasks import stop_task
from worker import metrics
from worker.end_confirmer import EndConfirmer, Waiter, settle
from worker.end_confirmer import PublishFailed as PublishFailed  # raised to its callers, and named by them here
from worker.failure_log import RepeatedFailure
from worker.retry_budget import RetryBudgets

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
    """``$STREAMQ_COALESCE``: on unless it says off (``0``, ``false``, ``no``, ``off``)."""
    return flag_from_env(COALESCE_ENV, environ, default=True)


class Refusal(enum.Enum):
    """Why the log refused an attempt's events (``append_and_publish``)."""

    SUPERSEDED = "superseded"
    """Another attempt owns the request, or it ended: this attempt stops, writing nothing more."""
    OUT_OF_STEP = "out of step"
    """The log lost events this attempt had written (a Redis that lost acknowledged writes):
    this attempt hands its job back, and the next one goes on from what the log holds."""


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

    Events that do not reach Redis (Redis away or refusing for a moment; on a Redis Cluster,
    a shard away while the others take theirs) go back to the front of the buffer and are
    sent again with the next batch, while the other requests' events go on; a request whose
    events have failed for ``retry_for_s`` (``worker/retry_budget.py``) has them dropped, and
    its waiters fail. Ends that wait for replicas go through the end confirmer
    (``worker/end_confirmer.py``), within the same budgets.
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
        self._pending_waiters: list[Waiter] = []
        self._sending_waiters: list[Waiter] = []
        """Waiters of the batch in flight: resolved when it is done, as the pending ones are
        when the batch that takes them is."""
        self._has_pending = asyncio.Event()
        self._budgets = RetryBudgets(retry_for_s)
        self._retry_delay_s = retry_delay_s
        self._failures = 0
        """Flushes in a row that left events unsent: the pause before the next grows with it."""
        self._send_failures = RepeatedFailure(logger, "logging events")
        self._task: asyncio.Task[None] | None = None
        self._confirmer = EndConfirmer(
            log,
            budgets=self._budgets,
            retry_delay_s=retry_delay_s,
            on_refused=self._refused,
            is_transient=is_transient,
        )

    def start(self) -> None:
        """Start the flusher task (and, where ends may wait, the end confirmer) on the running loop."""
        self._task = asyncio.get_running_loop().create_task(self._flush_forever(), name="event-publisher")
        if self._log.durability is not None:
            self._confirmer.start()

    async def close(self) -> None:
        """Flush what is buffered (failures are logged by the flusher), then stop it."""
        if self._pending or self._confirmer.busy:
            with contextlib.suppress(PublishFailed):
                await self.flushed()
        await stop_task(self._task)
        await self._confirmer.close()
        self._task = None

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
            self._pending_waiters.append(Waiter(request_id, waiter))
        elif self._in_flight:
            self._sending_waiters.append(Waiter(request_id, waiter))
        else:
            self._settle_after_ends([Waiter(request_id, waiter)])
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
            batch = _encoded(taken, deltas)
            if self._confirmer.waits:
                batch, waiters = self._confirmer.hand_over(batch, waiters)
            if not batch:  # ends only: the confirmer has them
                self._settle_after_ends(waiters)
                continue
            if await self._flush(batch, waiters):
                await asyncio.sleep(min(self._retry_delay_s * self._failures, 2.0))

    async def _flush(self, batch: list[LogEvent], waiters: list[Waiter]) -> bool:
        """Send ``batch`` once and settle its waiters; True when events were left to send again."""
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
            settle(self._sending_waiters, failure)
            return False
        finally:
            self._in_flight = False
        waiters = self._sending_waiters
        metrics.PUBLISH_SECONDS.observe(time.perf_counter() - started)
        metrics.PUBLISH_BATCH_EVENTS.observe(len(batch) - len(unsent))
        failing = {event.request_id for event in unsent}
        self._budgets.reached({event.request_id for event in batch} - failing)
        if not unsent:
            self._failures = 0
            self._send_failures.passed()
            self._settle_after_ends(waiters)
            return False
        self._failures += 1
        spent = self._budgets.failed(failing)
        if spent:
            dropped = [event for event in unsent if event.request_id in spent]
            failure = PublishFailed(
                f"could not publish the events of {len(spent)} requests for {self._budgets.retry_for_s:.0f}s: {error}"
            )
            logger.error("%d events of %d requests NOT published: %s", len(dropped), len(spent), failure)
            metrics.PUBLISH_FAILURES.inc(len(dropped))
            failed = [waiter for waiter in waiters if waiter.request_id is None or waiter.request_id in spent]
            settle(failed, failure)
            waiters = [waiter for waiter in waiters if waiter not in failed]
            unsent = tuple(event for event in unsent if event.request_id not in spent)
            failing -= spent
        if unsent:
            self._send_failures.failed(
                "%d events of %d requests not logged, sent again: %s", len(unsent), len(failing), error
            )
            self._pending[:0] = unsent  # ahead of anything published since: each request's order holds
            self._has_pending.set()
        carried = [waiter for waiter in waiters if waiter.request_id is None or waiter.request_id in failing]
        self._settle_after_ends([waiter for waiter in waiters if waiter not in carried])
        self._pending_waiters[:0] = carried
        return True

    def _settle_after_ends(self, waiters: list[Waiter]) -> None:
        """Resolve ``waiters`` whose events reached Redis, each once the ends it also waits
        for are confirmed (a waiter of every request: every end handed to the confirmer so
        far; of one: its own), failing it if one of them failed."""
        for waiter in waiters:
            ends = self._confirmer.outcomes(waiter.request_id)
            if not ends:
                settle([waiter])
                continue

            def done(
                _: object, waiter: Waiter = waiter, ends: list[asyncio.Future[PublishFailed | None]] = ends
            ) -> None:
                if all(end.done() for end in ends):
                    settle([waiter], next((end.result() for end in ends if end.result() is not None), None))

            for end in ends:
                end.add_done_callback(done)

    async def _send(self, batch: list[LogEvent]) -> tuple[tuple[LogEvent, ...], BaseException | None]:
        """Log ``batch`` once: the events that did not reach Redis (all of them, or on a
        cluster those of the failing shards) and why, to send again; raises
        ``PublishFailed`` for a refusal that will not pass."""
        metrics.ROUND_TRIPS["publish"].inc()
        try:
            appended = await self._log.append(batch)
        except Exception as exc:
            if not is_transient(exc):
                raise PublishFailed(f"Redis refused {len(batch)} events: {exc}") from exc
            return tuple(batch), exc
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


def _encoded(taken: list[LogEvent | ChunkEvent], deltas: int) -> list[LogEvent]:
    """The batch to send for the buffer ``taken`` (of ``deltas`` engine DELTAs), counted as
    handed to Redis: its DELTAs, chunks and tokens."""
    batch: list[LogEvent] = []
    chunks = tokens = 0
    for item in taken:
        if isinstance(item, ChunkEvent):
            batch.append(LogEvent(item.request_id, item.seq, item.attempt, encode_event(item)))
            chunks += 1
            tokens += len(item.token_ids)
        else:
            batch.append(item)
    metrics.DELTAS.inc(deltas)
    metrics.CHUNKS.inc(chunks)
    metrics.GENERATED_TOKENS.inc(tokens)
    return batch
