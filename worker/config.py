"""The worker's configuration, one frozen object built once where the worker starts.

``python -m worker`` builds it from its command line (``worker/startup.py``: each flag's
default is the registry's reader of its variable, ``streamq/env_vars.py``, and a flag given
wins); plain ``arq worker.WorkerSettings`` builds it from the environment alone
(``config_from_env``) when arq asks for its settings. Either way every value is concrete:
nothing after start-up reads the environment again. arq's settings (``worker/settings.py``),
the start-up hook (``worker/hooks.py``) and ``StreamqWorker`` all read this one object.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from streamq.broker.durability import durable_ends_from_env
from streamq.broker.memory_policy import allow_evicting_from_env
from streamq.broker.replay_log import log_limits_from_env
from streamq.env_vars import ENGINE_FACTORY_ENV, KEEP_RESULT_ENV
from streamq.environment import drain_seconds_from_env, events_url_from_env, queue_from_env, redis_url_from_env
from streamq.protocol.names import (
    DEFAULT_CHECKPOINT_TOKENS,
    DEFAULT_DRAIN_SECONDS,
    DEFAULT_DURABLE_ENDS,
    DEFAULT_DURABLE_ENDS_TIMEOUT_S,
    DEFAULT_KEEP_RESULT_S,
    DEFAULT_QUEUE,
    DEFAULT_REDIS_URL,
    LOG_MAXLEN,
    LOG_TTL_MS,
)
from worker.callbacks import CallbackPolicy, secret_from_env
from worker.delivery import checkpoint_tokens_from_env
from worker.metrics import DEFAULT_METRICS_PORT, metrics_port_from_env
from worker.publisher import coalesce_from_env
from worker.scheduling import DEFAULT_CPU_NICE, cpu_nice_from_env

if TYPE_CHECKING:
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.entrypoints.openai.models.protocol import LoRAModulePath

    from worker.chat_parsing import ParserFlags
    from worker.shared_slots import SharedSlots

T = TypeVar("T")

CONFIG_KEY = "streamq_config"
"""The key of ``WorkerConfig`` in the ``ctx`` arq is given."""

DEFAULT_JOB_TIMEOUT_S = 3600
"""Long generations are normal; arq's 300 s default would kill them."""


@dataclass(frozen=True)
class FrontEndSeat:
    """One front end's place beside its siblings on an engine core that another process
    started (``python -m worker --front-ends N``): what ``vllm serve --api-server-count N``
    gives each API server."""

    index: int
    count: int
    client_config: dict[str, Any]
    """vLLM's client addresses: the ZMQ listeners bound for this front end, and the DP
    coordinator's or tensor queue's, where the engine has them."""
    slots: SharedSlots
    """The engine's request slots, shared with the siblings."""
    ready: Any
    """A ``multiprocessing.Event`` the front end sets once it serves: until every front
    end has, a death fails the whole worker's start."""


@dataclass(frozen=True)
class WorkerConfig:
    """Everything a worker runs with, each value concrete (a default here is the built-in
    one, not "read the environment": ``config_from_env`` and the command line do that)."""

    redis_url: str = DEFAULT_REDIS_URL
    events_redis_url: str | None = None
    """The data plane's Redis Cluster; ``None``: the control plane's Redis carries it."""
    queue: str = DEFAULT_QUEUE
    """The queue this worker takes jobs from and registers for its model."""
    drain_seconds: int = DEFAULT_DRAIN_SECONDS
    job_timeout_s: float = DEFAULT_JOB_TIMEOUT_S
    """A hard limit on one job's run (``--job-timeout``)."""
    keep_result_s: float = DEFAULT_KEEP_RESULT_S
    max_jobs: int | None = None
    """Requests run at once (``--max-jobs``); ``None``: the engine's ``max_num_seqs``."""
    engine_queue: int | None = None
    """Requests held waiting inside the engine beyond those (``--engine-queue``); ``None``: a
    batch's worth (``worker.engine.default_engine_queue``), none with ``--max-jobs``."""
    engine_args: AsyncEngineArgs | None = None
    """vLLM's engine arguments; ``None`` only with ``engine_factory`` (which is handed them)."""
    engine_factory: str | None = None
    """``module:callable`` building the engine instead of vLLM's ``AsyncLLM``."""
    metrics_port: int = DEFAULT_METRICS_PORT
    """0: no metrics endpoint."""
    cpu_nice: int = DEFAULT_CPU_NICE
    allow_evicting_redis: bool = False
    """Start under a Redis ``maxmemory-policy`` that evicts any key (``--allow-evicting-redis``)."""
    log_ttl_ms: int = LOG_TTL_MS
    log_maxlen: int = LOG_MAXLEN
    coalesce: bool = True
    """Merge a request's DELTAs waiting behind a batch in flight into one chunk event."""
    checkpoint_tokens: int = DEFAULT_CHECKPOINT_TOKENS
    """Tokens per checkpoint of a request that is not streamed."""
    durable_ends: str = DEFAULT_DURABLE_ENDS
    """What an end waits for before anyone is told (``--durable-ends``:
    ``streamq.broker.durability.DurabilitySpec``, parsed by the start-up hook)."""
    durable_ends_timeout_s: float = DEFAULT_DURABLE_ENDS_TIMEOUT_S
    """The longest one wait for an end's replicas blocks (``--durable-ends-timeout-s``)."""
    callback_tries: int = CallbackPolicy.tries
    callback_backoff_s: float = CallbackPolicy.backoff_s
    callback_timeout_s: float = CallbackPolicy.timeout_s
    callback_secret: str | None = None
    """The HMAC key of completion callbacks (``$STREAMQ_CALLBACK_SECRET``); ``None``: unsigned."""
    front_end: FrontEndSeat | None = None
    """Set in a front end of ``--front-ends N``: the engine core is the parent's."""
    parsers: ParserFlags | None = None
    """``vllm serve``'s tool-call flags (``None``: none, as without them)."""
    lora_modules: list[LoRAModulePath] | None = None
    """``vllm serve``'s ``--lora-modules``: adapters loaded at start-up (needs ``--enable-lora``)."""


def keep_result_from_env(environ: Mapping[str, str] = os.environ) -> float:
    """``$STREAMQ_KEEP_RESULT_S``: seconds arq keeps a finished job's result (default an hour)."""
    value = float(environ.get(KEEP_RESULT_ENV) or DEFAULT_KEEP_RESULT_S)
    if value < 0:
        raise ValueError(f"${KEEP_RESULT_ENV} must be >= 0, got {value:g}")
    return value


def engine_factory_from_env(environ: Mapping[str, str] = os.environ) -> str | None:
    """``$STREAMQ_ENGINE_FACTORY`` (``module:callable``), else ``None``: vLLM's ``AsyncLLM``."""
    return environ.get(ENGINE_FACTORY_ENV) or None


def config_from_env(environ: Mapping[str, str] = os.environ) -> WorkerConfig:
    """The configuration of a worker with no command line (plain ``arq worker.WorkerSettings``):
    every value from its variable, else its default; the engine's flags from
    ``$STREAMQ_ENGINE_ARGS`` unless an engine factory replaces the engine."""
    from worker.engine import engine_args_from_env  # vLLM's, imported only where it is needed

    log_maxlen, log_ttl_ms = log_limits_from_env(environ)
    factory = engine_factory_from_env(environ)
    return WorkerConfig(
        redis_url=redis_url_from_env(environ),
        events_redis_url=events_url_from_env(environ),
        queue=queue_from_env(environ),
        drain_seconds=drain_seconds_from_env(environ),
        keep_result_s=keep_result_from_env(environ),
        engine_args=None if factory else engine_args_from_env(environ),
        engine_factory=factory,
        metrics_port=metrics_port_from_env(environ),
        cpu_nice=cpu_nice_from_env(environ),
        allow_evicting_redis=allow_evicting_from_env(environ),
        log_ttl_ms=log_ttl_ms,
        log_maxlen=log_maxlen,
        coalesce=coalesce_from_env(environ),
        checkpoint_tokens=checkpoint_tokens_from_env(environ),
        durable_ends=durable_ends_from_env(environ),
        callback_secret=secret_from_env(environ),
    )


def config_of(ctx: Mapping[str, Any]) -> WorkerConfig:
    """The configuration in arq's ``ctx`` (``worker.settings.arq_settings`` puts it there)."""
    return held_in(ctx, CONFIG_KEY, WorkerConfig, "")


def held_in(ctx: Mapping[str, Any], key: str, kind: type[T], made_by: str) -> T:
    """What arq's ``ctx`` holds at ``key``, of type ``kind``; else a ``RuntimeError`` saying how
    a worker is run (``made_by``: what puts it there, said after)."""
    value = ctx.get(key)
    if not isinstance(value, kind):
        raise RuntimeError(
            f"arq's ctx holds no {kind.__name__} ({key!r}): run the worker with worker.WorkerSettings "
            f"or python -m worker{made_by}"
        )
    return value
