"""The requests waiting on each queue, read and kept exact with no worker alive: the
signal an autoscaler scales workers on, down to zero and back.

``<queue>:waiting`` (``queue_waiting_key``) holds every request due on the queue and not
started: enqueue adds the ones due at once, each claim those it makes due and removes those
it takes. Two changes come with time alone, a deferred request coming due and a dead
worker's lease lapsing: with no worker claiming, ``tend`` runs the claim asked for no jobs,
which does that bookkeeping and nothing else. Key names and the scripts: PROTOCOL.md.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from redis.asyncio import Redis

from streamq.broker.registry import Routes
from streamq.protocol import IN_PROGRESS_PREFIX, LEASE_TTL_MS, WAKEUP_CHANNEL
from streamq.protocol.names import queue_waiting_key
from streamq.protocol.script_calls import ClaimJobs, ReadWaiting
from streamq.protocol.scripts import Script

TEND_PAGE = 1000
"""Deferred jobs and lapsed leases one tending of a queue looks at (a claim reads its own
page); the next tending, a second later, reads on."""


@dataclass(frozen=True)
class QueueWaiting:
    """One queue's waiting requests, as read at one moment of Redis's clock."""

    queue: str
    model: str
    """The base model the queue's workers last registered ('' if none ever did)."""
    waiting: int
    """Requests due and not started: waiting for a free worker, or for a take-over."""
    oldest_wait_s: float
    """How long the longest waiting of them has waited (0 when none waits)."""


def queues_of(routes: Routes, *, also: Iterable[str] = (), declared: Mapping[str, str] | None = None) -> dict[str, str]:
    """Queue -> its base model, for every queue a worker ever served a model on, the queues
    of ``declared`` models (name -> queue) and ``also`` (a client's own queue, say)."""
    queues = dict.fromkeys(also, "")
    for model, queue in (declared or {}).items():
        queues.setdefault(queue, model)
    queues.update(dict.fromkeys(routes.known_models.values(), ""))
    queues.update(routes.queue_models)
    for worker in routes.workers:
        queues[worker.queue] = worker.model
    return queues


class WaitingRequests:
    """Reads each queue's waiting requests (``read``) and keeps them exact (``tend``)."""

    def __init__(self, redis: Redis) -> None:
        self._read = Script(redis, ReadWaiting)
        self._claim = Script(redis, ClaimJobs)

    async def read(self, queues: Mapping[str, str]) -> list[QueueWaiting]:
        """The waiting requests of each queue (queue -> its model's label), in one round trip."""
        names = list(queues)
        if not names:
            return []
        now, *counts = await self._read(ReadWaiting(waiting_keys=[queue_waiting_key(queue) for queue in names]))
        now_ms = int(now)
        found = []
        for queue, waiting, oldest in zip(names, counts[::2], counts[1::2], strict=True):
            since = float(oldest) if oldest else None
            age_s = max(0.0, (now_ms - since) / 1000) if since is not None else 0.0
            found.append(QueueWaiting(queue=queue, model=queues[queue], waiting=int(waiting), oldest_wait_s=age_s))
        return found

    async def tend(self, queues: Iterable[str]) -> None:
        """Make each queue's waiting set exact as of now: the claim, asked for no jobs, moves
        the deferred jobs that came due into the index, notes lapsed leases as waiting, and
        wakes the workers if it moved any (one round trip for every queue)."""
        # No jobs, no worker (its id ''), no prefixes owned, no free slots set.
        await self._claim.pipelined(
            ClaimJobs(
                queue=queue,
                wanted=0,
                lease_ms=LEASE_TTL_MS,
                page=TEND_PAGE,
                in_progress_prefix=IN_PROGRESS_PREFIX,
                worker_id="",
                wakeup_channel=WAKEUP_CHANNEL,
            )
            for queue in queues
        )
