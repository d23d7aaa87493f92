"""A short lease on a running job, so a crashed worker's jobs move within seconds.

arq marks a running job with ``arq:in-progress:<id>``, set to expire after
job_timeout + 10 s: after a worker dies, its jobs wait that long (an hour here)
before another worker may take them. While a job runs, its ``Lease`` keeps that
key's expiry a few seconds ahead instead; if the worker dies, the key lapses
within ``ttl_ms`` and the job, still in the queue, goes to the next worker that
polls.
"""

from __future__ import annotations

import asyncio
import logging
from types import TracebackType

from redis.asyncio import Redis

from producer.tasks import stop_task

logger = logging.getLogger("streamq.worker")

IN_PROGRESS_PREFIX = "arq:in-progress:"
DEFAULT_TTL_MS = 3000


class Lease:
    """Renews ``arq:in-progress:<job_id>`` every ``ttl_ms / 3`` while inside ``async with``."""

    def __init__(self, redis: Redis, job_id: str, *, ttl_ms: int = DEFAULT_TTL_MS) -> None:
        self._redis = redis
        self._key = IN_PROGRESS_PREFIX + job_id
        self._ttl_ms = ttl_ms
        self._task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> Lease:
        self._task = asyncio.get_running_loop().create_task(self._renew_forever(), name=f"lease:{self._key}")
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await stop_task(self._task)

    async def _renew_forever(self) -> None:
        while True:
            try:
                await self._redis.pexpire(self._key, self._ttl_ms)
            except Exception as exc:  # Redis unreachable for a moment: try again next period
                logger.warning("could not renew lease %s: %s", self._key, exc)
            await asyncio.sleep(self._ttl_ms / 3000)
