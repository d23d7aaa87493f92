"""Short leases on running jobs, so a crashed worker's jobs move within seconds.

arq's in-progress key expires job_timeout + 10 s after the claim (an hour here); ``Leases``
keeps it ``ttl_ms`` ahead instead, renewing all in one script call every ``ttl_ms / 3``.
A lease names its holder (``lease_holder``). The lease only says that an attempt is alive;
who owns the request is its owner key's to say, and renewal reads it in the same script:
an attempt keeps (or takes back) its lease while no newer attempt owns the request, and
learns at once when one does, or when the request ended, and stops. Where the owner keys
live on a Redis Cluster, they are read just before (``OwnerRead``). The same script reads
each request's cancel record (``streamq:cancelled:<id>``): a cancel whose message this
worker missed is acted on within a renewal period.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

from redis.asyncio import Redis

from streamq.broker.data_plane import OwnerRead
from streamq.protocol import IN_PROGRESS_PREFIX, JOB_KEY_PREFIX, LEASE_TTL_MS
from streamq.protocol.names import cancelled_key
from streamq.protocol.script_calls import LeaseRenewal, RenewLeases
from streamq.protocol.scripts import Script
from streamq.tasks import stop_task
from worker import metrics
from worker.failure_log import RepeatedFailure

logger = logging.getLogger("streamq.worker")


def lease_holder(worker_id: str, attempt: int) -> str:
    """The value of an in-progress key held by ``attempt`` of a job on ``worker_id``."""
    return f"{worker_id}:{attempt}"


HELD, HELD_CANCELLED = 1, 2
"""``renew_leases``' answers for a held lease: renewed, and renewed with a cancel recorded."""


class Leases:
    """Keeps the in-progress keys of this worker's running requests alive (a job's keys are
    named by its id, which is its request's).

    :param worker_id: this worker's id, the value its claims write.
    :param on_lost: called with ``(request_id, attempt)`` when a newer attempt owns the request
        or it ended: that attempt stops without writing the end.
    :param on_cancelled: called with ``request_id`` at each renewal that finds a cancel recorded
        for a held job's request (the cancel listener cancels it, once).
    :param owners: the data plane's owner keys, when they are not on ``redis``.
    """

    def __init__(
        self,
        redis: Redis,
        *,
        worker_id: str,
        on_lost: Callable[[str, int], None],
        on_cancelled: Callable[[str], None] | None = None,
        ttl_ms: int = LEASE_TTL_MS,
        owners: OwnerRead | None = None,
    ) -> None:
        self.ttl_ms = ttl_ms
        self.worker_id = worker_id
        self._redis = redis
        self._owners = owners if owners is not None else OwnerRead(redis)
        self._on_lost = on_lost
        self._on_cancelled = on_cancelled
        self._held: dict[str, int] = {}
        """job id -> the attempt holding its lease here."""
        self._failures = RepeatedFailure(logger, "renewing leases")
        self._renew_now = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._renew = Script(redis, RenewLeases)

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._renew_forever(), name="leases")

    async def close(self) -> None:
        await stop_task(self._task)

    @contextmanager
    def held(self, request_id: str, attempt: int, *, renew_now: bool = True) -> Iterator[None]:
        """Hold ``request_id``'s lease for ``attempt`` while inside; its first renewal is
        immediate unless ``renew_now`` is false: arq's own claim writes an hour-long expiry,
        where the worker's claim has just set ``ttl_ms`` (the next period renews it)."""
        self._held[request_id] = attempt
        if renew_now:
            self._renew_now.set()
        try:
            yield
        finally:
            if self._held.get(request_id) == attempt:
                del self._held[request_id]

    async def renew(self) -> None:
        """Renew every held lease once; report those whose request a newer attempt owns
        or that ended, and those whose request has a cancel recorded."""
        held = list(self._held.items())
        if not held:
            return
        ahead = self._owners.ahead  # the owner keys are on another server: read them first
        owners: Sequence[str | None] = [None] * len(held)
        if ahead:
            owners = await self._owners.values([request_id for request_id, _ in held])
        jobs = [
            LeaseRenewal(
                IN_PROGRESS_PREFIX + request_id,
                JOB_KEY_PREFIX + request_id,
                lease_holder(self.worker_id, attempt),
                attempt,
                cancelled_key(request_id),
                owner_key=None if ahead else self._owners.names.owner(request_id),
                owner=owner,
            )
            for (request_id, attempt), owner in zip(held, owners, strict=True)
        ]
        metrics.ROUND_TRIPS["lease"].inc()
        replies = await self._renew(RenewLeases(ttl_ms=self.ttl_ms, jobs=jobs))
        for (request_id, attempt), kept in zip(held, replies, strict=True):
            if self._held.get(request_id) != attempt:
                continue  # it ended meanwhile
            if not kept:
                logger.warning("request %s: owned by a newer attempt, or ended (attempt %d stops)", request_id, attempt)
                metrics.LEASES_LOST.inc()
                del self._held[request_id]
                self._on_lost(request_id, attempt)
            elif kept == HELD_CANCELLED and self._on_cancelled is not None:
                self._on_cancelled(request_id)

    async def _renew_forever(self) -> None:
        while True:
            self._renew_now.clear()  # before renewing: a job held meanwhile asks again
            try:
                await self.renew()
            except Exception as exc:  # Redis unreachable (or full) for a moment: try again next period
                self._failures.failed("could not renew %d leases: %s", len(self._held), exc)
            else:
                self._failures.passed()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._renew_now.wait(), self.ttl_ms / 3000)
