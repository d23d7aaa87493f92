"""The one vLLM ``AsyncLLM`` a worker holds: its arguments, start-up and shutdown.

Engine arguments are spelled as ``vllm serve`` spells them (``--model``,
``--max-model-len``, ...), parsed by vLLM's own parser so every ``AsyncEngineArgs``
field works and means what vLLM's docs say. ``STREAMQ_ENGINE_ARGS`` holds the same
flags for deployments that configure through the environment (and for
``arq worker.WorkerSettings``, which has no command line of its own).

The engine is built the way ``vllm serve`` builds its own (usage context
``OPENAI_API_SERVER``), not with ``AsyncLLM.from_engine_args``: vLLM picks default
scheduler limits (``max_num_seqs``, ``max_num_batched_tokens``) by usage context, so the
same flags give the same engine here as behind ``vllm serve``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import shlex
import time
from collections.abc import Callable, Mapping
from typing import Any, Final

from vllm.config import VllmConfig
from vllm.config.structured_outputs import StructuredOutputsBackend
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.usage.usage_lib import UsageContext
from vllm.utils.argparse_utils import FlexibleArgumentParser
from vllm.v1.engine.async_llm import AsyncLLM

from streamq.env_vars import ENGINE_ARGS_ENV
from worker.config import FrontEndSeat
from worker.interrupt import exit_on_stop_signal
from worker.lora_plugin import ask_for_plugin

logger = logging.getLogger("streamq.worker")


USAGE_CONTEXT = UsageContext.OPENAI_API_SERVER
"""``vllm serve``'s usage context: the one whose defaults the worker's engine gets."""


DEFAULT_SCHEDULING_POLICY: Final = "priority"
"""The worker's ``--scheduling-policy`` when none is given (``vllm serve``'s is ``fcfs``):
the requests waiting in a worker's engine (``--engine-queue``) were claimed in the queue's
order, and a more urgent request claimed after them must not wait behind them. Between
requests of one priority it is first come, first served, as ``fcfs``."""


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Add every ``AsyncEngineArgs`` flag, as ``vllm serve`` has them, to ``parser``;
    ``--structured-outputs-config`` without a backend means the worker's default one, and
    ``--scheduling-policy`` defaults to ``DEFAULT_SCHEDULING_POLICY``."""
    AsyncEngineArgs.add_cli_args(parser)  # type: ignore[arg-type]
    parser.set_defaults(scheduling_policy=DEFAULT_SCHEDULING_POLICY)
    for action in parser._actions:
        if action.dest == "structured_outputs_config" and callable(action.type):
            action.type = _with_default_backend(action.type)


def engine_args_from_namespace(namespace: argparse.Namespace) -> AsyncEngineArgs:
    """Build ``AsyncEngineArgs`` from a namespace parsed with ``add_engine_args``."""
    args: AsyncEngineArgs = AsyncEngineArgs.from_cli_args(namespace)
    return with_structured_outputs_backend(args, tools=bool(getattr(namespace, "tool_call_parser", None)))


DEFAULT_STRUCTURED_OUTPUTS_BACKEND: Final[StructuredOutputsBackend] = "guidance"
"""The structured-outputs backend (llguidance) when the flags leave vLLM's ``auto``.

``auto`` picks a backend per request (xgrammar, else guidance), but the engine compiles
every request with the backend of the first one it saw, so a schema that fell back to
guidance can be compiled by xgrammar without its constraint. And xgrammar 0.2.8 lets a
string with ``maxLength``/``minLength`` hold raw control characters: output that is not
JSON. One backend, llguidance, gives valid JSON for both; ``--structured-outputs-config.backend
xgrammar`` (or ``outlines``) chooses another."""

TOOLS_STRUCTURED_OUTPUTS_BACKEND: Final[StructuredOutputsBackend] = "xgrammar"
"""The backend instead with ``--tool-call-parser``: the grammar of a named or required tool
choice is a structural tag, which only xgrammar compiles (what ``vllm serve``'s ``auto``
picks for it)."""


def with_structured_outputs_backend(args: AsyncEngineArgs, *, tools: bool = False) -> AsyncEngineArgs:
    """``args`` with ``DEFAULT_STRUCTURED_OUTPUTS_BACKEND`` (``TOOLS_STRUCTURED_OUTPUTS_BACKEND``
    for a worker that parses ``tools``) in place of ``auto``."""
    config = args.structured_outputs_config
    if config.backend == "auto":
        backend = TOOLS_STRUCTURED_OUTPUTS_BACKEND if tools else DEFAULT_STRUCTURED_OUTPUTS_BACKEND
        args.structured_outputs_config = dataclasses.replace(config, backend=backend)
    return args


def _with_default_backend(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """``parse`` (vLLM's ``--structured-outputs-config`` parser), given JSON that names
    ``DEFAULT_STRUCTURED_OUTPUTS_BACKEND`` where it names none.

    vLLM validates the options against the backend as it parses, so without this
    ``{"disable_any_whitespace": true}`` would be refused for ``auto``, a backend the
    worker never runs."""

    def parse_with_default(value: str) -> Any:
        try:
            options = json.loads(value)
        except json.JSONDecodeError:
            return parse(value)  # vLLM's own parser says what is wrong with it
        if isinstance(options, dict) and "backend" not in options:
            value = json.dumps({"backend": DEFAULT_STRUCTURED_OUTPUTS_BACKEND, **options})
        return parse(value)

    return parse_with_default


def engine_args_from_env(environ: Mapping[str, str] = os.environ) -> AsyncEngineArgs:
    """Build ``AsyncEngineArgs`` from the flags in ``$STREAMQ_ENGINE_ARGS``."""
    flags = environ.get(ENGINE_ARGS_ENV, "")
    if "--model" not in flags:
        raise SystemExit(f"{ENGINE_ARGS_ENV} must name a model, e.g. --model Qwen/Qwen2.5-0.5B-Instruct")
    parser = FlexibleArgumentParser()
    add_engine_args(parser)
    return engine_args_from_namespace(parser.parse_args(shlex.split(flags)))


def engine_config(engine_args: AsyncEngineArgs) -> VllmConfig:
    """The engine's whole configuration, resolved as ``vllm serve`` resolves it.

    Resolving fills the unset fields of ``engine_args`` in place, so build the
    arguments afresh for each call. With LoRA on, the engine processes started after
    this log adapter loads and mend the CPU build's LoRA kernels (``worker/lora_plugin.py``).
    """
    if engine_args.enable_lora:
        ask_for_plugin()
    config: VllmConfig = engine_args.create_engine_config(usage_context=USAGE_CONTEXT)
    return config


def scheduler_limits(config: VllmConfig) -> dict[str, object]:
    """What bounds the engine's batches and streaming, by vLLM's own names."""
    scheduler = config.scheduler_config
    return {
        "max_num_seqs": scheduler.max_num_seqs,
        "max_num_batched_tokens": scheduler.max_num_batched_tokens,
        "max_model_len": config.model_config.max_model_len,
        "enable_chunked_prefill": scheduler.enable_chunked_prefill,
        "long_prefill_token_threshold": scheduler.long_prefill_token_threshold,
        "async_scheduling": scheduler.async_scheduling,
        "stream_interval": scheduler.stream_interval,
        "policy": scheduler.policy,
        "enable_prefix_caching": config.cache_config.enable_prefix_caching,
    }


def log_scheduler_limits(config: VllmConfig) -> None:
    logger.info("scheduler limits: %s", " ".join(f"{k}={v}" for k, v in scheduler_limits(config).items()))


def start_engine(engine_args: AsyncEngineArgs, seat: FrontEndSeat | None = None) -> AsyncLLM:
    """Start the engine; call from inside the event loop it will serve (AsyncLLM is
    bound to the loop it starts on). With a ``seat``, connect to the engine core another
    process started, as one of its front ends.

    The keyword arguments are those ``vllm serve`` passes
    (``build_async_engine_client_from_engine_args``). The load blocks the event loop, on
    which arq's SIGTERM handler runs: SIGTERM or SIGINT during it exits the process at once
    (``worker/interrupt.py``)."""
    started = time.monotonic()
    client: dict[str, Any] = {}
    if seat is not None:
        engine_args._api_process_count = seat.count
        engine_args._api_process_rank = seat.index
        client = {"client_addresses": dict(seat.client_config), "client_count": seat.count, "client_index": seat.index}
    with exit_on_stop_signal():
        config = engine_config(engine_args)
        log_scheduler_limits(config)
        logger.info("structured outputs backend: %s", config.structured_outputs_config.backend)
        engine = AsyncLLM.from_vllm_config(
            vllm_config=config,
            usage_context=USAGE_CONTEXT,
            enable_log_requests=engine_args.enable_log_requests,
            aggregate_engine_logging=engine_args.aggregate_engine_logging,
            disable_log_stats=engine_args.disable_log_stats,
            **client,
        )
    logger.info(
        "model loaded: %s (max_model_len=%d, max_num_seqs=%d) in %.1fs",
        config.model_config.model,
        config.model_config.max_model_len,
        config.scheduler_config.max_num_seqs,
        time.monotonic() - started,
    )
    if config.scheduler_config.policy != "priority":
        logger.info(
            "scheduling policy %s: request priorities order the queue only (the engine is passed "
            "priority 0), and a more urgent request waits in the engine behind those claimed before "
            "it; --scheduling-policy priority (the worker's default) lets it go first",
            config.scheduler_config.policy,
        )
    return engine


TAKE_OVER_PRIORITY: Final = -(2**31)
"""The engine priority of a taken-over request: ahead of any the engine has waiting."""


def engine_priority(engine: AsyncLLM, priority: int, *, taken_over: bool = False) -> int:
    """The priority to pass ``engine.generate``: the request's under vLLM's ``priority``
    scheduling policy, or for a request ``taken_over`` from another attempt (its subscriber
    waits mid-stream, and the claim took it ahead of every queued job) one ahead of every
    request waiting in the engine; 0 under ``fcfs``, which refuses any other (the queue has
    already ordered the request by its priority either way)."""
    if getattr(engine.vllm_config.scheduler_config, "policy", "fcfs") != "priority":
        return 0
    return TAKE_OVER_PRIORITY if taken_over else priority


def max_batch_size(engine: AsyncLLM) -> int:
    """How many requests the engine schedules at once: the natural arq ``max_jobs``."""
    return int(engine.vllm_config.scheduler_config.max_num_seqs)


def default_engine_queue(batch: int) -> int:
    """How many requests a worker holds waiting inside its engine beyond its ``batch``, by
    default: a whole batch, so that when a wave of requests ends in one engine step the
    next wave is already in the engine's queue and starts in that step, as offline
    ``LLM.generate`` keeps every request there. The claim takes them only where no other
    worker has room (``claim_jobs.lua``), and the worker schedules by priority
    (``--scheduling-policy priority``), so a more urgent request arriving later waits
    behind none of them."""
    return batch
