"""The dashboard's Snapshot: what the queue is doing now, per model, per worker and per
request, as one JSON document (the ``/dashboard/api/snapshot`` and ``/live`` payload).

``SnapshotBuilder`` turns one reading of Redis (``Reading``: the registry, the workers'
reports, each queue's depth, the recent ends) into a Snapshot, remembering what rates and
windows need between readings (``history``). It does no I/O: ``sampler`` reads Redis.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Literal

import msgspec

from gateway.batch_api.objects import BatchRecord
from gateway.dashboard.batches import BatchRow, batch_rows
from gateway.dashboard.history import WINDOW_S, ModelPoints, Point, WindowTotals, WorkerHistory
from gateway.dashboard.percentiles import summary_ms
from streamq.broker.memory_policy import MemoryPolicy
from streamq.broker.registry import Routes
from streamq.protocol.messages import ErrorEvent
from streamq.protocol.names import DEFAULT_TENANT
from streamq.protocol.worker_stats import RecentEnd, WorkerStats

RECENT_ROWS = 50
"""Rows of ``recent``: the newest ends."""
REMEMBERED_MODELS = 10_000
"""Request ids whose model the builder remembers (seen running, or looked up once)."""
LOST_REASON = "stopped reporting"

WorkerState = Literal["live", "stopped", "lost"]


class Percentiles(msgspec.Struct):
    p50: float
    p90: float
    p99: float


class HistoryPoint(msgspec.Struct):
    t_ms: int
    waiting: int
    running: int
    tokens_per_s: float


class ModelRow(msgspec.Struct):
    model: str
    queue: str
    live_workers: int
    waiting: int
    """Jobs in the queue (``ZCARD``) less those its live workers report running."""
    running: int
    """Requests its live workers report in flight (a LoRA adapter's: those that named it;
    its base model's: the others)."""
    tokens_per_s: float
    """Its live workers' rates, each over the last ``history.RATE_S`` or so (a base
    model's row counts its adapters' tokens: a worker reports one rate)."""
    ttft_ms: Percentiles | None
    """Time to first token over the window; ``None`` when nothing was observed."""
    itl_ms: Percentiles | None
    """Inter-token latency over the window; ``None`` when nothing was observed."""
    finished: int
    """Requests that ended with a final event in the window (cancelled, timed out too)."""
    errors: dict[str, int]
    """Requests that ended with an error event in the window, by code."""
    affinity_hits: int
    """Jobs claimed in the window by the worker enqueue held them for (prefix-aware
    pickup, docs/features/prefix-aware-pickup.md)."""
    affinity_misses: int
    """Jobs with prefix keys claimed in the window from the shared index."""
    affinity_hit_rate: float | None
    """``affinity_hits / (affinity_hits + affinity_misses)``; ``None`` when no request
    claimed in the window had prefix keys (pickup off, or no prefixes sent)."""
    affinity_expired: int
    """Held jobs whose hold passed in the window, put back for any worker: requests that
    waited for a worker that stayed busy past their hold."""
    prefix_cache_queries: int
    """Prompt tokens vLLM looked up in its prefix cache in the window."""
    prefix_cache_hits: int
    """Of those, tokens it found cached."""
    prefix_cache_hit_rate: float | None
    """``prefix_cache_hits / prefix_cache_queries``: what pickup's hits are worth in
    tokens; ``None`` when vLLM counted no lookup (a scripted engine, ``--disable-log-stats``)."""
    history: list[HistoryPoint]
    """A point every 2 s over the window, oldest first."""


class WorkerRow(msgspec.Struct):
    worker_id: str
    model: str
    queue: str
    host: str | None
    """``None`` (and ``pid``, ``started_ms``, ``reported_ms`` too) for a registered
    worker that has not reported yet."""
    pid: int | None
    started_ms: int | None
    reported_ms: int | None
    state: WorkerState
    stop_reason: str | None
    in_flight: int
    tokens_per_s: float
    generated_tokens: int
    requests_finished: int
    errors: int
    affinity_hits: int
    """Since the worker started, as ``generated_tokens``: jobs it claimed that were held for it."""
    affinity_misses: int
    """Since the worker started: jobs with prefix keys it claimed from the shared index."""
    adapters: list[str]
    """The LoRA adapters it serves beside ``model`` (its registration's), while it is live."""


class RunningRow(msgspec.Struct):
    request_id: str
    model: str
    worker_id: str
    tenant: str
    priority: int
    attempt: int
    completion_tokens: int
    started_ms: int
    age_s: float


class RecentRow(msgspec.Struct):
    request_id: str
    model: str | None
    state: Literal["finished", "failed"]
    finish_reasons: list[str | None] | None
    error_code: str | None
    error_message: str | None
    prompt_tokens: int | None
    completion_tokens: int | None
    ended_ms: int


class RedisMemoryRow(msgspec.Struct):
    used_bytes: int
    max_bytes: int
    """``maxmemory``; 0: no limit."""
    policy: str
    """``maxmemory-policy``: at ``max_bytes``, ``noeviction`` refuses writes (streamq says
    so, and waits); any other policy deletes keys."""


class Snapshot(msgspec.Struct):
    now_ms: int
    """Redis's clock when it was read."""
    window_s: int
    """The window of ``finished``, ``errors``, the affinity and prefix-cache counts, the
    percentiles and ``history``; it starts
    no earlier than the gateway began watching (the sampler's first reading)."""
    models: list[ModelRow]
    workers: list[WorkerRow]
    running: list[RunningRow]
    recent: list[RecentRow]
    redis_memory: RedisMemoryRow | None = None
    """Redis's memory and its limit; ``None`` where ``INFO`` is refused to the gateway's user."""
    batches: list[BatchRow] = msgspec.field(default_factory=list)
    """The Batch API's batches, every owner's: the unfinished ones, oldest first, then those
    that ended in the last hour, newest first (``gateway.dashboard.batches``)."""


_encoder = msgspec.json.Encoder()


def encode_snapshot(snapshot: Snapshot) -> bytes:
    return _encoder.encode(snapshot)


@dataclass(frozen=True)
class Reading:
    """One look at Redis."""

    now_ms: int
    """Redis's clock."""
    routes: Routes
    reports: list[WorkerStats]
    depths: dict[str, int]
    """Queue -> ``ZCARD``."""
    ends: list[RecentEnd]
    """Newest first."""
    memory: MemoryPolicy | None = None
    """``INFO memory``; ``None`` where it cannot be read."""
    batches: list[BatchRecord] = field(default_factory=list)
    """The records of the batches to show (``gateway.dashboard.batches.BatchReader``)."""


def queues_to_count(routes: Routes) -> list[str]:
    """The queues whose depth a reading needs: every model's, live or known."""
    return sorted({*routes.known_models.values(), *(w.queue for w in routes.workers)})


class SnapshotBuilder:
    """Builds Snapshots from successive readings, keeping the history they need."""

    def __init__(self, window_s: int = WINDOW_S) -> None:
        self.window_s = window_s
        self._workers: dict[str, WorkerHistory] = {}
        self._points = ModelPoints(window_s)
        self._models: OrderedDict[str, str] = OrderedDict()

    # --- the model of a request -----------------------------------------------------
    def remember_model(self, request_id: str, model: str) -> None:
        """Remember which model ran ``request_id``."""
        self._models[request_id] = model
        self._models.move_to_end(request_id)
        while len(self._models) > REMEMBERED_MODELS:
            self._models.popitem(last=False)

    def unresolved(self, ends: Iterable[RecentEnd]) -> list[str]:
        """Ended requests whose model is not known."""
        return [end.request_id for end in ends if end.request_id not in self._models]

    # --- the snapshot ---------------------------------------------------------------
    def build(self, reading: Reading) -> Snapshot:
        now_ms = reading.now_ms
        live_ids = {w.worker_id for w in reading.routes.workers}
        reported = {r.worker_id for r in reading.reports}
        for report in reading.reports:
            self._workers.setdefault(report.worker_id, WorkerHistory()).add(report, now_ms, self.window_s)
            if report.worker_id in live_ids:
                for request in report.in_flight:
                    self.remember_model(request.request_id, report.model)
        for gone in set(self._workers) - reported:  # its report expired from Redis
            del self._workers[gone]

        workers = self._worker_rows(reading, live_ids)
        running = self._running_rows(reading, live_ids)
        models = self._model_rows(reading, live_ids)
        recent = [self._recent_row(end) for end in reading.ends[:RECENT_ROWS]]
        memory = reading.memory
        redis_memory = None if memory is None else RedisMemoryRow(memory.used, memory.maxmemory, memory.policy)
        batches = batch_rows(reading.batches, now_ms)
        return Snapshot(now_ms, self.window_s, models, workers, running, recent, redis_memory, batches)

    def _worker_rows(self, reading: Reading, live_ids: set[str]) -> list[WorkerRow]:
        rows = []
        adapters = {w.worker_id: [a.name for a in w.adapters] for w in reading.routes.workers}
        for report in reading.reports:
            history = self._workers[report.worker_id]
            live = report.worker_id in live_ids
            state: WorkerState = "live" if live else "stopped" if report.stopped_ms is not None else "lost"
            reason = None if live else report.stop_reason or (LOST_REASON if state == "lost" else None)
            rows.append(
                WorkerRow(
                    worker_id=report.worker_id,
                    model=report.model,
                    queue=report.queue,
                    host=report.host,
                    pid=report.pid,
                    started_ms=report.started_ms,
                    reported_ms=report.reported_ms,
                    state=state,
                    stop_reason=reason,
                    in_flight=len(report.in_flight) if live else 0,
                    tokens_per_s=round(history.tokens_per_s(reading.now_ms), 2) if live else 0.0,
                    generated_tokens=report.generated_tokens,
                    requests_finished=report.requests_finished,
                    errors=sum(report.errors.values()),
                    affinity_hits=report.affinity_hits,
                    affinity_misses=report.affinity_misses,
                    adapters=adapters.get(report.worker_id, []) if live else [],
                )
            )
        reported = {r.worker_id for r in reading.reports}
        for registration in reading.routes.workers:
            if registration.worker_id not in reported:  # registered, first report still to come
                rows.append(
                    WorkerRow(
                        worker_id=registration.worker_id,
                        model=registration.model,
                        queue=registration.queue,
                        host=None,
                        pid=None,
                        started_ms=None,
                        reported_ms=None,
                        state="live",
                        stop_reason=None,
                        in_flight=0,
                        tokens_per_s=0.0,
                        generated_tokens=0,
                        requests_finished=0,
                        errors=0,
                        affinity_hits=0,
                        affinity_misses=0,
                        adapters=adapters[registration.worker_id],
                    )
                )
        order = {"live": 0, "stopped": 1, "lost": 1}
        # live ones by model and id; those gone, the most recently heard from first
        return sorted(
            rows,
            key=lambda r: (
                order[r.state],
                (r.model, r.worker_id) if r.state == "live" else (-(r.reported_ms or 0), ""),
            ),
        )

    def _running_rows(self, reading: Reading, live_ids: set[str]) -> list[RunningRow]:
        rows = [
            RunningRow(
                request_id=request.request_id,
                model=request.model or report.model,
                worker_id=report.worker_id,
                tenant=request.tenant or DEFAULT_TENANT,
                priority=request.priority or 0,
                attempt=request.attempt,
                completion_tokens=request.completion_tokens,
                started_ms=request.started_ms,
                age_s=round(max(0, reading.now_ms - request.started_ms) / 1000, 1),
            )
            for report in reading.reports
            if report.worker_id in live_ids
            for request in report.in_flight
        ]
        return sorted(rows, key=lambda row: (row.started_ms, row.request_id))

    def _model_rows(self, reading: Reading, live_ids: set[str]) -> list[ModelRow]:
        now_ms = reading.now_ms
        routes = reading.routes
        queues = dict(routes.known_models)
        queues.update(routes.live_models())
        live_workers: dict[str, int] = {}
        for registration in routes.workers:
            for name in registration.models():  # its LoRA adapters are models too
                live_workers[name] = live_workers.get(name, 0) + 1
        shown = sorted(m for m, q in queues.items() if m in live_workers or reading.depths.get(q, 0) > 0)

        running_by_model: dict[str, int] = {}
        running_by_queue: dict[str, int] = {}
        rate: dict[str, float] = {}
        totals: dict[str, WindowTotals] = {}
        for report in reading.reports:
            history = self._workers[report.worker_id]
            totals.setdefault(report.model, WindowTotals()).add(history.window_totals(now_ms, self.window_s))
            if report.worker_id in live_ids:
                for request in report.in_flight:  # an adapter's requests count as its own
                    named = request.model or report.model
                    running_by_model[named] = running_by_model.get(named, 0) + 1
                running_by_queue[report.queue] = running_by_queue.get(report.queue, 0) + len(report.in_flight)
                rate[report.model] = rate.get(report.model, 0.0) + history.tokens_per_s(now_ms)

        rows = []
        for model in shown:
            queue = queues[model]
            running = running_by_model.get(model, 0)
            waiting = max(0, reading.depths.get(queue, 0) - running_by_queue.get(queue, 0))
            tokens_per_s = round(rate.get(model, 0.0), 2)
            self._points.add(model, Point(now_ms, waiting, running, tokens_per_s))
            window = totals.get(model, WindowTotals())
            rows.append(
                ModelRow(
                    model=model,
                    queue=queue,
                    live_workers=live_workers.get(model, 0),
                    waiting=waiting,
                    running=running,
                    tokens_per_s=tokens_per_s,
                    ttft_ms=_percentiles(window, "ttft"),
                    itl_ms=_percentiles(window, "itl"),
                    finished=window.finished,
                    errors=dict(sorted(window.errors.items())),
                    affinity_hits=window.affinity_hits,
                    affinity_misses=window.affinity_misses,
                    affinity_hit_rate=_ratio(window.affinity_hits, window.affinity_hits + window.affinity_misses),
                    affinity_expired=window.affinity_expired,
                    prefix_cache_queries=window.prefix_cache_queries,
                    prefix_cache_hits=window.prefix_cache_hits,
                    prefix_cache_hit_rate=_ratio(window.prefix_cache_hits, window.prefix_cache_queries),
                    history=[
                        HistoryPoint(p.t_ms, p.waiting, p.running, p.tokens_per_s) for p in self._points.of(model)
                    ],
                )
            )
        self._points.prune(now_ms)
        return rows

    def _recent_row(self, end: RecentEnd) -> RecentRow:
        event = end.event
        model = self._models.get(end.request_id)
        if isinstance(event, ErrorEvent):
            return RecentRow(end.request_id, model, "failed", None, event.code, event.message, None, None, end.ended_ms)
        return RecentRow(
            end.request_id,
            model,
            "finished",
            list(event.finish_reasons),
            None,
            None,
            event.prompt_tokens,
            event.completion_tokens,
            end.ended_ms,
        )


def _percentiles(window: WindowTotals, which: Literal["ttft", "itl"]) -> Percentiles | None:
    summary = summary_ms(window.ttft if which == "ttft" else window.itl)
    return None if summary is None else Percentiles(summary["p50"], summary["p90"], summary["p99"])


def _ratio(part: int, whole: int) -> float | None:
    """``part / whole`` to four places (a rate the page shows as a percentage); ``None``
    when there is nothing to divide, which the page shows as "–", not as 0 %."""
    return round(part / whole, 4) if whole > 0 else None
