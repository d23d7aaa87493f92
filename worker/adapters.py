"""LoRA adapters a worker serves beside its base model, as ``vllm serve`` serves them.

Each adapter is a model: a request names it in ``model`` and runs with its
``LoRARequest``. The worker takes ``vllm serve``'s flags (``--enable-lora`` and the
limits are engine arguments; ``--lora-modules`` is parsed by vLLM's own action) and
loads each listed adapter at start-up, as ``vllm serve`` does: one that cannot be loaded
stops the start. A name the worker does not list is asked of vLLM's LoRA resolvers
(plugins such as ``lora_filesystem_resolver`` with ``$VLLM_LORA_RESOLVER_CACHE_DIR``), in
the order vLLM registered them; one found is loaded into the engine and served from then
on, and listed in the worker's registration. The engine keeps at most ``--max-loras``
adapters in a batch and ``--max-cpu-loras`` loaded, least recently used out.

Adapter ids are derived from the name, not counted: the front ends of one engine core
(``--front-ends``) load adapters independently, and must give each the same id.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from vllm.entrypoints.openai.models.protocol import LoRAModulePath
from vllm.lora.request import LoRARequest
from vllm.lora.resolver import LoRAResolverRegistry

from streamq.protocol import AdapterCard, InvalidRequest

logger = logging.getLogger("streamq.worker")


def adapter_id(name: str) -> int:
    """A positive 31-bit id for adapter ``name``, the same in every process."""
    return int.from_bytes(hashlib.blake2b(name.encode("utf-8"), digest_size=4).digest(), "big") % (2**31 - 1) + 1


class Adapters:
    """The adapters this worker serves: those listed at start-up, and those its resolvers
    found since. ``on_change`` is awaited with the new list when one is added (the worker
    lists it in its registration)."""

    def __init__(
        self,
        engine: Any,
        base_model: str,
        *,
        modules: Sequence[LoRAModulePath] = (),
    ) -> None:
        self._engine = engine
        self._base_model = base_model
        self._modules = list(modules)
        self._resolvers = [
            LoRAResolverRegistry.get_resolver(name) for name in LoRAResolverRegistry.get_supported_resolvers()
        ]
        self._loaded: dict[str, LoRARequest] = {}
        # One lock for every look-up: they are rare (once per adapter), and a lock per name
        # asked for would keep one for each unknown name a client sends.
        self._resolving = asyncio.Lock()
        self.on_change: Callable[[tuple[AdapterCard, ...]], Awaitable[None]] | None = None

    @property
    def loads_adapters(self) -> bool:
        """Whether a resolver may find adapters this worker does not list."""
        return bool(self._resolvers)

    def cards(self) -> tuple[AdapterCard, ...]:
        """The adapters served, as the registration lists them."""
        return tuple(AdapterCard(name=r.lora_name, path=r.lora_path) for r in self._loaded.values())

    async def load_listed(self) -> None:
        """Load every ``--lora-modules`` adapter into the engine; raises ``ValueError`` for one
        that cannot be loaded (as ``vllm serve`` refuses to start)."""
        for module in self._modules:
            if module.name == self._base_model:
                raise ValueError(f"the LoRA adapter {module.name!r} conflicts with the served base model")
            request = LoRARequest(
                lora_name=module.name,
                lora_int_id=adapter_id(module.name),
                lora_path=module.path,
                is_3d_lora_weight=module.is_3d_lora_weight,
            )
            try:
                await self._engine.add_lora(request)
            except Exception as exc:
                raise ValueError(f"cannot load LoRA adapter {module.name!r} from {module.path}: {exc}") from exc
            self._loaded[module.name] = request
            logger.info("loaded LoRA adapter %r from %s", module.name, module.path)

    async def request_for(self, model: str) -> LoRARequest:
        """The ``LoRARequest`` of adapter ``model``, loading it through the resolvers the
        first time; raises ``InvalidRequest`` with vLLM's words when none finds or loads it."""
        if model in self._loaded:
            return self._loaded[model]
        if not self._resolvers:
            raise InvalidRequest(f"The model `{model}` does not exist.")
        async with self._resolving:
            if model in self._loaded:
                return self._loaded[model]
            found = False
            for resolver in self._resolvers:
                request = await resolver.resolve_lora(self._base_model_path(), model)
                if request is None:
                    continue
                found = True
                request.lora_int_id = adapter_id(model)
                try:
                    await self._engine.add_lora(request)
                except Exception as exc:  # vLLM tries the next resolver
                    logger.warning("cannot load LoRA adapter %r found by %s: %s", model, type(resolver).__name__, exc)
                    continue
                self._loaded[model] = request
                logger.info("loaded LoRA adapter %r from %s", model, request.lora_path)
                if self.on_change is not None:
                    await self.on_change(self.cards())
                return request
        if found:
            raise InvalidRequest(f"LoRA adapter '{model}' was found but could not be loaded.")
        raise InvalidRequest(f"LoRA adapter {model} does not exist")

    def _base_model_path(self) -> str:
        """The base model as resolvers match it: the engine's ``--model`` (what an adapter's
        ``base_model_name_or_path`` names), as vllm serve passes it."""
        config = getattr(getattr(self._engine, "vllm_config", None), "model_config", None)
        return str(getattr(config, "model", self._base_model))
