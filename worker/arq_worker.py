"""``StreamqWorker``: arq's worker, taking jobs the moment they are enqueued.

Producers publish on ``WAKEUP_CHANNEL`` after each enqueue, so this worker polls at once
instead of every ``poll_delay``, and one Lua script per poll claims up to the free slots'
worth of jobs in one round trip. ``max_jobs`` follows the engine's batch; jobs run through
arq's own ``run_job``, so results, retries and aborts are arq's.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal

from arq.utils import timestamp_ms
from arq.worker import Worker
from redis.asyncio.client import PubSub
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from streamq.broker.job_result import failure_of
from streamq.broker.pubsub import live_messages
from streamq.protocol import (
    IN_PROGRESS_PREFIX,
    WAKEUP_CHANNEL,
    ErrorEvent,
    is_valid_request_id,
)
from streamq.protocol.names import AFFINITY_FREE_TTL_MS, AFFINITY_OWNER_TTL_MS
from streamq.protocol.script_calls import ClaimJobs, FinishJob, ReleaseAffinity
from streamq.protocol.scripts import Script
from streamq.tasks import stop_task
from worker import metrics
from worker.engine import max_batch_size
from worker.lease import lease_holder
from worker.options import FrontEndSeat
from worker.state import state_of

logger = logging.getLogger("streamq.worker")


class StreamqWorker(Worker):
    """An arq ``Worker`` with wake-up driven, one-round-trip job pickup and
    engine-sized ``max_jobs``.

    arq's own poll walks every queued id (running jobs stay queued until they finish)
    with several round trips each, on the event loop that also runs vLLM's output
    handler; more jobs than the engine schedules at once would only wait here.
    """

    def __init__(
        self, *args: object, max_jobs_from_engine: bool = True, seat: FrontEndSeat | None = None, **kwargs: object
    ) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self._max_jobs_from_engine = max_jobs_from_engine
        self._seat = seat
        """Set in one of several front ends of one engine: it claims only the engine
        slots its siblings leave free."""
        self._wake = asyncio.Event()
        self._more_may_wait = False
        self._affinity_released = False
        """This worker gave back what was held for it: it claims no more (a drain, a stop)."""
        self._stopping = False
        """arq asked the loop to end. It does so by cancelling the main task once, and on
        Python 3.11 a cancellation that lands as an ``asyncio.wait_for`` inside the loop
        completes is dropped (redis-py sends every command through one): the loop also
        ends when it sees this."""
        # /ready answers 503 from the moment the worker stops claiming (a drain, a stop).
        metrics.probes_of(self.ctx).claiming = lambda: self.allow_pick_jobs and not self._stopping

    async def main(self) -> None:
        """arq's ``Worker.main`` with the fixed-interval poll replaced by wake-ups."""
        await self.start_up()
        wakeups = self.pool.pubsub()
        await wakeups.subscribe(WAKEUP_CHANNEL)
        listener = asyncio.create_task(self._listen(wakeups), name="wakeup-listener")
        try:
            while not self._stopping:
                self._wake.clear()
                try:
                    await self.poll()
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
            await self._release_affinity()

    async def _release_affinity(self) -> None:
        """Stop attracting jobs by prefix and give back those held for this worker, so a
        stopping worker delays nobody by a window (``release_affinity.lua``). Once: when
        it stops claiming (arq's graceful stop drains first), or when its loop ends."""
        if self._affinity_released:
            return
        self._affinity_released = True
        try:
            call = ReleaseAffinity(
                queue=self.queue_name, worker_id=state_of(self.ctx).worker_id, wakeup_channel=WAKEUP_CHANNEL
            )
            released = await self._release(call)
        except Exception as exc:  # Redis away: the windows lapse on their own
            logger.warning("could not give back the jobs held for this worker: %s", exc)
            return
        if released:
            logger.info("gave back %d job(s) held for this worker by prefix", released)

    def handle_sig(self, signum: signal.Signals) -> None:
        """arq's immediate shutdown (cancel the jobs and the loop), the loop told too."""
        super().handle_sig(signum)
        self._stop_loop()

    async def _wait_for_tasks_to_complete(self, signum: signal.Signals) -> None:
        """arq's graceful shutdown (drain the jobs, then cancel the loop), the loop told too."""
        await super()._wait_for_tasks_to_complete(signum)
        self._stop_loop()

    def _stop_loop(self) -> None:
        self._stopping = True
        self._wake.set()

    async def start_up(self) -> None:
        """Connect, start the engine and the parts beside it (``on_startup``), and size
        ``max_jobs`` to the engine: everything before the first poll."""
        if self._pool is None:
            from streamq.broker.connection import create_pool

            self._pool = await create_pool(
                self.redis_settings,
                job_deserializer=self.job_deserializer,
                job_serializer=self.job_serializer,
                default_queue_name=self.queue_name,
                expires_extra_ms=self.expires_extra_ms,
            )
        logger.info("worker listening on queue %s", self.queue_name)
        self.ctx["redis"] = self.pool
        self._claim = Script(self.pool, ClaimJobs)
        self._finish_script = Script(self.pool, FinishJob)
        self._release = Script(self.pool, ReleaseAffinity)
        if self.on_startup:
            await self.on_startup(self.ctx)
        if self._max_jobs_from_engine:
            self._resize(max_batch_size(state_of(self.ctx).engine))
        if self._seat is not None:
            self._seat.ready.set()

    async def poll(self) -> None:
        """One round of the loop: claim due jobs for the free slots in one round trip and
        start them; then arq's housekeeping (aborts, finished tasks, health check)."""
        free = self.max_jobs - self.job_counter
        if self.allow_pick_jobs and free > 0:
            if self._seat is None:
                await self._claim_and_start(free)
            else:
                await self._claim_and_start_in_shared_slots(free)
        elif not self.allow_pick_jobs:  # draining to stop
            await self._release_affinity()
        if self.allow_abort_jobs:
            await self._cancel_aborted_jobs()
        ended_jobs = state_of(self.ctx).ended_jobs
        for job_id, task in list(self.tasks.items()):
            if task.done():
                del self.tasks[job_id]
                ended_jobs.discard(job_id)
                if not task.cancelled() and task.exception() is not None:
                    # arq's own bookkeeping failed (Redis away at the end of the job):
                    # the job stays queued, its lease lapses and it runs again.
                    logger.error("job %s: arq could not finish it: %r", job_id, task.exception())
        await self.heart_beat()

    async def _claim_and_start(self, free: int, spare: int = 0) -> int:
        """Claim up to ``free`` due jobs in one round trip and start them; how many started.
        ``spare``: free slots beyond ``free`` that this claim does not take (a front end
        claims a share of the engine's), told to enqueue with those the claim leaves."""
        state = state_of(self.ctx)
        ttl_ms = state.leases.ttl_ms
        asked_at = timestamp_ms()
        # Slots whose request already ended count as free for enqueue's routing (only).
        spare += sum(1 for job_id in state.ended_jobs if job_id in self.tasks and not self.tasks[job_id].done())
        redis_now, hits, misses, expired, *reply = await self._claim(
            ClaimJobs(
                queue=self.queue_name,
                wanted=free,
                lease_ms=ttl_ms,
                page=self.queue_read_limit,
                in_progress_prefix=IN_PROGRESS_PREFIX,
                worker_id=state.worker_id,
                owner_ttl_ms=AFFINITY_OWNER_TTL_MS,
                free_ttl_ms=AFFINITY_FREE_TTL_MS,
                running=self.job_counter,
                spare=spare,
                wakeup_channel=WAKEUP_CHANNEL,
            )
        )
        state.clock.observe(int(redis_now), asked_at, timestamp_ms())
        if hits or misses or expired:
            metrics.AFFINITY_HITS.inc(hits)
            metrics.AFFINITY_MISSES.inc(misses)
            metrics.AFFINITY_EXPIRED.inc(expired)
        started = 0
        for job_id, score, cancelled in zip(reply[::3], reply[1::3], reply[2::3], strict=True):
            job_id = job_id.decode()
            if cancelled:  # while an earlier attempt ran it: it ends `cancelled` at once
                state.cancels.recorded(job_id)
            if job_id in self.tasks:
                # Its lease lapsed while it runs here (Redis was away, or this loop
                # stalled): the claim just took it back for the running attempt.
                logger.warning("job %s: lease had lapsed; kept by its running attempt", job_id)
                continue
            await self._start(job_id, int(float(score)))
            started += 1
        self._more_may_wait = len(reply) // 3 == free
        return started

    async def _claim_and_start_in_shared_slots(self, room: int) -> None:
        """As ``_claim_and_start``, for one of several front ends of one engine: claim only
        as many jobs as the engine has slots its siblings left free."""
        assert self._seat is not None
        slots, index = self._seat.slots, self._seat.index
        batch = min(room, slots.fair_batch(index))
        taken = slots.take(index, batch)
        started = 0
        try:
            if taken:
                started = await self._claim_and_start(taken, spare=min(room - taken, slots.free()))
        finally:
            slots.give(index, taken - started)  # the claim found fewer, or failed
        if taken < batch:
            self._more_may_wait = False  # every slot is held: the front end that frees one claims next
        elif started == batch < room:
            self._wake.set()  # held back to let the siblings catch up: claim again at once

    async def _start(self, job_id: str, score: int) -> None:
        """Run a claimed job as arq's ``start_jobs`` would once it has claimed it."""
        await self.sem.acquire()  # never waits: there was a free slot
        self.job_counter += 1
        task = self.loop.create_task(self.run_job(job_id, score))
        task.add_done_callback(lambda _: self._release_sem_dec_counter_on_complete())
        self.tasks[job_id] = task

    def _resize(self, max_jobs: int) -> None:
        self.max_jobs = max_jobs
        self.sem = asyncio.BoundedSemaphore(max_jobs + 1)
        self.queue_read_limit = max(max_jobs * 5, 100)
        logger.info("max_jobs set to the engine's max_num_seqs: %d", max_jobs)

    async def _listen(self, wakeups: PubSub) -> None:
        while True:
            try:
                async for message in live_messages(wakeups):
                    if message["type"] == "message" and message["data"] in (self.queue_name, self.queue_name.encode()):
                        self._wake.set()
            except Exception as exc:  # a dropped connection: fall back to polling for a while
                logger.warning("wake-up channel lost (%s); polling every %.2fs", exc, self.poll_delay_s)
                await asyncio.sleep(1)

    async def finish_job(
        self,
        job_id: str,
        finish: bool,
        result_data: bytes | None,
        result_timeout_s: float | None,
        keep_result_forever: bool,
        incr_score: int | None,
        keep_in_progress: float | None,
    ) -> None:
        """arq's bookkeeping at the end of an attempt, in one script fenced by the
        request's owner key (``finish_job.lua``): an attempt that a newer one superseded
        releases its lease and leaves the job, its result and its end to the owner. A
        failed job's request first gets its terminal event, if it has none."""
        state = state_of(self.ctx)
        attempt = state.attempts.pop(job_id, 0)
        if job_id in state.superseded_jobs:
            state.superseded_jobs.discard(job_id)
            logger.info("job %s: superseded; its keys are the owning attempt's", job_id)
            await self._finish(job_id, attempt, "release")
            return
        if finish:
            await self._end_failed_request(job_id, result_data, attempt)
        expiry_s = None if keep_result_forever else result_timeout_s
        action = "finish" if finish else "retry"
        if not await self._finish(job_id, attempt, action, result_data, expiry_s, incr_score):
            logger.info("job %s: attempt %d was superseded; its keys are the owning attempt's", job_id, attempt)

    async def finish_failed_job(self, job_id: str, result_data: bytes | None) -> None:
        """arq gave up on a job without running it (tries exhausted, payload expired or
        undecodable): end its request with an error event, then arq's bookkeeping (a
        result already stored, by the attempt that ended the request, is kept)."""
        await self._end_failed_request(job_id, result_data)
        expiry_s = None if self.keep_result_forever else self.keep_result_s
        await self._finish(job_id, 0, "failed", result_data, expiry_s)

    async def _finish(
        self,
        job_id: str,
        attempt: int,
        action: str,
        result_data: bytes | None = None,
        expiry_s: float | None = None,
        incr_score: int | None = None,
    ) -> bool:
        """Run ``finish_job.lua``; False when a newer attempt owns the request."""
        state = state_of(self.ctx)
        owners = state.replay_log.owners
        owner = (await owners.values([job_id]))[0] if owners.ahead else None
        call = FinishJob.of_job(
            job_id,
            self.queue_name,
            owner_key=None if owners.ahead else owners.names.owner(job_id),
            worker_id=state.worker_id,
            holder=lease_holder(state.worker_id, attempt),
            attempt=attempt,
            action=action,
            result=result_data or b"",
            result_ttl_ms=0 if expiry_s is None else round(expiry_s * 1000),
            score_increment=incr_score or "",
            owner=owner,
        )
        return bool(await self._finish_script(call))

    async def _end_failed_request(self, job_id: str, result_data: bytes | None, attempt: int | None = None) -> None:
        """Publish an error event for a job that failed, unless its request already
        ended (it usually has: the job function reports its own failures) or, for an
        ``attempt``, a newer attempt owns it."""
        code, message = failure_of(result_data)
        if code is None or not is_valid_request_id(job_id):
            return
        state = state_of(self.ctx)
        event = ErrorEvent(request_id=job_id, seq=0, code=code, message=message)
        try:
            seq = await state.replay_log.end(job_id, event, attempt=attempt or None)
        except Exception as exc:  # Redis away: the job stays queued and runs again later
            logger.error("request %s: could not publish its error event (%s): %s", job_id, code, exc)
            return
        if seq is not None:
            metrics.REQUEST_ERRORS.labels(code=code).inc()
            logger.warning("request %s failed (%s): %s", job_id, code, message)
            if state.replay_log.names.sharded and state.callbacks is not None:
                # on one Redis end_request made it due; on a cluster it is the control plane's
                try:
                    await state.callbacks.schedule(job_id, None)
                except Exception as exc:
                    logger.error("request %s: cannot schedule its callback: %s", job_id, exc)

    def _release_sem_dec_counter_on_complete(self) -> None:
        super()._release_sem_dec_counter_on_complete()
        went_short = self._seat is not None and self._seat.slots.give(self._seat.index)
        if self._more_may_wait or went_short:
            self._wake.set()  # a slot is free and jobs may be waiting for one

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
        await self.pool.aclose(close_connection_pool=True)
        self._pool = None
