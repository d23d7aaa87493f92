"""What ``python -m worker`` tells the start-up hook beyond arq's own settings."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vllm.engine.arg_utils import AsyncEngineArgs

OPTIONS_KEY = "streamq_options"
"""The key of ``WorkerOptions`` in the ``ctx`` arq is given."""


@dataclass(frozen=True)
class WorkerOptions:
    """Start-up options; ``None`` means the environment's value (or the default), as
    under ``arq worker.WorkerSettings``, which passes none."""

    engine_args: AsyncEngineArgs | None = None
    engine_factory: str | None = None
    """``module:callable`` building the engine instead of vLLM's ``AsyncLLM``."""
    metrics_port: int | None = None
    cpu_nice: int | None = None
    queue_name: str | None = None
    events_redis_url: str | None = None
    """The data plane's Redis Cluster; ``None``: ``$STREAMQ_EVENTS_REDIS_URL``, else the
    control plane's Redis."""
    """The queue this worker registers for its model."""
    log_ttl_ms: int | None = None
    log_maxlen: int | None = None
    coalesce: bool | None = None
    """Merge a request's DELTAs waiting behind a batch in flight into one chunk event."""
    callback_tries: int | None = None
    callback_backoff_s: float | None = None
    callback_timeout_s: float | None = None


def options_of(ctx: Mapping[str, Any]) -> WorkerOptions:
    """The options in arq's ``ctx``; all from the environment when none were given."""
    options = ctx.get(OPTIONS_KEY)
    return options if isinstance(options, WorkerOptions) else WorkerOptions()
