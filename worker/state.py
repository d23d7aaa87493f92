"""What a worker process shares between arq's loop, its job functions and its
background parts (jobs get copies of arq's ctx, so one object carries it)."""

from __future__ import annotations

import logging
import os
import signal
import socket
import time
import uuid
from collections.abc import Mapping
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from streamq.broker.replay_log import ReplayLog
from streamq.protocol.names import DEFAULT_CHECKPOINT_TOKENS
from worker.callbacks import CallbackSender
from worker.cancel import CancelListener
from worker.config import held_in
from worker.lease import Leases
from worker.presence import Presence
from worker.publisher import EventPublisher
from worker.stats_report import RunningRequests

if TYPE_CHECKING:
    from worker.adapters import Adapters
    from worker.chat_parsing import ChatParsing

logger = logging.getLogger("streamq.worker")


def new_worker_id() -> str:
    """A name for this worker process, unique across machines and restarts."""
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


class RedisClock:
    """Redis's time as seen from this worker: deadlines and waits are measured on the
    clock that scored the queue, never on a clock that may differ between machines."""

    def __init__(self) -> None:
        self.offset_ms = 0.0
        """Redis's clock minus the worker's own, from the latest claim round trip."""

    def observe(self, redis_ms: int, asked_at_ms: int, answered_at_ms: int) -> None:
        """Record Redis's time ``redis_ms``, read between the two local times given."""
        self.offset_ms = redis_ms - (asked_at_ms + answered_at_ms) / 2

    def now_ms(self) -> float:
        return time.time() * 1000 + self.offset_ms

    def seconds_since(self, moment_ms: float) -> float:
        """Seconds from ``moment_ms`` (Unix ms on Redis's clock, as a job's queue score
        is) until now."""
        return (self.now_ms() - moment_ms) / 1000


ENGINE_DEAD_EXIT_CODE = 3
"""A worker's exit code when its engine died: a supervisor should start it again."""

STATE_KEY = "streamq_state"
"""The key of ``WorkerState`` in arq's ``ctx``."""


@dataclass(kw_only=True, eq=False)
class WorkerState:
    """The worker's shared parts and flags, built by the start-up hook."""

    worker_id: str
    """This worker's name, written into the leases it holds."""
    engine: Any
    """vLLM's ``AsyncLLM``, or an object of the same interface."""
    replay_log: ReplayLog
    cancels: CancelListener
    publisher: EventPublisher
    leases: Leases
    presence: Presence
    callbacks: CallbackSender | None = None
    """Sends completion callbacks; ``None`` in a state built without one."""
    checkpoint_tokens: int = DEFAULT_CHECKPOINT_TOKENS
    """Tokens per checkpoint of a request that is not streamed (``worker/delivery.py``)."""
    chat_parsing: ChatParsing | None = None
    """vLLM's renderer for chat requests with tools and the tool and reasoning parsers the
    worker's flags name; ``None`` for an engine without vLLM's renderer (a scripted one)."""
    adapters: Adapters | None = None
    """The LoRA adapters served beside the base model; ``None`` without ``--enable-lora``."""
    closing: AsyncExitStack = field(default_factory=AsyncExitStack)
    """Stops the parts started with this state, last started first (the start-up hook fills it)."""
    clock: RedisClock = field(default_factory=RedisClock)
    engine_dead: bool = False
    running: RunningRequests = field(default_factory=RunningRequests)
    """The requests running here now, with their progress, for the stats report."""
    ended_jobs: set[str] = field(default_factory=set)
    """Jobs whose request is done here (its events delivered) while arq's bookkeeping of
    them runs: their slots count as free for the routing of prefix-aware pickup, since a
    conversation's next turn arrives as soon as its client has the final event."""

    def engine_died(self) -> None:
        """Hand every running job back and stop this worker (``ENGINE_DEAD_EXIT_CODE``): it can
        serve nothing more, and another worker can take its jobs over."""
        if not self.engine_dead:
            self.engine_dead = True
            logger.critical("the engine died: handing running jobs back and stopping")
            self.cancels.cancel_all()
            os.kill(os.getpid(), signal.SIGTERM)

    async def close(self) -> None:
        """Stop every part, last started first; the engine shuts down last."""
        await self.closing.aclose()


def state_of(ctx: Mapping[str, Any]) -> WorkerState:
    """The ``WorkerState`` in arq's ``ctx``."""
    return held_in(ctx, STATE_KEY, WorkerState, ", whose start-up hook (worker.hooks.on_startup) builds it")
