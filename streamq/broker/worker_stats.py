"""Workers' self-reports in Redis (``WORKER_STATS_KEY``) and the list of requests that
ended lately (``RECENT_ENDS_KEY``, one per bucket on a Redis Cluster's data plane): what the
gateway's dashboard reads.

Both are written at a bounded rate (a report a second per worker, one entry per ended
request), never per token. Formats: ``streamq.protocol.worker_stats`` and PROTOCOL.md.
"""

from __future__ import annotations

import logging

import msgspec
from redis.asyncio import Redis

from streamq.broker.data_plane import DataRedis, names_of
from streamq.broker.replies import as_text
from streamq.protocol.names import (
    RECENT_ENDS_MAX,
    WORKER_STATS_KEEP_MS,
    WORKER_STATS_KEY,
    WORKER_STATS_SEEN_KEY,
)
from streamq.protocol.script_calls import ReportWorkerStats
from streamq.protocol.scripts import Script
from streamq.protocol.worker_stats import (
    RecentEnd,
    WorkerStats,
    decode_recent_end,
    decode_worker_stats,
    encode_worker_stats,
)

logger = logging.getLogger("streamq.stats")


class WorkerStatsStore:
    """Stores a worker's reports; reads every worker's, and the recent ends."""

    def __init__(self, redis: Redis, data: DataRedis | None = None) -> None:
        """``data``: the data plane, where the recent ends are pushed, when not ``redis``."""
        self._redis = redis
        self._data: DataRedis = redis if data is None else data
        self._report = Script(redis, ReportWorkerStats)

    async def report(self, stats: WorkerStats, keep_ms: int = WORKER_STATS_KEEP_MS) -> None:
        """Replace this worker's report (and drop reports older than ``keep_ms``)."""
        await self._report(
            ReportWorkerStats(
                stats_key=WORKER_STATS_KEY,
                seen_key=WORKER_STATS_SEEN_KEY,
                worker_id=stats.worker_id,
                stats=encode_worker_stats(stats),
                keep_ms=keep_ms,
            )
        )

    async def read(self) -> list[WorkerStats]:
        """Every stored report, each with ``reported_ms`` set, oldest report first."""
        async with self._redis.pipeline(transaction=False) as pipe:
            pipe.hgetall(WORKER_STATS_KEY)
            pipe.zrange(WORKER_STATS_SEEN_KEY, 0, -1, withscores=True)
            reports, seen = await pipe.execute()
        stamps = {as_text(member): int(score) for member, score in seen}
        found = []
        for worker_id, raw in reports.items():
            try:
                stats = decode_worker_stats(raw)
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:  # a newer protocol, or by hand
                logger.warning("ignoring a malformed worker report %r: %s", raw[:200], exc)
                continue
            stats.reported_ms = stamps.get(as_text(worker_id), 0)
            found.append(stats)
        return sorted(found, key=lambda stats: stats.reported_ms)

    async def recent_ends(self, limit: int = RECENT_ENDS_MAX) -> list[RecentEnd]:
        """The last ``limit`` requests to end, newest first (on a Redis Cluster, each bucket's
        list read and the lists merged)."""
        ends = []
        keys = names_of(self._data).all_recent_ends()
        for key in keys:
            for entry in await self._data.lrange(key, 0, limit - 1):  # type: ignore[misc]
                try:
                    ends.append(decode_recent_end(entry))
                except (ValueError, msgspec.DecodeError, msgspec.ValidationError) as exc:
                    logger.warning("ignoring a malformed recent-ends entry %r: %s", entry[:200], exc)
        if len(keys) > 1:  # one list is newest first already; several are merged by time
            ends.sort(key=lambda end: end.ended_ms, reverse=True)
        return ends[:limit]
