"""arq's start-up and shutdown hooks: the engine and the parts beside it."""

from __future__ import annotations

import asyncio
import logging
import os
from typing import Any

from arq.utils import import_string

from streamq.broker.replay_log import ReplayLog
from streamq.environment import queue_from_env
from streamq.tasks import stop_task
from worker import metrics
from worker.cancel import CancelListener
from worker.engine import engine_args_from_env, start_engine
from worker.lease import Leases
from worker.logs import quiet_request_failures
from worker.presence import Presence, served_model_name
from worker.publisher import EventPublisher
from worker.scheduling import cpu_nice_from_env, lower_cpu_weight
from worker.state import WorkerState, new_worker_id

logger = logging.getLogger("streamq.worker")


ENGINE_FACTORY_ENV = "STREAMQ_ENGINE_FACTORY"


async def _watch_engine(engine: Any, state: WorkerState) -> None:
    """Notice an engine that died between requests, or under one whose output
    handler stopped without failing it (a request would wait forever)."""
    while not state.engine_dead:
        if getattr(engine, "errored", False):
            state.engine_died()
        await asyncio.sleep(0.5)


async def on_startup(ctx: dict[str, Any]) -> None:
    """Start the engine inside arq's loop, and beside it the publisher and the
    cancel listener.

    ``ctx["engine_factory"]`` (or ``$STREAMQ_ENGINE_FACTORY``), a ``module:callable``
    taking the engine arguments, replaces vLLM's ``AsyncLLM`` with an object of the
    same interface: a scripted engine for load-testing the queue layer.
    """
    quiet_request_failures()
    # Before the engine starts: its processes inherit the lower weight.
    changed = lower_cpu_weight(ctx.get("cpu_nice", cpu_nice_from_env()))
    if changed:
        logger.info("CPU weight lowered so Redis and clients on this host are not starved: %s", "; ".join(changed))
    factory_path = ctx.get("engine_factory") or os.environ.get(ENGINE_FACTORY_ENV)
    if factory_path:
        factory = import_string(factory_path.replace(":", "."))
        ctx["engine"] = factory(ctx.get("engine_args"))
        logger.info("engine from factory %s", factory_path)
    else:
        ctx["engine"] = start_engine(ctx.get("engine_args") or engine_args_from_env())
    worker_id = new_worker_id()
    ctx["replay_log"] = ReplayLog(ctx["redis"], maxlen=ctx.get("log_maxlen"), ttl_ms=ctx.get("log_ttl_ms"))
    ctx["cancels"] = CancelListener(ctx["redis"])
    await ctx["cancels"].start()
    ctx["publisher"] = EventPublisher(ctx["replay_log"], on_superseded=ctx["cancels"].supersede)
    ctx["publisher"].start()
    ctx["leases"] = Leases(ctx["redis"], worker_id=worker_id, on_lost=ctx["cancels"].supersede)
    ctx["leases"].start()
    ctx["state"] = WorkerState(
        worker_id=worker_id, replay_log=ctx["replay_log"], cancels=ctx["cancels"], leases=ctx["leases"]
    )
    ctx["engine_watch"] = asyncio.create_task(_watch_engine(ctx["engine"], ctx["state"]), name="engine-watch")
    ctx["metrics_server"] = metrics.serve_metrics(ctx.get("metrics_port", metrics.metrics_port_from_env()))
    queue = ctx.get("queue_name") or queue_from_env()
    ctx["queue_depth_sampler"] = asyncio.create_task(
        metrics.sample_queue_depth(ctx["redis"], queue), name="queue-depth-sampler"
    )
    # Last: once registered, producers route this model's requests here.
    model, max_model_len = served_model_name(ctx["engine"])
    ctx["presence"] = Presence(ctx["redis"], worker_id=worker_id, model=model, queue=queue, max_model_len=max_model_len)
    await ctx["presence"].start()


async def on_shutdown(ctx: dict[str, Any]) -> None:
    """Flush pending events and shut the engine down (always)."""
    await stop_task(ctx.get("engine_watch"))
    await stop_task(ctx.get("queue_depth_sampler"))
    if ctx.get("metrics_server") is not None:
        ctx["metrics_server"].shutdown()
    for name in ("presence", "leases", "cancels", "publisher"):
        if name in ctx:
            await ctx[name].close()
    engine = ctx.get("engine")
    if engine is not None:
        engine.shutdown()
        logger.info("engine shut down")
