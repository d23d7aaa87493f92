"""Short leases on running jobs, so a crashed worker's jobs move within seconds.

arq marks a running job with ``arq:in-progress:<id>``, set to expire after
job_timeout + 10 s: after a worker dies, its jobs wait that long (an hour here)
before another worker may take them. While jobs run, the worker's ``Leases`` keep
those keys' expiry ``ttl_ms`` ahead instead, renewing all of them in one pipelined
round trip every ``ttl_ms / 3``; if the worker dies, the keys lapse within
``ttl_ms`` and the jobs, still in the queue, go to the next worker that polls.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterator
from contextlib import contextmanager

from redis.asyncio import Redis

from producer.protocol import IN_PROGRESS_PREFIX
from producer.tasks import stop_task

logger = logging.getLogger("streamq.worker")

DEFAULT_TTL_MS = 3000


class Leases:
    """Keeps the in-progress keys of this worker's running jobs alive."""

    def __init__(self, redis: Redis, *, ttl_ms: int = DEFAULT_TTL_MS) -> None:
        self.ttl_ms = ttl_ms
        self._redis = redis
        self._held: set[str] = set()
        self._renew_now = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._renew_forever(), name="leases")

    async def close(self) -> None:
        await stop_task(self._task)

    @contextmanager
    def held(self, job_id: str) -> Iterator[None]:
        """Hold ``job_id``'s lease while inside; its first renewal is immediate (arq
        may have claimed it with its own hour-long expiry)."""
        self._held.add(job_id)
        self._renew_now.set()
        try:
            yield
        finally:
            self._held.discard(job_id)

    async def _renew_forever(self) -> None:
        while True:
            self._renew_now.clear()  # before renewing: a job held meanwhile asks again
            if self._held:
                held = list(self._held)
                try:
                    async with self._redis.pipeline(transaction=False) as pipe:
                        for job_id in held:
                            pipe.pexpire(IN_PROGRESS_PREFIX + job_id, self.ttl_ms)
                        await pipe.execute()
                except Exception as exc:  # Redis unreachable for a moment: try again next period
                    logger.warning("could not renew %d leases: %s", len(held), exc)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._renew_now.wait(), self.ttl_ms / 3000)
