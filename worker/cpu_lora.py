"""A mend for vLLM's CPU LoRA kernels: a request without an adapter, batched with adapter
requests, must get no adapter.

vLLM marks a token that runs under no adapter with the LoRA index -1. The GPU kernels skip
such tokens; the CPU build's torch ops (``vllm/lora/ops/torch_ops/lora_ops.py``) index the
stacked weights with it, and -1 picks the last slot: a base-model request that shares a
batch with adapter requests gets an adapter applied (its greedy text equals an adapter's).
A streamq worker with ``--enable-lora`` serves the base model and its adapters together,
so on the CPU build every mixed batch would hit it.

The mend zeroes those tokens' inputs before the ops run (an input of zeros adds nothing),
with the index clamped to a valid slot. vLLM runs the model in its engine-core process,
which it spawns: the mend is a vLLM general plugin (``pyproject.toml``), which vLLM loads in
every process it starts, and it acts only where a worker asked for it (``MEND_ENV``, set by
the worker before its engine starts, inherited by the engine's processes) on the CPU
platform. ``vllm serve`` in the same environment is left as it is.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import Any, Final

MEND_ENV: Final = "STREAMQ_CPU_LORA_MEND"
_OPS: Final = ("bgmv_shrink", "bgmv_expand", "bgmv_expand_slice")


def ask_for_mend() -> None:
    """Have this process's engine (and the processes it spawns) mend the CPU LoRA ops."""
    os.environ[MEND_ENV] = "1"


def register() -> None:
    """vLLM's general-plugin hook: mend the ops if a worker asked for it on the CPU platform."""
    if os.environ.get(MEND_ENV) != "1":
        return
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        mend_torch_ops()


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
