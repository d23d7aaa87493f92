"""``Presence``: keeps this worker in the registry while it runs.

Producers route a request by model name to the queue of that model's live workers
(``streamq/broker/registry.py``). The registration lapses ``WORKER_TTL_MS`` after the last
renewal, so a worker that dies without cleaning up (SIGKILL, lost host) drops out of
``/v1/models`` within seconds; a clean shutdown withdraws it at once.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import msgspec
from redis.asyncio import Redis

from streamq.broker.registry import WorkerRegistry
from streamq.protocol import WORKER_RENEW_S, AdapterCard, WorkerRegistration
from streamq.tasks import stop_task
from worker.failure_log import RepeatedFailure

logger = logging.getLogger("streamq.worker")


def served_model_name(engine: Any) -> tuple[str, int | None]:
    """The name clients use for the engine's model (vLLM's ``--served-model-name``,
    else ``--model``), and its ``max_model_len``. A scripted engine may lack some."""
    config = getattr(getattr(engine, "vllm_config", None), "model_config", None)
    name = getattr(config, "served_model_name", None) or getattr(config, "model", None) or "unknown"
    if isinstance(name, list):  # vLLM resolves aliases to the first; a scripted engine may not
        name = name[0]
    max_len = getattr(config, "max_model_len", None)
    return str(name), int(max_len) if isinstance(max_len, int) else None


class Presence:
    """Registers the worker now and renews the registration every ``WORKER_RENEW_S``."""

    def __init__(
        self,
        redis: Redis,
        *,
        worker_id: str,
        model: str,
        queue: str,
        max_model_len: int | None = None,
        slots: int | None = None,
        adapters: tuple[AdapterCard, ...] = (),
        loads_adapters: bool = False,
        tasks: tuple[str, ...] = (),
        pooled_size: int | None = None,
    ) -> None:
        self.registration = WorkerRegistration(
            worker_id=worker_id,
            model=model,
            queue=queue,
            max_model_len=max_model_len,
            slots=slots,
            adapters=adapters,
            loads_adapters=loads_adapters,
            tasks=tasks,
            pooled_size=pooled_size,
        )
        self._registry = WorkerRegistry(redis)
        self._task: asyncio.Task[None] | None = None
        self._failures = RepeatedFailure(logger, "renewing the worker registration")

    async def start(self) -> None:
        """Register before returning, so the worker is routable once start-up is done."""
        await self._registry.register(self.registration)
        logger.info("registered model %r on queue %s", self.registration.model, self.registration.queue)
        self._task = asyncio.create_task(self._renew(), name="presence")

    async def list_adapters(self, adapters: tuple[AdapterCard, ...]) -> None:
        """Register anew with ``adapters`` (one loaded at run time), and withdraw the
        registration that lacked them: producers route to it from now on."""
        before = self.registration
        self.registration = msgspec.structs.replace(before, adapters=adapters)
        try:
            await self._registry.register(self.registration)
            await self._registry.unregister(before)
        except Exception as exc:  # renewed within WORKER_RENEW_S; the old one lapses
            logger.warning("could not renew the worker registration: %s", exc)

    async def _renew(self) -> None:
        while True:
            await asyncio.sleep(WORKER_RENEW_S)
            try:
                restored = await self._registry.register(self.registration)
            except Exception as exc:  # Redis away (or full) for longer than the retries: try again next round
                self._failures.failed("could not renew the worker registration: %s", exc)
            else:
                self._failures.passed()
                if restored:  # producers refused its model meanwhile ("no worker serves model")
                    logger.warning(
                        "the worker's registration was gone from Redis (it lapsed while the worker could not "
                        "renew it, or Redis evicted it): registered again"
                    )

    async def close(self) -> None:
        """Stop renewing and withdraw the registration (best effort: it lapses anyway)."""
        await stop_task(self._task)
        try:
            await self._registry.unregister(self.registration)
        except Exception as exc:
            logger.warning("could not withdraw the worker registration: %s", exc)
