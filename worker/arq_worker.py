"""``StreamqWorker``: arq's worker, taking jobs the moment they are enqueued.

Producers publish on ``WAKEUP_CHANNEL`` after each enqueue, so this worker polls at once
instead of every ``poll_delay``, and one Lua script per poll claims up to the free slots'
worth of jobs, with their payloads, in one round trip. ``max_jobs`` follows the engine's
batch, plus the requests that wait inside the engine for a slot to free
(``--engine-queue``). A claimed job runs as arq's ``run_job`` would run it, with arq's
results and retries (``worker/job_runner.py``), and the ends of the jobs of one pass of the
loop are acknowledged in one round trip (``worker/acknowledger.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import time
from dataclasses import dataclass

from arq.constants import retry_key_prefix
from arq.utils import timestamp_ms
from arq.worker import Worker
from redis.asyncio.client import PubSub
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import OutOfMemoryError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError
from vllm.envs import enable_envs_cache
from vllm.utils.gc_utils import freeze_gc_heap

from streamq.broker.job_result import failure_of
from streamq.broker.memory_policy import eviction_cause
from streamq.broker.pubsub import live_messages
from streamq.protocol import (
    IN_PROGRESS_PREFIX,
    WAKEUP_CHANNEL,
    ErrorCode,
    ErrorEvent,
    is_valid_request_id,
)
from streamq.protocol.names import AFFINITY_FREE_TTL_MS, AFFINITY_WORKER_TTL_MS
from streamq.protocol.script_calls import ClaimedJob, ClaimJobs, ReleaseAffinity
from streamq.protocol.scripts import Script
from streamq.tasks import stop_task
from worker import metrics
from worker.acknowledger import Acknowledger
from worker.config import WorkerConfig
from worker.engine import default_engine_queue, max_batch_size
from worker.job_runner import JobLimits, JobRunner
from worker.settings import arq_settings
from worker.state import WorkerState, state_of

logger = logging.getLogger("streamq.worker")


def redis_reply(exc: ResponseError) -> str:
    """Redis's error reply as it sent it (redis-py drops the first word of the ones it has a
    class for, such as ``OOM``), without the script's name and line."""
    reply = str(exc).split(" script: ", 1)[0]
    return f"OOM {reply}" if isinstance(exc, OutOfMemoryError) else reply


def slots_freed_by_ended(batch: int, jobs: int, ended: int) -> int:
    """How many of a worker's ``jobs`` whose request already ended (``ended``, their arq
    bookkeeping still running) free an engine slot that enqueue's routing may count: a
    conversation's next turn arrives as soon as its client has the final event, before
    the job's slot is free for claims. Only as far as the engine's ``batch`` has room
    beside the requests still running: with jobs waiting in the engine's queue, an ended
    request's slot is theirs, and a follow-up held here would wait behind them."""
    return min(ended, max(0, batch - (jobs - ended)))


@dataclass(frozen=True)
class RedisRefusal:
    """Redis's reply to the loop's last write, and since when it has refused them."""

    reply: str
    since: float


class StreamqWorker(Worker):
    """An arq ``Worker`` with wake-up driven, one-round-trip job pickup, engine-sized
    ``max_jobs``, and per-job work shared by the jobs of one pass of its loop.

    arq's own poll walks every queued id (running jobs stay queued until they finish)
    with several round trips each, and its ``run_job`` pays two more per job, on the
    event loop that also runs vLLM's output handler.
    """

    def __init__(self, config: WorkerConfig, **kwargs: object) -> None:
        """arq's settings come from ``config`` (``worker.settings.arq_settings``); ``kwargs``
        are ``arq.Worker``'s others (``handle_signals``, ``burst``, ...)."""
        super().__init__(**arq_settings(config), **kwargs)  # type: ignore[arg-type]
        self.config = config
        self._max_jobs_from_engine = config.max_jobs is None
        self._seat = config.front_end
        """Set in one of several front ends of one engine: it claims only the engine
        slots its siblings leave free."""
        self._wake = asyncio.Event()
        self._batch = self.max_jobs
        """The requests the engine runs at once (``max_jobs`` less the engine's queue)."""
        self._runner: JobRunner | None = None
        self._acknowledger: Acknowledger | None = None
        self._more_may_wait = False
        self._affinity_released = False
        """This worker gave back what was held for it: it claims no more (a drain, a stop)."""
        self._refusal: RedisRefusal | None = None
        """Set while Redis refuses the loop's writes (full, loading, read-only): no claims."""
        self._stopping = False
        """arq asked the loop to end. It does so by cancelling the main task once, and on
        Python 3.11 a cancellation that lands as an ``asyncio.wait_for`` inside the loop
        completes is dropped (redis-py sends every command through one): the loop also
        ends when it sees this."""
        # /ready answers 503 from the moment the worker stops claiming (a drain, a stop).
        probes = metrics.probes_of(self.ctx)
        probes.claiming = lambda: self.allow_pick_jobs and not self._stopping
        probes.redis_refusal = lambda: None if self._refusal is None else self._refusal.reply

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
                except ResponseError as exc:
                    # A reply, not a lost connection: Redis full (OOM at its maxmemory), loading,
                    # a demoted primary. The loop lives: it claims nothing until a claim goes
                    # through, and its running requests go on (their events are retried).
                    self._refused(exc)
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

    def _refused(self, exc: ResponseError) -> None:
        """Redis refused a write of the loop: said once an episode, in the log, on
        ``/metrics`` and in ``/ready``."""
        if self._refusal is None:
            self._refusal = RedisRefusal(redis_reply(exc), time.monotonic())
            metrics.REDIS_REFUSING_WRITES.set(1)
            logger.warning(
                "Redis refuses the worker's writes (%s): it claims no job until they go through again; "
                "its %d running requests go on, their events retried",
                self._refusal.reply,
                len(self.tasks),
            )

    def _accepted(self) -> None:
        """A claim went through: Redis takes writes again."""
        if self._refusal is not None:
            logger.warning(
                "Redis takes the worker's writes again after %.1fs: claiming", time.monotonic() - self._refusal.since
            )
            self._refusal = None
            metrics.REDIS_REFUSING_WRITES.set(0)

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
        self._release = Script(self.pool, ReleaseAffinity)
        if self.on_startup:
            await self.on_startup(self.ctx)
        state = state_of(self.ctx)
        self._acknowledger = Acknowledger(
            self.pool, queue=self.queue_name, worker_id=state.worker_id, owners=state.replay_log.owners
        )
        self._acknowledger.start()
        self._runner = JobRunner(
            state,
            self.pool,
            queue=self.queue_name,
            limits=JobLimits(
                max_tries=self.max_tries,
                timeout_s=self.job_timeout_s,
                keep_result_s=None if self.keep_result_forever else self.keep_result_s,
                retry_jobs=self.retry_jobs,
            ),
            acknowledger=self._acknowledger,
            end_failed_request=self._end_failed_request,
        )
        # As vllm serve's front end once it is up: the start-up heap (the engine client,
        # the tokenizer, the parsers) is left out of the collector's passes, which would
        # otherwise stall the loop for milliseconds at a time; and as vLLM's engine
        # processes, its environment read once.
        freeze_gc_heap()
        enable_envs_cache()
        self._resize(state)  # its log line says the worker claims from now on
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
        if self._runner is not None:  # arq's tallies, for its health-check line
            counts = self._runner.counts
            self.jobs_complete, self.jobs_failed, self.jobs_retried = counts.complete, counts.failed, counts.retried
        await self.heart_beat()

    async def _claim_and_start(self, free: int, spare: int = 0) -> int:
        """Claim up to ``free`` due jobs in one round trip and start them; how many started.
        Beyond the engine's free slots, the rest of ``free`` is room in its queue, claimed
        only for jobs no other worker has room for (``claim_jobs.lua``, 4.). ``spare``: free
        slots beyond ``free`` that this claim does not take (a front end claims a share of
        the engine's), told to enqueue with those the claim leaves."""
        state = state_of(self.ctx)
        wanted = min(free, max(0, self._batch - self.job_counter))
        ttl_ms = state.leases.ttl_ms
        asked_at = timestamp_ms()
        metrics.ROUND_TRIPS["claim"].inc()
        ended = sum(1 for job_id in state.ended_jobs if job_id in self.tasks and not self.tasks[job_id].done())
        spare += slots_freed_by_ended(self._batch, self.job_counter, ended)
        claimed = ClaimJobs.reply(
            await self._claim(
                ClaimJobs(
                    queue=self.queue_name,
                    wanted=wanted,
                    lease_ms=ttl_ms,
                    page=self.queue_read_limit,
                    in_progress_prefix=IN_PROGRESS_PREFIX,
                    worker_id=state.worker_id,
                    affinity_worker_ttl_ms=AFFINITY_WORKER_TTL_MS,
                    free_ttl_ms=AFFINITY_FREE_TTL_MS,
                    running=self.job_counter,
                    spare=spare,
                    wakeup_channel=WAKEUP_CHANNEL,
                    ahead=free - wanted,
                )
            )
        )
        state.clock.observe(claimed.now_ms, asked_at, timestamp_ms())
        if claimed.hits or claimed.misses or claimed.expired:
            metrics.AFFINITY_HITS.inc(claimed.hits)
            metrics.AFFINITY_MISSES.inc(claimed.misses)
            metrics.AFFINITY_EXPIRED.inc(claimed.expired)
        self._accepted()
        started = 0
        for job in claimed.jobs:
            if job.cancelled:  # while an earlier attempt ran it: it ends `cancelled` at once
                state.cancels.recorded(job.job_id)
            if job.job_id in self.tasks:
                # Its lease lapsed while it runs here (Redis was away, or this loop
                # stalled): the claim just took it back for the running attempt, which
                # is no new try of the job.
                logger.warning("job %s: lease had lapsed; kept by its running attempt", job.job_id)
                await self.pool.incrby(retry_key_prefix + job.job_id, -1)
                continue
            await self._start(job)
            started += 1
        self._more_may_wait = len(claimed.jobs) >= wanted
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

    async def _start(self, job: ClaimedJob) -> None:
        """Run a claimed job in a task of its own, as arq's ``start_jobs`` would once it
        has claimed it."""
        assert self._runner is not None, "started up"
        await self.sem.acquire()  # never waits: there was a free slot
        self.job_counter += 1
        task = self.loop.create_task(self._runner.run(job, self._runner.ticket(job)), name=f"job {job.job_id}")
        task.add_done_callback(lambda done: self._job_done(job.job_id, done))
        self.tasks[job.job_id] = task

    def _job_done(self, job_id: str, task: asyncio.Task[None]) -> None:
        """A job's task ended: its slot is free."""
        if self.tasks.get(job_id) is task:
            del self.tasks[job_id]
        state_of(self.ctx).ended_jobs.discard(job_id)
        if not task.cancelled() and task.exception() is not None:
            # Its acknowledgement failed (Redis away at the end of the job): the job
            # stays queued, its lease lapses and it runs again.
            logger.error("job %s: could not acknowledge its end: %r", job_id, task.exception())
        self._release_sem_dec_counter_on_complete()

    def _resize(self, state: WorkerState) -> None:
        """Run as many jobs as the engine's batch (``--max-jobs``, else its ``max_num_seqs``)
        and hold up to ``--engine-queue`` more waiting inside the engine for a slot (by
        default a batch's worth, with ``--max-jobs`` none; a front end of several holds none:
        its siblings share the engine's slots)."""
        given = self.config.engine_queue
        batch = max_batch_size(state.engine) if self._max_jobs_from_engine else self.max_jobs
        if self._seat is not None:
            ahead = 0
        elif given is not None:
            ahead = given
        else:
            ahead = default_engine_queue(batch) if self._max_jobs_from_engine else 0
        self._batch = batch
        self.max_jobs = batch + ahead
        self.sem = asyncio.BoundedSemaphore(self.max_jobs + 1)
        self.queue_read_limit = max(self.max_jobs * 5, 100)
        logger.info("runs %d requests at once, and holds up to %d more waiting in its engine", batch, ahead)

    async def _listen(self, wakeups: PubSub) -> None:
        while True:
            try:
                async for message in live_messages(wakeups):
                    if message["type"] == "message" and message["data"] in (self.queue_name, self.queue_name.encode()):
                        self._wake.set()
            except Exception as exc:  # a dropped connection: fall back to polling for a while
                logger.warning("wake-up channel lost (%s); polling every %.2fs", exc, self.poll_delay_s)
                await asyncio.sleep(1)

    async def _end_failed_request(self, job_id: str, result_data: bytes | None, attempt: int | None = None) -> None:
        """Publish an error event for a job that failed, unless its request already
        ended or, for an ``attempt``, a newer attempt owns it."""
        code, message = failure_of(result_data)
        if code is None or not is_valid_request_id(job_id):
            return
        if code == ErrorCode.EXPIRED and (cause := await eviction_cause(self.pool)) is not None:
            message = f"{message}; {cause}"
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
        if self._acknowledger is not None:  # every job has ended: their ends are sent
            await self._acknowledger.close()
        await self.pool.delete(self.health_check_key)
        if self.on_shutdown:
            await self.on_shutdown(self.ctx)
        await self.pool.aclose(close_connection_pool=True)
        self._pool = None
