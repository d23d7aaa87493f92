"""The worker's engine is the engine ``vllm serve`` builds for the same flags.

vLLM defaults its scheduler limits by usage context; the worker must resolve them as
``vllm serve`` does, or "the same flags as ``vllm serve``" gives a different engine.
Resolving a configuration reads the model's config files and starts nothing.
"""

from __future__ import annotations

import dataclasses
import shlex
import warnings
from pathlib import Path
from typing import Any

import pytest

from devkit.worker_process import tiny_engine_flags
from streamq.env_vars import ENGINE_ARGS_ENV

with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)  # torch's own, raised while vLLM imports
    from vllm.config import VllmConfig
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.usage.usage_lib import UsageContext
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from worker.engine import (
        ENGINE_ARGS_ENV,
        engine_args_from_env,
        engine_args_from_namespace,
        engine_config,
        scheduler_limits,
    )
    from worker.startup import build_parser

FLAG_SETS = {
    "vLLM's defaults": [],
    # Two ranks double the context's defaults, and an engine built outside vllm serve's
    # context does not double them: this set tells the two apart on any platform.
    "two tensor-parallel ranks": ["--tensor-parallel-size", "2"],
    "limits given": ["--max-num-seqs", "48", "--max-num-batched-tokens", "1024"],
}


def worker_config(flags: list[str]) -> VllmConfig:
    """The configuration ``python -m worker <flags>`` starts its engine with."""
    return engine_config(engine_args_from_namespace(build_parser().parse_args(flags)))


def serve_config(flags: list[str]) -> VllmConfig:
    """The configuration ``vllm serve <flags>`` starts its engine with (its parser, its context)."""
    args = make_arg_parser(FlexibleArgumentParser()).parse_args(flags)
    config: VllmConfig = AsyncEngineArgs.from_cli_args(args).create_engine_config(
        usage_context=UsageContext.OPENAI_API_SERVER
    )
    return config


def fields(config: VllmConfig) -> dict[str, Any]:
    return {f.name: getattr(config.scheduler_config, f.name) for f in dataclasses.fields(config.scheduler_config)}


@pytest.mark.parametrize("extra", FLAG_SETS.values(), ids=FLAG_SETS.keys())
def test_the_worker_schedules_as_vllm_serve_does_for_the_same_flags(tiny_model: Path, extra: list[str]) -> None:
    """The same limits; the policy is priority unless given (the worker's one default of its own)."""
    flags = [*tiny_engine_flags(tiny_model), *extra]
    worker, serve = worker_config(flags), serve_config(flags)
    assert (worker.scheduler_config.policy, serve.scheduler_config.policy) == ("priority", "fcfs")
    assert {**fields(worker), "policy": "fcfs"} == fields(serve)
    given = [*flags, "--scheduling-policy", "fcfs"]
    assert fields(worker_config(given)) == fields(serve_config(given))
    assert scheduler_limits(worker_config(given)) == scheduler_limits(serve_config(given))


def test_an_engine_built_from_bare_engine_arguments_would_schedule_differently(tiny_model: Path) -> None:
    """What the test above guards against: ``AsyncLLM.from_engine_args``'s own context."""
    flags = [*tiny_engine_flags(tiny_model), *FLAG_SETS["two tensor-parallel ranks"]]
    parser = FlexibleArgumentParser()
    AsyncEngineArgs.add_cli_args(parser)
    bare = AsyncEngineArgs.from_cli_args(parser.parse_args(flags)).create_engine_config(UsageContext.ENGINE_CONTEXT)
    assert bare.scheduler_config.max_num_seqs < worker_config(flags).scheduler_config.max_num_seqs


def test_the_limits_name_what_bounds_a_batch(tiny_model: Path) -> None:
    flags = [*tiny_engine_flags(tiny_model, max_model_len=200), *FLAG_SETS["limits given"]]
    limits = scheduler_limits(worker_config(flags))
    assert (limits["max_num_seqs"], limits["max_num_batched_tokens"], limits["max_model_len"]) == (48, 1024, 200)


def test_flags_from_the_environment_give_the_engine_the_command_line_gives(
    tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``$STREAMQ_ENGINE_ARGS`` is how ``arq worker.WorkerSettings`` (no command line of
    its own) gets its engine: the same flags there resolve to the same engine."""
    flags = [*tiny_engine_flags(tiny_model, max_model_len=200), *FLAG_SETS["limits given"]]
    monkeypatch.setenv(ENGINE_ARGS_ENV, shlex.join(flags))
    from_env = engine_config(engine_args_from_env())
    assert fields(from_env) == fields(worker_config(flags))
    assert from_env.model_config.max_model_len == 200


def test_flags_from_the_environment_must_name_a_model(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENGINE_ARGS_ENV, "--max-num-seqs 4")
    with pytest.raises(SystemExit, match="must name a model"):
        engine_args_from_env()
