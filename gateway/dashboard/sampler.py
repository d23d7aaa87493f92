"""One sampler per gateway process: reads Redis about once a second while anyone watches
the dashboard, builds the Snapshot, and hands the same bytes to every watcher.

Nothing runs until the first dashboard request; the sampler stops by itself once nobody
has asked for a snapshot for ``IDLE_STOP_S``, and the next request starts it again. Each
reading is a few round trips (the registry, the reports, the recent ends, the queues'
depths), whatever the number of watchers or tokens.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from redis.exceptions import NoPermissionError

from gateway.batch_api.objects import BatchRecord
from gateway.dashboard.batches import BatchReader
from gateway.dashboard.history import WINDOW_S
from gateway.dashboard.snapshot import RECENT_ROWS, Reading, SnapshotBuilder, encode_snapshot, queues_to_count
from producer.internal_client import InternalClient
from streamq.broker.job_result import request_model_and_queue
from streamq.broker.memory_policy import read_memory_policy
from streamq.broker.worker_stats import WorkerStatsStore
from streamq.protocol import RESULT_KEY_PREFIX

logger = logging.getLogger("streamq.gateway.dashboard")

PERIOD_S = 1.0
"""How often the sampler reads Redis (and live watchers get a snapshot)."""
IDLE_STOP_S = 300.0
"""The sampler stops after this long without a watcher."""
MODEL_RETRY_MS = 10_000
"""A request that ended this recently and whose model was not found is looked up again
at the next readings: its job's result may not be stored yet when its end is."""


class DashboardSampler:
    """Reads Redis for the dashboard and shares each Snapshot with every watcher."""

    def __init__(
        self,
        client: InternalClient,
        *,
        period_s: float = PERIOD_S,
        window_s: int = WINDOW_S,
        idle_stop_s: float = IDLE_STOP_S,
    ) -> None:
        self._client = client
        self._stats = WorkerStatsStore(client.redis, client.data)
        self._builder = SnapshotBuilder(window_s)
        self._batches = BatchReader()
        self._batches_refused = False
        self._period_s = period_s
        self._idle_stop_s = idle_stop_s
        self._task: asyncio.Task[None] | None = None
        self._fresh = asyncio.Event()
        self._latest: bytes | BaseException | None = None
        self._wanted_at = time.monotonic()
        self._looked_for: dict[str, int] = {}
        """Request id -> ``ended_ms`` of ends whose model was looked for and not found."""

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()

    def latest(self) -> bytes | None:
        """The newest snapshot's JSON, if a reading has succeeded since the sampler started."""
        return self._latest if isinstance(self._latest, bytes) else None

    async def next(self) -> bytes:
        """The JSON of the next snapshot, read after this call (starting the sampler if
        it is not running); raises what the reading raised (Redis away)."""
        self._wanted_at = time.monotonic()
        if not self.running:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="dashboard-sampler")
        fresh = self._fresh
        await fresh.wait()
        latest = self._latest
        if isinstance(latest, BaseException):
            raise latest
        assert latest is not None
        return latest

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _run(self) -> None:
        while time.monotonic() - self._wanted_at < self._idle_stop_s:
            started = time.monotonic()
            try:
                self._latest = encode_snapshot(self._builder.build(await self.read()))
            except Exception as exc:
                logger.warning("dashboard: cannot read Redis: %s", exc)
                self._latest = exc
            fresh, self._fresh = self._fresh, asyncio.Event()
            fresh.set()
            await asyncio.sleep(max(0.0, self._period_s - (time.monotonic() - started)))
        self._latest = None
        logger.info("dashboard: nobody watching for %.0f s; sampling stopped", self._idle_stop_s)

    async def read(self) -> Reading:
        """One look at Redis: registry, reports, recent ends, queue depths, Redis's time and
        memory, then the models of ends not seen running."""
        redis = self._client.redis
        routes = await self._client.routes()
        reports = await self._stats.read()
        ends = await self._stats.recent_ends(RECENT_ROWS)
        queues = queues_to_count(routes)
        async with redis.pipeline(transaction=False) as pipe:
            pipe.time()
            for queue in queues:
                pipe.zcard(queue)
            replies = await pipe.execute()
        seconds, micros = replies[0]
        now_ms = int(seconds) * 1000 + int(micros) // 1000
        depths = dict(zip(queues, map(int, replies[1:]), strict=True))
        memory = await read_memory_policy(redis)
        reading = Reading(now_ms, routes, reports, depths, ends, memory, await self._read_batches())
        await self._look_up_models(reading)
        return reading

    async def _read_batches(self) -> list[BatchRecord]:
        """The batches to show; none where the gateway's Redis user may not read them (said once)."""
        try:
            return await self._batches.read(self._client.redis)
        except NoPermissionError as exc:
            if not self._batches_refused:
                logger.warning("dashboard: the batches are not shown: Redis refuses to read them: %s", exc)
                self._batches_refused = True
            return []

    async def _look_up_models(self, reading: Reading) -> None:
        """Find the model of ended requests never seen running, once each, in their jobs'
        stored results (one pipelined read); a miss is retried while the end is fresh."""
        builder = self._builder
        unresolved = set(builder.unresolved(reading.ends))
        wanted = [
            end
            for end in reading.ends
            if end.request_id in unresolved
            and (end.request_id not in self._looked_for or reading.now_ms - end.ended_ms < MODEL_RETRY_MS)
        ]
        if not wanted:
            return
        async with self._client.redis.pipeline(transaction=False) as pipe:
            for end in wanted:
                pipe.get(RESULT_KEY_PREFIX + end.request_id)
            found = await pipe.execute()
        by_queue: dict[str, list[str]] = {}
        for name, queue in reading.routes.known_models.items():
            by_queue.setdefault(queue, []).append(name)
        for end, raw in zip(wanted, found, strict=True):
            model = _model_of(raw, by_queue)
            if model is None:
                self._looked_for[end.request_id] = end.ended_ms
            else:
                builder.remember_model(end.request_id, model)
                self._looked_for.pop(end.request_id, None)
        if len(self._looked_for) > 4 * RECENT_ROWS:
            current = {end.request_id for end in reading.ends}
            self._looked_for = {k: v for k, v in self._looked_for.items() if k in current}


def _model_of(raw: bytes | None, by_queue: dict[str, list[str]]) -> str | None:
    """The model a job's stored result names: its request's ``model``, else the one model
    registered on its queue."""
    model, queue = request_model_and_queue(raw)
    if model is None and queue is not None and len(by_queue.get(queue, ())) == 1:
        return by_queue[queue][0]
    return model
