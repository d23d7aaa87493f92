"""A vLLM general plugin for a LoRA worker's engine: each adapter load logged, and the CPU
build's LoRA kernels mended.

vLLM runs the model in processes it spawns (the engine core, its workers); a general plugin
(``pyproject.toml``) is what vLLM loads in each of them. It acts only where a worker asked
for it (``LORA_PLUGIN_ENV``, set by the worker before its engine starts, inherited by the
engine's processes): ``vllm serve`` in the same environment is left as it is.

- **Loads logged.** The engine keeps ``--max-cpu-loras`` adapters loaded and reads any other
  from disk when a request needs it, least recently used out: a load costs a request its
  first token's time, and routing by adapter exists to avoid it. Each load is logged in the
  worker's log (``LOAD_LINE``: the adapter's name), where an operator sees thrashing and the
  benchmark counts loads.
- **The CPU mend.** vLLM marks a token that runs under no adapter with the LoRA index -1.
  The GPU kernels skip such tokens; the CPU build's torch ops
  (``vllm/lora/ops/torch_ops/lora_ops.py``) index the stacked weights with it, and -1 picks
  the last slot: a base-model request that shares a batch with adapter requests gets an
  adapter applied (its greedy text equals an adapter's). A streamq worker serves the base
  model and its adapters together, so every mixed batch would hit it. The mend zeroes those
  tokens' inputs before the ops run (an input of zeros adds nothing), with the index
  clamped to a valid slot.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import Any, Final

from streamq.env_vars import LORA_PLUGIN_ENV

LOAD_LINE: Final = "LoRA adapter loaded from disk"
"""Logged (with the adapter's name and path) each time the engine loads an adapter."""
_OPS: Final = ("bgmv_shrink", "bgmv_expand", "bgmv_expand_slice")


def ask_for_plugin() -> None:
    """Have the engine this process starts (and the processes it spawns) use this plugin."""
    os.environ[LORA_PLUGIN_ENV] = "1"


def register() -> None:
    """vLLM's general-plugin hook: log loads, and mend the ops on the CPU platform, if a
    worker asked for it."""
    if os.environ.get(LORA_PLUGIN_ENV) != "1":
        return
    log_loads()
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        mend_torch_ops()


def log_loads() -> None:
    """Wrap vLLM's adapter load (``WorkerLoRAManager._load_adapter``, which reads an adapter
    from disk into the cache) to log each one. Idempotent."""
    from vllm.logger import init_logger
    from vllm.lora.worker_manager import WorkerLoRAManager

    # In vLLM's namespace: vLLM sets up its loggers in the processes it spawns, no one else's.
    logger = init_logger("vllm.streamq.lora")
    load = WorkerLoRAManager._load_adapter
    if getattr(load, "_streamq_logged", False):
        return

    @functools.wraps(load)
    def logged(self: Any, lora_request: Any) -> Any:
        model = load(self, lora_request)
        logger.info("%s: %s (%s)", LOAD_LINE, lora_request.lora_name, lora_request.lora_path)
        return model

    logged._streamq_logged = True  # type: ignore[attr-defined]
    WorkerLoRAManager._load_adapter = logged  # type: ignore[method-assign]


def mend_torch_ops() -> None:
    """Wrap the bgmv ops where vLLM calls them: the ops module (its sgmv ops call them
    through it) and the CPU punica wrapper (which imported them by name). Idempotent."""
    from vllm.lora.ops.torch_ops import lora_ops
    from vllm.lora.punica_wrapper import punica_cpu

    for name in _OPS:
        op = getattr(lora_ops, name)
        if getattr(op, "_streamq_mended", False):
            continue
        mended = _without_negative_indices(op)
        setattr(lora_ops, name, mended)
        if hasattr(punica_cpu, name):
            setattr(punica_cpu, name, mended)


def _without_negative_indices(op: Callable[..., Any]) -> Callable[..., Any]:
    """``op(inputs, weights, output, indices, ...)`` where a token of index -1 contributes zero."""
    import torch

    @functools.wraps(op)
    def mended(
        inputs: torch.Tensor, weights: torch.Tensor, output: torch.Tensor, indices: torch.Tensor, *rest: Any, **kw: Any
    ) -> Any:
        none = indices < 0
        if none.shape[0] == inputs.shape[0] and bool(none.any()):
            inputs = inputs.masked_fill(none.unsqueeze(-1), 0)
            indices = indices.clamp(min=0)
        return op(inputs, weights, output, indices, *rest, **kw)

    mended._streamq_mended = True  # type: ignore[attr-defined]
    return mended
