"""arq's bookkeeping at the end of each attempt, for every attempt that ends together in
one round trip.

An attempt ends with ``finish_job.lua`` (its result stored, its job off the queue, or the
job handed back; its lease released; fenced by the request's owner). A job that awaits it
alone pays a Redis round trip of its own, ~100-150 µs of the worker's one event loop; jobs
that end in the same pass of the loop (a wave of a batch ends in one engine step) share one
here: the first to end wakes the sender, every other that ends before the sender runs
joins its pipeline, and those that end while it is in flight join the next one. Each waits
for its own reply.
"""

from __future__ import annotations

import asyncio
import logging
from typing import NamedTuple

from redis.asyncio import Redis

from streamq.broker.data_plane import OwnerRead
from streamq.protocol.script_calls import FinishJob
from streamq.protocol.scripts import Script
from streamq.tasks import stop_task
from worker import metrics
from worker.lease import lease_holder

logger = logging.getLogger("streamq.worker")


class Acknowledgement(NamedTuple):
    """One attempt's end, as ``finish_job.lua`` takes it."""

    job_id: str
    attempt: int
    """0: unknown (a job arq gave up on before running it)."""
    action: str
    """``finish``, ``failed``, ``retry`` or ``release`` (the script's header says what each does)."""
    result: bytes = b""
    result_ttl_ms: int = 0
    """0: kept forever."""
    score_increment: int | str = ""


class Acknowledger:
    """Sends the attempts' ends of one pass of the loop in one pipeline.

    :param redis: the control plane (arq's keys).
    :param queue: the worker's queue.
    :param worker_id: this worker's id (a lease it claimed names it).
    :param owners: the request owner keys, read ahead where they live on another server.
    """

    def __init__(self, redis: Redis, *, queue: str, worker_id: str, owners: OwnerRead) -> None:
        self._queue = queue
        self._worker_id = worker_id
        self._owners = owners
        self._script = Script(redis, FinishJob)
        self._pending: list[tuple[Acknowledgement, asyncio.Future[bool]]] = []
        self._has_pending = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._send_forever(), name="acknowledger")

    async def close(self) -> None:
        """Stop sending; an end still waiting fails (its job stays queued and runs again)."""
        await stop_task(self._task)
        self._task = None
        for _, future in self._pending:
            if not future.done():
                future.set_exception(RuntimeError("the worker stopped before the job's end was acknowledged"))
        self._pending.clear()

    async def acknowledge(self, end: Acknowledgement) -> bool:
        """Send ``end`` with the others of this pass; True when the bookkeeping was done,
        False when a newer attempt owns the request (its keys are that attempt's). Raises
        what Redis raised (the job then stays queued, its lease lapses, and it runs again)."""
        if self._task is None:  # not started (a worker that is closing): alone
            (reply,) = await self._send([end])
            if isinstance(reply, BaseException):
                raise reply
            return bool(reply)
        future: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        self._pending.append((end, future))
        self._has_pending.set()
        return await future

    async def _send_forever(self) -> None:
        while True:
            await self._has_pending.wait()
            self._has_pending.clear()
            taken, self._pending = self._pending, []
            try:
                replies = await self._send([end for end, _ in taken])
            except Exception as exc:  # every end of the pipeline: their jobs run again
                replies = [exc] * len(taken)
            for (_, future), reply in zip(taken, replies, strict=True):
                if future.done():
                    continue
                if isinstance(reply, BaseException):
                    future.set_exception(reply)
                else:
                    future.set_result(bool(reply))

    async def _send(self, ends: list[Acknowledgement]) -> list[object]:
        """One pipeline of ``finish_job`` calls: each call's reply, or its error."""
        ahead = self._owners.ahead
        owners: list[str | None] = [None] * len(ends)
        if ahead:  # the owner keys are on the data plane's cluster: read them first, all at once
            owners = list(await self._owners.values([end.job_id for end in ends]))
        calls = [
            FinishJob.of_job(
                end.job_id,
                self._queue,
                owner_key=None if ahead else self._owners.names.owner(end.job_id),
                worker_id=self._worker_id,
                holder=lease_holder(self._worker_id, end.attempt),
                attempt=end.attempt,
                action=end.action,
                result=end.result,
                result_ttl_ms=end.result_ttl_ms,
                score_increment=end.score_increment,
                owner=owner,
            )
            for end, owner in zip(ends, owners, strict=True)
        ]
        metrics.ROUND_TRIPS["acknowledge"].inc()
        return await self._script.pipelined(calls, raise_on_error=False)
