"""A claimed job's run: arq's ``Worker.run_job`` without what streamq pays for per job and
does not need.

arq's ``run_job`` reads the job again (a ``MULTI`` of its payload and its try count), logs
two lines, runs the job function in a task of its own under ``wait_for`` (a second task)
and shields its bookkeeping in a third, whose ``finish_job`` is one more round trip. Here
the claim (``claim_jobs.lua``) has read the payload and counted the try already; the job
function runs in the job's own task under ``asyncio.timeout``; and its end joins those of
the same pass of the loop in one round trip (``worker/acknowledger.py``). Each outcome
keeps arq's meaning (docs/internals.md, "A job's run"):

- the payload is gone (the job expired): failed, ``job expired``;
- the payload is not a job the worker runs (``streamq.protocol.deserialize_job``: another
  function, a field of the wrong type): the job function reports it (``invalid_request``);
- the try count is past ``max_tries``: failed, ``max N retries exceeded``;
- ``arq.Retry``, or a cancellation (the worker stops): handed back, to run again;
- past ``job_timeout``: failed with ``TimeoutError``;
- any other exception: failed with it;
- an outcome: finished, its result stored; ``Superseded``: only its lease is released.

A failed job's request gets its error event before the job is acknowledged, unless the
job function sent it already (``RequestFailed``): nobody is left waiting.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from arq import Retry
from arq.constants import retry_key_prefix
from arq.jobs import serialize_result
from arq.utils import timestamp_ms
from arq.worker import JobExecutionFailed, RetryJob
from redis.asyncio import Redis

from streamq.protocol import deserialize_job, serialize_job
from streamq.protocol.script_calls import ClaimedJob
from worker.acknowledger import Acknowledgement, Acknowledger
from worker.admission import UNORDERED, AdmissionTicket, EngineAdmission
from worker.job import RequestFailed, run_request
from worker.job_context import JobContext, Superseded
from worker.state import WorkerState

logger = logging.getLogger("streamq.worker")

RETRY_KEY_TTL_S = 88400
"""How long arq keeps a job's try count (its ``run_job``'s constant)."""

EndFailedRequest = Callable[[str, bytes, "int | None"], Awaitable[None]]
"""Publishes the error event of a job that failed: its id, its result (arq's, with the
failure), the attempt (``None``: arq gave up on it before running it)."""


@dataclass(frozen=True)
class JobLimits:
    """arq's per-job settings that the runner keeps."""

    max_tries: int
    timeout_s: float | None
    keep_result_s: float | None
    """How long a result is kept; ``None``: forever, 0: not stored."""
    retry_jobs: bool = True


@dataclass
class JobCounts:
    """arq's tallies, which its health-check line reports."""

    complete: int = 0
    failed: int = 0
    retried: int = 0


class JobRunner:
    """Runs the jobs a worker's claim took.

    :param redis: the control plane (arq's keys).
    :param end_failed_request: publishes a failed job's error event.
    """

    def __init__(
        self,
        state: WorkerState,
        redis: Redis,
        *,
        queue: str,
        limits: JobLimits,
        acknowledger: Acknowledger,
        end_failed_request: EndFailedRequest,
    ) -> None:
        self._state = state
        self._redis = redis
        self._queue = queue
        self._limits = limits
        self._acknowledger = acknowledger
        self._end_failed_request = end_failed_request
        self.counts = JobCounts()
        self.admission = EngineAdmission()

    def ticket(self, claimed: ClaimedJob) -> AdmissionTicket:
        """The place of ``claimed`` on the way into the engine; take it as the job starts,
        in the order of the claim."""
        return self.admission.ticket(taken_over=claimed.tries > 1)

    async def run(self, claimed: ClaimedJob, admission: AdmissionTicket = UNORDERED) -> None:
        """Run ``claimed`` to its end and acknowledge it; raises only what the
        acknowledgement raised (the job then stays queued, its lease lapses, it runs again).
        ``admission``: its ticket (``ticket``), given up when the run ends, however it ends."""
        try:
            await self._run(claimed, admission)
        finally:
            admission.entered()

    async def _run(self, claimed: ClaimedJob, admission: AdmissionTicket) -> None:
        job_id, tries = claimed.job_id, claimed.tries
        if claimed.payload is None:
            logger.warning("job %s expired", job_id)
            return await self._give_up(_Job(job_id, "<unknown>", [], {}, 0), tries, JobExecutionFailed("job expired"))
        # Never raises: a payload that is not a valid job becomes one the job function reports.
        decoded = deserialize_job(claimed.payload)
        job = _Job(job_id, decoded["f"], decoded["a"], decoded["k"], decoded["et"])
        if (decoded.get("t") or 0) > tries:  # enqueued to start at a later try, as arq allows
            tries = decoded["t"]
            await self._redis.setex(retry_key_prefix + job_id, RETRY_KEY_TTL_S, str(tries))
        if tries > self._limits.max_tries:
            logger.warning("job %s: max retries %d exceeded", job_id, self._limits.max_tries)
            return await self._give_up(job, tries, JobExecutionFailed(f"max {self._limits.max_tries} retries exceeded"))
        started_ms = timestamp_ms()
        context = JobContext(job_id, tries, claimed.score, self._state, lease_set=True, admission=admission)
        try:
            async with asyncio.timeout(self._limits.timeout_s):
                outcome = await run_request(context, job.args, job.kwargs)
        except (Exception, asyncio.CancelledError) as exc:
            if self._limits.retry_jobs and isinstance(exc, (Retry, RetryJob, asyncio.CancelledError)):
                if not isinstance(exc, Retry):
                    logger.info("job %s cancelled, will be run again", job_id)
                self.counts.retried += 1
                increment = _score_increment(exc, claimed.score) if isinstance(exc, Retry) else ""
                return await self._acknowledge(Acknowledgement(job_id, tries, "retry", score_increment=increment))
            self.counts.failed += 1
            data = self._result(job, tries, exc, started_ms)
            if not isinstance(exc, RequestFailed):  # else the job function reported it, and logged it
                logger.error("job %s failed, %s: %s", job_id, type(exc).__name__, exc, exc_info=exc)
                await self._end_failed_request(job_id, data, tries)
            return await self._acknowledge(self._finished(job_id, tries, data))
        self.counts.complete += 1
        if isinstance(outcome, Superseded):
            return await self._acknowledge(Acknowledgement(job_id, tries, "release"))
        await self._acknowledge(self._finished(job_id, tries, self._result(job, tries, outcome, started_ms)))

    async def _give_up(self, job: _Job, tries: int, failure: BaseException) -> None:
        """A job arq gives up on without running it: its request's error event, then arq's
        bookkeeping (a result already stored, by the attempt that ended the request, is kept)."""
        self.counts.failed += 1
        data = self._result(job, tries, failure, timestamp_ms())
        await self._end_failed_request(job.job_id, data, None)
        await self._acknowledge(Acknowledgement(job.job_id, 0, "failed", *self._kept(data)))

    def _finished(self, job_id: str, tries: int, data: bytes) -> Acknowledgement:
        return Acknowledgement(job_id, tries, "finish", *self._kept(data))

    def _kept(self, data: bytes) -> tuple[bytes, int]:
        """The result to store and its TTL in ms (0: forever): none where results are not kept."""
        keep_s = self._limits.keep_result_s
        if keep_s == 0:
            return b"", 0
        return data, 0 if keep_s is None else round(keep_s * 1000)

    async def _acknowledge(self, end: Acknowledgement) -> None:
        # Shielded, as arq shields its bookkeeping: a stop that cancels the job's task
        # while its end is in flight must not leave the job half acknowledged.
        if not await asyncio.shield(self._acknowledger.acknowledge(end)):
            logger.info("job %s: attempt %d was superseded; its keys are the owning attempt's", end.job_id, end.attempt)

    def _result(self, job: _Job, tries: int, result: Any, started_ms: int) -> bytes:
        """arq's stored result of the job: its outcome, or the exception that failed it."""
        data = serialize_result(
            job.function,
            _stored_args(job.args),
            job.kwargs,
            tries,
            job.enqueued_ms,
            not isinstance(result, BaseException),
            result,
            started_ms,
            timestamp_ms(),
            f"{job.job_id}:{job.function}",
            self._queue,
            job_id=job.job_id,
            serializer=serialize_job,
        )
        assert data is not None, "serialize_job encodes any value (an exception as its type and message)"
        return data


def _stored_args(args: list[Any]) -> tuple[Any, ...]:
    """The job's arguments as its stored result keeps them: a pooling request's without its
    ``inputs`` (a corpus would be kept twice, for as long as results are: the events already
    hold what each input gave)."""
    if len(args) == 1 and isinstance(args[0], dict) and "inputs" in args[0]:
        return ({name: value for name, value in args[0].items() if name != "inputs"},)
    return tuple(args)


@dataclass(frozen=True)
class _Job:
    """The arq job a claim read."""

    job_id: str
    function: str
    args: list[Any]
    kwargs: dict[str, Any]
    enqueued_ms: int


def _score_increment(retry: Retry, score: int) -> int | str:
    """What arq adds to a retried job's score: its deferral, counted from its score; ``''``
    for one due at once."""
    if not retry.defer_score:
        return ""
    return retry.defer_score + (timestamp_ms() - score)
