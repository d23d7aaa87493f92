"""The worker's structured-outputs backend: llguidance unless the flags choose one.

vLLM's ``auto`` compiles every request with the backend of the engine's first structured
request, and xgrammar lets length-bounded JSON strings hold raw control characters; see
``worker.engine.DEFAULT_STRUCTURED_OUTPUTS_BACKEND``.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest

from devkit.worker_process import tiny_engine_flags

with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)  # torch's own, raised while vLLM imports
    from vllm.config.structured_outputs import StructuredOutputsConfig

    from worker.engine import DEFAULT_STRUCTURED_OUTPUTS_BACKEND, engine_args_from_namespace, engine_config
    from worker.startup import build_parser


def structured_outputs_config(tiny_model: Path, *flags: str) -> StructuredOutputsConfig:
    args = engine_args_from_namespace(build_parser().parse_args([*tiny_engine_flags(tiny_model), *flags]))
    config: StructuredOutputsConfig = engine_config(args).structured_outputs_config
    return config


def backend(tiny_model: Path, *flags: str) -> str:
    return str(structured_outputs_config(tiny_model, *flags).backend)


def test_without_a_flag_the_worker_uses_llguidance(tiny_model: Path) -> None:
    assert DEFAULT_STRUCTURED_OUTPUTS_BACKEND == "guidance"
    assert backend(tiny_model) == "guidance"


@pytest.mark.parametrize(
    "flags",
    [
        ("--structured-outputs-config.backend", "xgrammar"),
        ("--structured-outputs-config", '{"backend": "xgrammar", "disable_any_whitespace": true}'),
    ],
)
def test_a_backend_the_flags_choose_is_kept(tiny_model: Path, flags: tuple[str, ...]) -> None:
    assert backend(tiny_model, *flags) == "xgrammar"


@pytest.mark.parametrize(
    "flags",
    [
        ("--structured-outputs-config", '{"disable_any_whitespace": true}'),
        ("--structured-outputs-config.disable_any_whitespace", "true"),
    ],
)
def test_an_option_without_a_backend_gets_the_default_backend(tiny_model: Path, flags: tuple[str, ...]) -> None:
    """vLLM refuses ``disable_any_whitespace`` for ``auto``; the worker never runs ``auto``."""
    config = structured_outputs_config(tiny_model, *flags)
    assert config.backend == DEFAULT_STRUCTURED_OUTPUTS_BACKEND
    assert config.disable_any_whitespace


def test_an_option_the_chosen_backend_lacks_is_still_refused(tiny_model: Path) -> None:
    with pytest.raises(SystemExit):
        backend(tiny_model, "--structured-outputs-config", '{"backend": "outlines", "disable_any_whitespace": true}')


def test_a_worker_that_parses_tool_calls_uses_xgrammar_unless_the_flags_choose(tiny_model: Path) -> None:
    """A named or required tool choice is a structural tag, which only xgrammar compiles."""
    assert backend(tiny_model, "--tool-call-parser", "hermes") == "xgrammar"
    chosen = ("--structured-outputs-config.backend", "guidance")
    assert backend(tiny_model, "--tool-call-parser", "hermes", *chosen) == "guidance"


def test_auto_tool_choice_without_a_parser_is_refused_as_vllm_serve_refuses_it() -> None:
    from worker.startup import parse_args, parser_flags_from_args

    assert parser_flags_from_args(parse_args(["--model", "m"])) is None
    with pytest.raises(SystemExit, match="--enable-auto-tool-choice requires --tool-call-parser"):
        parser_flags_from_args(parse_args(["--model", "m", "--enable-auto-tool-choice"]))
