"""``StreamqWorker``: arq's worker, starting jobs the moment they are enqueued.

arq finds new jobs by polling the queue every ``poll_delay``; each poll is a Redis
round trip, and the delay adds straight to time-to-first-token. Producers publish
on ``WAKEUP_CHANNEL`` after each enqueue, so this worker waits on that channel
(and on its own jobs finishing, which frees slots) and polls at once when woken.
The ``poll_delay`` timeout stays as a fallback for producers that do not publish.
It also sizes ``max_jobs`` to the engine's batch: more jobs than the engine
schedules at once would only wait inside this worker instead of on another one.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal

from arq.worker import Worker
from redis.asyncio.client import PubSub
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from producer.protocol import WAKEUP_CHANNEL
from producer.tasks import stop_task
from worker.engine import max_batch_size

logger = logging.getLogger("streamq.worker")


class StreamqWorker(Worker):
    """An arq ``Worker`` with wake-up driven job pickup and engine-sized ``max_jobs``."""

    def __init__(self, *args: object, max_jobs_from_engine: bool = True, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self._max_jobs_from_engine = max_jobs_from_engine
        self._wake = asyncio.Event()

    async def main(self) -> None:
        """arq's ``Worker.main`` with the fixed-interval poll replaced by wake-ups."""
        if self._pool is None:
            from arq.connections import create_pool

            self._pool = await create_pool(
                self.redis_settings,
                job_deserializer=self.job_deserializer,
                job_serializer=self.job_serializer,
                default_queue_name=self.queue_name,
                expires_extra_ms=self.expires_extra_ms,
            )
        logger.info("worker listening on queue %s", self.queue_name)
        self.ctx["redis"] = self.pool
        if self.on_startup:
            await self.on_startup(self.ctx)
        if self._max_jobs_from_engine and "engine" in self.ctx:
            self._resize(max_batch_size(self.ctx["engine"]))

        wakeups = self.pool.pubsub()
        await wakeups.subscribe(WAKEUP_CHANNEL)
        listener = asyncio.create_task(self._listen(wakeups), name="wakeup-listener")
        try:
            while True:
                self._wake.clear()
                try:
                    await self._poll_iteration()
                except (RedisConnectionError, RedisTimeoutError, OSError) as exc:
                    # Redis is restarting or failing over: wait for it instead of exiting
                    # (running jobs go on; their publisher and lease retry on their own).
                    logger.warning("cannot reach Redis (%s); retrying in 1s", exc)
                    await asyncio.sleep(1)
                    continue
                if self.burst and await self._burst_done():
                    return
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), self.poll_delay_s)
        finally:
            await stop_task(listener)
            await wakeups.aclose()

    def _resize(self, max_jobs: int) -> None:
        self.max_jobs = max_jobs
        self.sem = asyncio.BoundedSemaphore(max_jobs + 1)
        self.queue_read_limit = max(max_jobs * 5, 100)
        logger.info("max_jobs set to the engine's max_num_seqs: %d", max_jobs)

    async def _listen(self, wakeups: PubSub) -> None:
        while True:
            try:
                message = await wakeups.get_message(ignore_subscribe_messages=True, timeout=None)
            except Exception as exc:  # a dropped connection: fall back to polling for a while
                logger.warning("wake-up channel lost (%s); polling every %.2fs", exc, self.poll_delay_s)
                await asyncio.sleep(1)
                continue
            if message is not None and message["data"] in (self.queue_name, self.queue_name.encode()):
                self._wake.set()

    def _release_sem_dec_counter_on_complete(self) -> None:
        super()._release_sem_dec_counter_on_complete()
        self._wake.set()  # a slot is free: a job that did not fit may start now

    async def _burst_done(self) -> bool:
        if 0 <= self.max_burst_jobs <= self._jobs_started() or await self.pool.zcard(self.queue_name) == 0:
            await asyncio.gather(*self.tasks.values())
            return True
        return False

    async def close(self) -> None:
        """arq's ``close``, except that a job task cancelled during shutdown cannot
        make it skip ``on_shutdown``: the engine is always shut down."""
        if not self._handle_signals:
            self.handle_sig(signal.SIGUSR1)
        if not self._pool:
            return
        await asyncio.gather(*self.tasks.values(), return_exceptions=True)
        await self.pool.delete(self.health_check_key)
        if self.on_shutdown:
            await self.on_shutdown(self.ctx)
        await self.pool.close(close_connection_pool=True)
        self._pool = None
