"""Cancellation requests, heard by every worker, acted on by the one running the job.

Cancelling the task that iterates ``engine.generate()`` aborts the request inside vLLM and
frees its KV cache. A cancel may arrive just before the job registers, so requests are
remembered for a while. The same path stops an attempt that must not go on (``stop``):
another attempt owns its request, or the log lost what it wrote.

A message on the channel is lost while the listener reconnects, and a worker that takes a
request over later never heard it; so ``cancel.lua`` records the cancel too
(``streamq:cancelled:<id>``), and what finds the record acts as if it had heard the message
(``recorded``): the lease renewal (every second, for this worker's running requests), the
claim (for a request it claims) and the listener itself as it resubscribes (for its running
requests, at once).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager

from redis.asyncio import Redis

from streamq.broker.pubsub import live_messages
from streamq.broker.replies import as_text
from streamq.protocol import CANCEL_CHANNEL
from streamq.protocol.names import cancelled_key
from streamq.tasks import stop_task
from worker.publisher import Refusal

logger = logging.getLogger("streamq.worker")

REMEMBER_S = 60.0


class CancelListener:
    """Listens on ``CANCEL_CHANNEL`` and cancels the registered job of a request."""

    def __init__(self, redis: Redis) -> None:
        self._redis = redis
        self._running: dict[str, tuple[int, asyncio.Task[object]]] = {}
        """request id -> (attempt, task) of the attempt running here."""
        self._requested: dict[str, float] = {}
        self._stopped: dict[tuple[str, int], Refusal] = {}
        """(request id, attempt) -> why ``stop`` cancelled that attempt's task."""
        self._task: asyncio.Task[None] | None = None
        self._subscribed = asyncio.Event()

    async def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._listen(), name="cancel-listener")
        await self._subscribed.wait()

    async def close(self) -> None:
        await stop_task(self._task)

    def was_cancelled(self, request_id: str) -> bool:
        """True if a cancel for ``request_id`` has been heard (recently)."""
        return request_id in self._requested

    def take_stop(self, request_id: str, attempt: int) -> Refusal | None:
        """Why ``stop`` cancelled ``attempt`` at ``request_id``, if it did (once)."""
        return self._stopped.pop((request_id, attempt), None)

    def stop(self, request_id: str, attempt: int, reason: Refusal) -> None:
        """Stop this worker's ``attempt`` at ``request_id`` if it still generates (the job
        finds out why from ``take_stop``); an attempt whose generation is over learns it from
        its own events' delivery instead."""
        running = self._running.get(request_id)
        if running is None or running[0] != attempt:
            return
        key = (request_id, attempt)
        if key not in self._stopped:
            logger.warning("request %s: stopping attempt %d (%s)", request_id, attempt, reason.value)
            self._stopped[key] = reason
            running[1].cancel()

    @contextmanager
    def registered(self, request_id: str, attempt: int) -> Iterator[None]:
        """While inside, a cancel for ``request_id`` cancels the current task."""
        task = asyncio.current_task()
        assert task is not None
        self._running[request_id] = (attempt, task)
        try:
            if self.was_cancelled(request_id):
                task.cancel()
            yield
        finally:
            if self._running.get(request_id, (None, None))[1] is task:
                del self._running[request_id]

    def cancel_all(self) -> None:
        """Cancel every registered job without marking it as requested by a producer:
        each one is handed back to the queue (used when the engine died)."""
        for _, task in self._running.values():
            task.cancel()

    def recorded(self, request_id: str) -> None:
        """A cancel of ``request_id`` found recorded in Redis: acted on as one heard on the
        channel (its message may have been missed), unless it was heard already."""
        running = self._running.get(request_id)
        if request_id in self._requested and (running is None or running[1].cancelling()):
            return
        self._cancel(request_id, "cancel found recorded (its message was missed)")

    def _cancel(self, request_id: str, how: str = "cancel requested") -> None:
        now = time.monotonic()
        self._requested = {rid: t for rid, t in self._requested.items() if now - t < REMEMBER_S}
        self._requested[request_id] = now
        running = self._running.get(request_id)
        if running is not None and not running[1].cancelling():  # once: a second cancel outlives the first
            logger.info("request %s: %s", request_id, how)
            running[1].cancel()

    async def _check_records(self) -> None:
        """The cancel records of the requests running here: one whose message went out
        while this listener was away is found as it resubscribes."""
        ids = list(self._running)
        if ids:
            for request_id, record in zip(ids, await self._redis.mget([cancelled_key(i) for i in ids]), strict=True):
                if record is not None:
                    self.recorded(request_id)

    async def _listen(self) -> None:
        while True:
            pubsub = self._redis.pubsub()
            try:
                await pubsub.subscribe(CANCEL_CHANNEL)
                self._subscribed.set()
                await self._check_records()
                async for message in live_messages(pubsub):
                    if message["type"] == "message":
                        data = message["data"]
                        self._cancel(as_text(data))
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # Redis went away: resubscribe when it is back
                logger.warning("cancel channel lost (%s); resubscribing", exc)
                await asyncio.sleep(1)
            finally:
                await pubsub.aclose()
