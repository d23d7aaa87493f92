"""Coalesced publishing of events to the replay log and pub/sub.

One awaited redis-py command costs about 100 µs of Python, while an engine emits
thousands of tokens per second across the requests of a worker. So jobs never
await Redis per token: they append encoded events to a buffer and a single
flusher task sends everything buffered in one command (``ReplayLog.append``).
While that round trip is in flight, new events accumulate and go out together in
the next one, so the batch grows with the load and the first token of an idle
worker goes out at once. One flusher keeps each request's events in order, and
since the log skips sequence numbers it already holds, a retried batch is safe.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from producer.replay import ReplayLog
from producer.tasks import stop_task
from worker import metrics

logger = logging.getLogger("streamq.worker")


class PublishFailed(RuntimeError):
    """Redis stayed unreachable for longer than the publisher's retry budget."""


class EventPublisher:
    """Buffers ``(request_id, seq, attempt, payload)`` events and flushes them in batches.

    ``on_superseded`` is called with each request whose events the log refused
    because a newer attempt (on another worker) owns it: that attempt's job should stop.
    """

    def __init__(
        self,
        log: ReplayLog,
        *,
        on_superseded: Callable[[str], None] | None = None,
        retry_attempts: int = 12,
        retry_delay_s: float = 0.2,
    ) -> None:
        self._log = log
        self._on_superseded = on_superseded
        self._pending: list[tuple[str, int, int, bytes]] = []
        self._pending_waiters: list[asyncio.Future[None]] = []
        self._has_pending = asyncio.Event()
        self._retry_attempts = retry_attempts
        self._retry_delay_s = retry_delay_s
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Start the flusher task on the running loop."""
        self._task = asyncio.get_running_loop().create_task(self._flush_forever(), name="event-publisher")

    async def close(self) -> None:
        """Flush what is buffered, then stop the flusher."""
        if self._pending:
            await self.flushed()
        await stop_task(self._task)
        self._task = None

    def publish(self, request_id: str, seq: int, attempt: int, payload: bytes) -> None:
        """Queue event ``seq`` of ``request_id``'s ``attempt``; returns at once (no I/O)."""
        self._pending.append((request_id, seq, attempt, payload))
        self._has_pending.set()

    def flushed(self) -> asyncio.Future[None]:
        """A future that resolves once everything published so far has reached Redis."""
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
            except PublishFailed as exc:
                for waiter in waiters:
                    if not waiter.done():
                        waiter.set_exception(exc)
                continue
            metrics.PUBLISH_SECONDS.observe(time.perf_counter() - started)
            metrics.PUBLISH_BATCH_EVENTS.observe(len(batch))
            for waiter in waiters:
                if not waiter.done():
                    waiter.set_result(None)

    async def _send(self, batch: list[tuple[str, int, int, bytes]]) -> None:
        for attempt in range(1, self._retry_attempts + 1):
            try:
                appended = await self._log.append(batch)
                if self._on_superseded is not None:
                    for request_id in appended.superseded:
                        self._on_superseded(request_id)
                return
            except (RedisConnectionError, RedisTimeoutError, OSError) as exc:
                logger.warning("publish of %d events failed (attempt %d): %s", len(batch), attempt, exc)
                await asyncio.sleep(min(self._retry_delay_s * attempt, 2.0))  # ~15 s in all
        raise PublishFailed(f"could not publish {len(batch)} events after {self._retry_attempts} attempts")
