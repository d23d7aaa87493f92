"""What ``python -m worker`` tells the start-up hook beyond arq's own settings."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.entrypoints.openai.models.protocol import LoRAModulePath

    from worker.chat_parsing import ParserFlags
    from worker.shared_slots import SharedSlots

OPTIONS_KEY = "streamq_options"
"""The key of ``WorkerOptions`` in the ``ctx`` arq is given."""


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
class WorkerOptions:
    """Start-up options; ``None`` means the environment's value (or the default), as
    under ``arq worker.WorkerSettings``, which passes none."""

    engine_args: AsyncEngineArgs | None = None
    engine_factory: str | None = None
    """``module:callable`` building the engine instead of vLLM's ``AsyncLLM``."""
    metrics_port: int | None = None
    max_jobs: int | None = None
    """Requests run at once (``--max-jobs``); ``None``: the engine's ``max_num_seqs``."""
    engine_queue: int | None = None
    """Requests held waiting inside the engine beyond those (``--engine-queue``); ``None``: a
    batch's worth (``worker.engine.default_engine_queue``), none with ``--max-jobs``."""
    cpu_nice: int | None = None
    allow_evicting_redis: bool | None = None
    """Start under a Redis ``maxmemory-policy`` that evicts any key (``--allow-evicting-redis``);
    ``None``: ``$STREAMQ_ALLOW_EVICTING_REDIS``."""
    queue_name: str | None = None
    """The queue this worker registers for its model."""
    events_redis_url: str | None = None
    """The data plane's Redis Cluster; ``None``: ``$STREAMQ_EVENTS_REDIS_URL``, else the
    control plane's Redis."""
    log_ttl_ms: int | None = None
    log_maxlen: int | None = None
    coalesce: bool | None = None
    """Merge a request's DELTAs waiting behind a batch in flight into one chunk event."""
    checkpoint_tokens: int | None = None
    """Tokens per checkpoint of a request that is not streamed."""
    durable_ends: str | None = None
    """What an end waits for before anyone is told (``--durable-ends``:
    ``streamq.broker.durability.DurabilitySpec``); ``None``: ``$STREAMQ_DURABLE_ENDS``, else ``auto``."""
    durable_ends_timeout_s: float | None = None
    """The longest an end waits (``--durable-ends-timeout-s``); ``None``: the default, 5 s."""
    callback_tries: int | None = None
    callback_backoff_s: float | None = None
    callback_timeout_s: float | None = None
    front_end: FrontEndSeat | None = None
    """Set in a front end of ``--front-ends N``: the engine core is the parent's."""
    parsers: ParserFlags | None = None
    """``vllm serve``'s tool-call flags (``None``: none, as without them)."""
    lora_modules: list[LoRAModulePath] | None = None
    """``vllm serve``'s ``--lora-modules``: adapters loaded at start-up (needs ``--enable-lora``)."""


def options_of(ctx: Mapping[str, Any]) -> WorkerOptions:
    """The options in arq's ``ctx``; all from the environment when none were given."""
    options = ctx.get(OPTIONS_KEY)
    return options if isinstance(options, WorkerOptions) else WorkerOptions()
