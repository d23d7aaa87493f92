"""The one vLLM ``AsyncLLM`` a worker holds: its arguments, start-up and shutdown.

Engine arguments are spelled as ``vllm serve`` spells them (``--model``,
``--max-model-len``, ...), parsed by vLLM's own parser so every ``AsyncEngineArgs``
field works and means what vLLM's docs say. ``STREAMQ_ENGINE_ARGS`` holds the same
flags for deployments that configure through the environment (and for
``arq worker.WorkerSettings``, which has no command line of its own).
"""

from __future__ import annotations

import argparse
import logging
import os
import shlex
import time

from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.utils.argparse_utils import FlexibleArgumentParser
from vllm.v1.engine.async_llm import AsyncLLM

logger = logging.getLogger("streamq.worker")

ENGINE_ARGS_ENV = "STREAMQ_ENGINE_ARGS"


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Add every ``AsyncEngineArgs`` flag, as ``vllm serve`` has them, to ``parser``."""
    AsyncEngineArgs.add_cli_args(parser)  # type: ignore[arg-type]


def engine_args_from_namespace(namespace: argparse.Namespace) -> AsyncEngineArgs:
    """Build ``AsyncEngineArgs`` from a namespace parsed with ``add_engine_args``."""
    args: AsyncEngineArgs = AsyncEngineArgs.from_cli_args(namespace)
    return args


def engine_args_from_env() -> AsyncEngineArgs:
    """Build ``AsyncEngineArgs`` from the flags in ``$STREAMQ_ENGINE_ARGS``."""
    flags = os.environ.get(ENGINE_ARGS_ENV, "")
    if "--model" not in flags:
        raise SystemExit(f"{ENGINE_ARGS_ENV} must name a model, e.g. --model Qwen/Qwen2.5-0.5B-Instruct")
    parser = FlexibleArgumentParser()
    add_engine_args(parser)
    return engine_args_from_namespace(parser.parse_args(shlex.split(flags)))


def start_engine(engine_args: AsyncEngineArgs) -> AsyncLLM:
    """Start the engine; call from inside the event loop it will serve (AsyncLLM is
    bound to the loop it starts on)."""
    started = time.monotonic()
    engine = AsyncLLM.from_engine_args(engine_args)
    config = engine.vllm_config
    logger.info(
        "model loaded: %s (max_model_len=%d, max_num_seqs=%d) in %.1fs",
        config.model_config.model,
        config.model_config.max_model_len,
        config.scheduler_config.max_num_seqs,
        time.monotonic() - started,
    )
    return engine


def max_batch_size(engine: AsyncLLM) -> int:
    """How many requests the engine schedules at once: the natural arq ``max_jobs``."""
    return int(engine.vllm_config.scheduler_config.max_num_seqs)
