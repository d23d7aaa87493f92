"""The console scripts pyproject.toml declares: each names a function that runs with no arguments,
and the installed scripts answer ``--help``."""

from __future__ import annotations

import ast
import importlib.metadata
import subprocess
import sysconfig
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]
SCRIPTS: dict[str, str] = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]


def test_the_four_commands_are_declared() -> None:
    assert set(SCRIPTS) == {"streamq", "streamq-worker", "streamq-gateway", "streamq-exporter"}


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_each_entry_point_can_be_called_without_arguments(name: str) -> None:
    """A console script calls its function bare, so every parameter needs a default. Read from the
    source: importing the worker would import vLLM."""
    module_name, _, function_name = SCRIPTS[name].partition(":")
    source = ROOT.joinpath(*module_name.split(".")).with_suffix(".py")
    functions = [
        node
        for node in ast.parse(source.read_text()).body
        if isinstance(node, ast.FunctionDef) and node.name == function_name
    ]
    assert len(functions) == 1, f"{source} defines no {function_name}()"
    arguments = functions[0].args
    positional = arguments.posonlyargs + arguments.args
    assert len(arguments.defaults) == len(positional), f"{SCRIPTS[name]}: a positional parameter has no default"
    assert None not in arguments.kw_defaults, f"{SCRIPTS[name]}: a keyword-only parameter has no default"


def _installed_entry_points() -> dict[str, str]:
    try:
        distribution = importlib.metadata.distribution("streamq")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("streamq is not installed in this environment (`make install` installs it)")
    return {e.name: e.value for e in distribution.entry_points if e.group == "console_scripts"}


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_the_installed_script_answers_help(name: str) -> None:
    installed = _installed_entry_points()
    assert installed.get(name) == SCRIPTS[name], (
        f"the installed streamq lacks the {name} script pyproject.toml declares: run `make install` again"
    )
    script = Path(sysconfig.get_path("scripts")) / name
    assert script.is_file(), f"{script} is missing: run `make install` again"
    result = subprocess.run([str(script), "--help"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "usage:" in result.stdout
    if name == "streamq":
        assert result.stdout.startswith("usage: streamq ")
