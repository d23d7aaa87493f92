"""The worker registry in Redis: which models have live workers, on which queues.

Workers announce themselves (``worker/presence.py`` renews the announcement every few
seconds); producers read it to route a request by model name. Liveness is judged on
Redis's clock (``TIME`` inside the scripts), so clock skew between machines cannot make
a live worker look dead or a dead one live. Key names and formats: ``streamq.protocol``
and PROTOCOL.md.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import msgspec
from redis.asyncio import Redis

from streamq.broker.replies import as_text
from streamq.protocol import (
    MODELS_KEY,
    WORKER_TTL_MS,
    WORKERS_KEY,
    WorkerRegistration,
    decode_registration,
    encode_registration,
)
from streamq.protocol.names import MODELS_SEEN_KEY, QUEUE_MODELS_KEY
from streamq.protocol.script_calls import ReadRegistry, RegisterWorker
from streamq.protocol.scripts import Script

logger = logging.getLogger("streamq.registry")

DEFAULT_SLOTS = 64
"""The slots counted for a live worker whose registration names none."""


@dataclass(frozen=True)
class Routes:
    """A snapshot of the registry: live workers, and every model ever seen."""

    workers: list[WorkerRegistration]
    known_models: dict[str, str]
    """Model name -> queue, for every model a worker ever registered."""
    seen_ms: dict[str, int] = field(default_factory=dict)
    """Model name -> when (Unix ms, Redis's clock) a live worker last registered it."""
    queue_models: dict[str, str] = field(default_factory=dict)
    """Queue -> the base model its workers last registered."""
    now_ms: int = 0
    """Redis's clock when the registry was read."""

    def seen_within(self, model: str, memory_s: float) -> bool:
        """Whether a live worker registered ``model`` in the last ``memory_s`` seconds."""
        seen = self.seen_ms.get(model)
        return seen is not None and self.now_ms - seen <= memory_s * 1000

    def live_models(self) -> dict[str, str]:
        """Model name -> queue, for models that have at least one live worker (LoRA
        adapters included: on their base model's queue)."""
        return {name: w.queue for w in self.workers for name in w.models()}

    def adapter_queues(self) -> set[str]:
        """The queues of live workers that load LoRA adapters by name at run time."""
        return {w.queue for w in self.workers if w.loads_adapters}

    def adapter_workers(self, adapter: str, queue: str) -> list[str]:
        """The ids of the live workers on ``queue`` that may run a request for the LoRA
        adapter ``adapter``: those that list it, and those that load adapters by name. Empty
        when every live worker of the queue may (a request names who may only when it must)."""
        on_queue = [w for w in self.workers if w.queue == queue]
        able = [w.worker_id for w in on_queue if w.serves(adapter) or w.loads_adapters]
        return [] if len(able) == len(on_queue) else able

    def is_base_model(self, model: str) -> bool:
        """Whether ``model`` is a base model (not a LoRA adapter): a live worker's, or the
        one a queue's workers last registered."""
        return any(w.model == model for w in self.workers) or model in self.queue_models.values()

    def context_length(self, model: str) -> int | None:
        """The smallest ``max_model_len`` among ``model``'s live workers (a request must
        fit whichever takes it); ``None`` when none reports one."""
        lengths = [w.max_model_len for w in self.workers if w.serves(model) and w.max_model_len is not None]
        return min(lengths, default=None)

    def tasks(self, model: str) -> set[str]:
        """What ``model``'s live workers run (``generate``, ``embed``, ...: vLLM's task
        names); empty when none is live."""
        return {task for w in self.workers if w.serves(model) for task in w.engine_tasks}

    def pooled_size(self, model: str) -> int | None:
        """The most values per input a pooling request for ``model`` may return, over its
        live workers; ``None`` when none reports it."""
        return max((w.pooled_size for w in self.workers if w.serves(model) and w.pooled_size), default=None)

    def slots(self, model: str | None = None) -> int:
        """Requests the live workers of ``model`` (of every model, for ``None``) run at once,
        summed; a worker that reports no ``slots`` counts ``DEFAULT_SLOTS``."""
        return sum(w.slots or DEFAULT_SLOTS for w in self.workers if model is None or w.serves(model))


class WorkerRegistry:
    """Registers workers and reads which models are served where."""

    def __init__(self, redis: Redis) -> None:
        self._register = Script(redis, RegisterWorker)
        self._read = Script(redis, ReadRegistry)
        self._redis = redis

    async def register(self, registration: WorkerRegistration, ttl_ms: int = WORKER_TTL_MS) -> bool:
        """Announce (or renew) ``registration`` as live for ``ttl_ms`` from now. Returns
        whether it (or its models' queue) was missing: a first registration, or one that
        lapsed or that Redis evicted, restored."""
        _, restored = await self._register(
            RegisterWorker(
                workers_key=WORKERS_KEY,
                models_key=MODELS_KEY,
                models_seen_key=MODELS_SEEN_KEY,
                queue_models_key=QUEUE_MODELS_KEY,
                registration=encode_registration(registration),
                ttl_ms=ttl_ms,
                queue=registration.queue,
                models=registration.models(),
            )
        )
        return bool(restored)

    async def unregister(self, registration: WorkerRegistration) -> None:
        """Withdraw ``registration`` at once (a clean shutdown), instead of letting it lapse."""
        await self._redis.zrem(WORKERS_KEY, encode_registration(registration))

    async def routes(self) -> Routes:
        """The live workers and known models, read in one round trip."""
        call = ReadRegistry(
            workers_key=WORKERS_KEY,
            models_key=MODELS_KEY,
            models_seen_key=MODELS_SEEN_KEY,
            queue_models_key=QUEUE_MODELS_KEY,
        )
        now, members, flat, seen, bases = await self._read(call)
        workers = []
        for member in members:
            try:
                workers.append(decode_registration(member))
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:  # written by hand, or a newer protocol
                logger.warning("ignoring a malformed worker registration %r: %s", member[:200], exc)
        known = {as_text(k): as_text(v) for k, v in zip(flat[::2], flat[1::2], strict=True)}
        seen_ms = {as_text(k): int(float(v)) for k, v in zip(seen[::2], seen[1::2], strict=True)}
        queue_models = {as_text(k): as_text(v) for k, v in zip(bases[::2], bases[1::2], strict=True)}
        return Routes(workers=workers, known_models=known, seen_ms=seen_ms, queue_models=queue_models, now_ms=int(now))
