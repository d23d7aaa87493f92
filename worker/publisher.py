"""Coalesced publishing of events to the replay log and pub/sub.

Jobs never await Redis per token (a command costs about 100 µs of Python): they buffer
encoded events and one flusher task sends all that is buffered in one command, so batches
grow with the load while an idle worker's first token goes out at once. One flusher keeps
each request's events in order; the log skips sequence numbers it holds, so retries are safe.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from streamq.broker.replay_log import LogEvent, ReplayLog
from streamq.tasks import stop_task
from worker import metrics

logger = logging.getLogger("streamq.worker")

TRANSIENT_REPLY_PREFIXES = ("READONLY", "MASTERDOWN", "BUSY", "LOADING", "TRYAGAIN", "OOM", "NOREPLICAS")
"""Redis error replies that pass on their own (a failover, a restart loading its data, a
slow script, memory freed by expiry): a batch that meets them is sent again."""
DEFAULT_RETRY_FOR_S = 60.0
"""How long a batch is retried through transient errors: longer than a Redis restart or
a Sentinel failover, shorter than a client's watchdog."""


class PublishFailed(RuntimeError):
    """Events could not be logged: Redis stayed unreachable for longer than the retry
    budget, or refused them for good (a permission, a wrong key type)."""


def is_transient(exc: BaseException) -> bool:
    """True for failures worth sending the same batch again for."""
    if isinstance(exc, (RedisConnectionError, RedisTimeoutError, OSError)):
        return True
    return isinstance(exc, ResponseError) and str(exc).startswith(TRANSIENT_REPLY_PREFIXES)


class EventPublisher:
    """Buffers events and flushes them in batches.

    ``on_superseded`` is called with each request whose events the log refused
    because another attempt owns it or it already ended: that attempt's job should stop.
    """

    def __init__(
        self,
        log: ReplayLog,
        *,
        on_superseded: Callable[[str], None] | None = None,
        retry_for_s: float = DEFAULT_RETRY_FOR_S,
        retry_delay_s: float = 0.2,
    ) -> None:
        self._log = log
        self._on_superseded = on_superseded
        self._pending: list[LogEvent] = []
        self._pending_waiters: list[asyncio.Future[None]] = []
        self._has_pending = asyncio.Event()
        self._retry_for_s = retry_for_s
        self._retry_delay_s = retry_delay_s
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Start the flusher task on the running loop."""
        self._task = asyncio.get_running_loop().create_task(self._flush_forever(), name="event-publisher")

    async def close(self) -> None:
        """Flush what is buffered (failures are logged by the flusher), then stop it."""
        if self._pending:
            with contextlib.suppress(PublishFailed):
                await self.flushed()
        await stop_task(self._task)
        self._task = None

    def publish(self, request_id: str, seq: int, attempt: int, payload: bytes, *, terminal: bool = False) -> None:
        """Queue event ``seq`` of ``request_id``'s ``attempt``; returns at once (no I/O)."""
        self._pending.append(LogEvent(request_id, seq, attempt, payload, terminal))
        self._has_pending.set()

    def flushed(self) -> asyncio.Future[None]:
        """A future that resolves once everything published so far has reached Redis,
        or fails with ``PublishFailed`` if it could not."""
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        if not self._pending:
            waiter.set_result(None)
        else:
            self._pending_waiters.append(waiter)
        return waiter

    async def _flush_forever(self) -> None:
        while True:
            await self._has_pending.wait()
            self._has_pending.clear()
            batch, self._pending = self._pending, []
            waiters, self._pending_waiters = self._pending_waiters, []
            started = time.perf_counter()
            try:
                await self._send(batch)
            except Exception as exc:  # the flusher must outlive any batch: fail it, loudly
                failure = exc if isinstance(exc, PublishFailed) else PublishFailed(f"{type(exc).__name__}: {exc}")
                requests = sorted({event.request_id for event in batch})
                logger.error("%d events of %d requests NOT published: %s", len(batch), len(requests), failure)
                metrics.PUBLISH_FAILURES.inc(len(batch))
                for waiter in waiters:
                    if not waiter.done():
                        waiter.set_exception(failure)
                continue
            metrics.PUBLISH_SECONDS.observe(time.perf_counter() - started)
            metrics.PUBLISH_BATCH_EVENTS.observe(len(batch))
            for waiter in waiters:
                if not waiter.done():
                    waiter.set_result(None)

    async def _send(self, batch: list[LogEvent]) -> None:
        deadline = time.monotonic() + self._retry_for_s
        attempt = 0
        while True:
            attempt += 1
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
            if self._on_superseded is not None:
                for request_id in appended.superseded:
                    self._on_superseded(request_id)
            return
