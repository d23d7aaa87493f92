"""arq's start-up and shutdown hooks: the engine and the parts beside it."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from contextlib import AsyncExitStack
from typing import Any

from arq.utils import import_string

from streamq.broker.data_plane import DataRedis, close_data_plane, connect_data_plane
from streamq.broker.durability import DetectedDurability, DurabilitySpec, write_record
from streamq.broker.memory_policy import EvictingRedis, check_memory_policy, read_memory_policy
from streamq.broker.replay_log import ReplayLog
from streamq.tasks import stop_task
from worker import metrics
from worker.adapters import Adapters
from worker.callbacks import CallbackPolicy, CallbackSender
from worker.cancel import CancelListener
from worker.chat_parsing import ChatParsing, ParserFlags
from worker.config import WorkerConfig, config_of
from worker.engine import max_batch_size, start_engine
from worker.interrupt import exit_on_stop_signal
from worker.lease import Leases
from worker.logs import quiet_request_failures
from worker.pooling import engine_tasks
from worker.presence import Presence, served_model_name
from worker.publisher import EventPublisher, Refusal
from worker.scheduling import lower_worker_cpu_weight
from worker.state import STATE_KEY, WorkerState, new_worker_id
from worker.stats_report import StatsReporter
from worker.tokenizer_info import publish_tokenizer_info

logger = logging.getLogger("streamq.worker")


async def _watch_engine(state: WorkerState) -> None:
    """Notice an engine that died between requests, or under one whose output
    handler stopped without failing it (a request would wait forever)."""
    while not state.engine_dead:
        if getattr(state.engine, "errored", False):
            state.engine_died()
        await asyncio.sleep(0.5)


def _build_engine(config: WorkerConfig) -> Any:
    """vLLM's ``AsyncLLM``, or what the engine factory builds.

    ``config.engine_factory``, a ``module:callable`` taking the engine arguments, replaces
    ``AsyncLLM`` with an object of the same interface: a scripted engine for load-testing
    the queue layer.
    """
    factory_path = config.engine_factory
    if factory_path:
        factory = import_string(factory_path.replace(":", "."))
        with exit_on_stop_signal():  # as start_engine's load: a stop signal exits at once
            engine = factory(config.engine_args)
        logger.info("engine from factory %s", factory_path)
        return engine
    if config.engine_args is None:
        raise ValueError("a worker without an engine factory needs the engine's arguments")
    return start_engine(config.engine_args, config.front_end)


def _shut_down_engine(engine: Any) -> None:
    engine.shutdown()
    logger.info("engine shut down")


async def _check_memory_policy(redis: Any, config: WorkerConfig) -> None:
    """Read what Redis does when full, before the engine loads: say it, warn under an
    evicting policy, refuse to start under one that evicts any key unless allowed
    (``streamq/broker/memory_policy.py``)."""
    policy = await read_memory_policy(redis)
    if policy is None:
        logger.info("Redis's maxmemory-policy cannot be read (INFO memory refused): it must be noeviction")
        return
    try:
        warning = check_memory_policy(policy, allow_evicting=config.allow_evicting_redis)
    except EvictingRedis as exc:
        raise SystemExit(f"python -m worker: {exc}") from None
    if warning is None:
        logger.info("Redis: %s", policy.describe())
    else:
        logger.warning(warning)


def _callback_policy(config: WorkerConfig) -> CallbackPolicy:
    """How this worker sends completion callbacks (checked: a bad one fails the start)."""
    return CallbackPolicy(
        tries=config.callback_tries,
        backoff_s=config.callback_backoff_s,
        timeout_s=config.callback_timeout_s,
        secret=config.callback_secret,
    )


async def _durable_ends(
    config: WorkerConfig, redis: Any, data: DataRedis, closing: AsyncExitStack
) -> tuple[DetectedDurability, DetectedDurability]:
    """What an end waits for on the control plane (callbacks) and on the data plane (the
    replay log), read from the primaries now (the start-up log line says what), again every
    ``DURABILITY_RECHECK_S`` and after a shortfall, each time written to ``DURABILITY_KEY``
    for producers. One Redis: one reading serves both planes."""
    spec = DurabilitySpec.parse(config.durable_ends)
    timeout_ms = round(config.durable_ends_timeout_s * 1000)
    control = DetectedDurability(redis, spec, timeout_ms=timeout_ms, on_wait=metrics.durable_end_waited)
    planes = [control]
    if data is not redis:
        planes.append(DetectedDurability(data, spec, timeout_ms=timeout_ms, on_wait=metrics.durable_end_waited))
    on_data = planes[-1]

    async def publish() -> None:
        await write_record(redis, spec, control, on_data)

    for plane in planes:
        try:
            await plane.detect()
        except Exception as exc:  # the checks go on trying; until one succeeds, ends wait for nothing
            logger.warning("durable ends: cannot read what the primary offers (%s); checking again shortly", exc)
    if len(planes) == 1:
        logger.info("durable ends (%s): %s", spec, control.describe())
    else:
        logger.info("durable ends (%s), control plane (callbacks): %s", spec, control.describe())
        logger.info("durable ends (%s), data plane (Redis Cluster): %s", spec, on_data.describe())
    with contextlib.suppress(Exception):  # written again at every check
        await publish()
    control.on_detected = publish
    for plane in planes:
        plane.start()
        closing.push_async_callback(plane.close)
    return control, on_data


def _slots(config: WorkerConfig, engine: Any) -> int:
    """The requests this worker runs at once, as it registers them: ``--max-jobs`` or the
    engine's batch, a front end's share of it."""
    slots = config.max_jobs or max_batch_size(engine)
    seat = config.front_end
    return slots if seat is None else -(-slots // seat.count)


async def on_startup(ctx: dict[str, Any]) -> None:
    """Start the engine inside arq's loop, and beside it the publisher, the cancel
    listener, the leases and the stats report; store them in ``ctx`` as one ``WorkerState``.

    A part that fails to start closes those started before it (the engine too).
    """
    quiet_request_failures()
    config = config_of(ctx)
    redis = ctx["redis"]
    if config.front_end is None:  # a front end inherits the weight its parent lowered
        # Before the engine starts: its processes inherit the lower weight.
        lower_worker_cpu_weight(config.cpu_nice)
    if config.front_end is None or config.front_end.index == 0:  # one line a worker, not a front end
        await _check_memory_policy(redis, config)
    async with AsyncExitStack() as closing:
        # Before the engine: a data plane that is not a whole cluster fails the start in seconds.
        data = await connect_data_plane(redis, config.events_redis_url)
        closing.push_async_callback(close_data_plane, redis, data)
        control_durability, data_durability = await _durable_ends(config, redis, data, closing)
        engine = _build_engine(config)
        closing.callback(_shut_down_engine, engine)
        worker_id = new_worker_id()
        replay_log = ReplayLog(data, maxlen=config.log_maxlen, ttl_ms=config.log_ttl_ms, durability=data_durability)
        cancels = CancelListener(redis)
        await cancels.start()
        closing.push_async_callback(cancels.close)
        publisher = EventPublisher(replay_log, on_refused=cancels.stop, coalesce=config.coalesce)
        publisher.start()
        closing.push_async_callback(publisher.close)
        queue = config.queue
        leases = Leases(
            redis,
            worker_id=worker_id,
            on_lost=lambda request_id, attempt: cancels.stop(request_id, attempt, Refusal.SUPERSEDED),
            on_cancelled=cancels.recorded,  # a cancel whose message this worker missed
            owners=replay_log.owners,
        )
        leases.start()
        closing.push_async_callback(leases.close)
        model, max_model_len = served_model_name(engine)
        adapters = await _adapters(config, engine, model)
        tasks, pooled_size = await engine_tasks(engine)
        presence = Presence(
            redis,
            worker_id=worker_id,
            model=model,
            queue=queue,
            max_model_len=max_model_len,
            slots=_slots(config, engine),
            adapters=adapters.cards() if adapters is not None else (),
            loads_adapters=adapters is not None and adapters.loads_adapters,
            tasks=tasks,
            pooled_size=pooled_size,
        )
        if adapters is not None:
            adapters.on_change = presence.list_adapters
        callbacks = CallbackSender(redis, replay_log, _callback_policy(config), durability=control_durability)
        callbacks.start()
        closing.push_async_callback(callbacks.close)
        state = WorkerState(
            worker_id=worker_id,
            engine=engine,
            replay_log=replay_log,
            cancels=cancels,
            publisher=publisher,
            leases=leases,
            presence=presence,
            callbacks=callbacks,
            checkpoint_tokens=config.checkpoint_tokens,
            chat_parsing=_chat_parsing(config, engine),
            adapters=adapters,
        )
        engine_watch = asyncio.create_task(_watch_engine(state), name="engine-watch")
        closing.push_async_callback(stop_task, engine_watch)
        metrics_port = config.metrics_port
        if metrics_port and config.front_end is not None:
            metrics_port += config.front_end.index  # each front end has its own counters
        probes = metrics.probes_of(ctx)
        probes.engine_alive = lambda: not state.engine_dead
        metrics_server = metrics.serve_metrics(metrics_port, probes=probes)
        if metrics_server is not None:
            closing.callback(metrics.stop_serving, metrics_server)
        queue_depth_sampler = asyncio.create_task(metrics.sample_queue_depth(redis, queue), name="queue-depth-sampler")
        closing.push_async_callback(stop_task, queue_depth_sampler)
        # Closed after the registration is withdrawn, and (as every part) after the jobs
        # drained: its last report says the worker stopped, with nothing in flight.
        reporter = StatsReporter(
            redis, registration=presence.registration, running=state.running, engine_dead=lambda: state.engine_dead
        )
        reporter.start()
        closing.push_async_callback(reporter.close)
        await publish_tokenizer_info(redis, model, engine)
        # Last: once registered, producers route this model's requests here.
        await presence.start()
        probes.registered = True  # /ready answers 200 until the worker stops claiming
        closing.push_async_callback(presence.close)
        state.closing = closing.pop_all()
        ctx[STATE_KEY] = state


def _chat_parsing(config: WorkerConfig, engine: Any) -> ChatParsing | None:
    """vLLM's renderer and parsers for chat requests, with the worker's tool flags; none for
    an engine without vLLM's renderer (a scripted one), which refuses tool flags."""
    if not hasattr(engine, "renderer"):
        if config.parsers is not None:
            raise ValueError("tool-call flags need vLLM's engine (a scripted engine has no tool parser)")
        return None
    return ChatParsing(engine, config.parsers or ParserFlags())


async def _adapters(config: WorkerConfig, engine: Any, model: str) -> Adapters | None:
    """The LoRA adapters served beside ``model`` (its ``--lora-modules`` loaded now, as vllm
    serve loads them); ``None`` for an engine without LoRA."""
    lora_config = getattr(getattr(engine, "vllm_config", None), "lora_config", None)
    if lora_config is None:
        return None
    adapters = Adapters(engine, model, modules=config.lora_modules or ())
    await adapters.load_listed()
    return adapters


async def on_shutdown(ctx: dict[str, Any]) -> None:
    """Flush pending events, withdraw the registration and shut the engine down (a
    start-up that failed has closed its parts already)."""
    state = ctx.get(STATE_KEY)
    if isinstance(state, WorkerState):
        await state.close()
