"""The registry of environment variables (``streamq/env_vars.py``) holds the code and the
docs to one list: every ``STREAMQ_*`` name is spelled there once, as a constant the registry
and every reader use, and every one registered is read; every flag it names exists, the
defaults kept as constants elsewhere agree, and docs/operations/configuration.md shows the
registry's table."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from devkit import dashboard, demo
from streamq import env_vars
from streamq.env_vars import BY_NAME, markdown_table
from worker import metrics, scheduling

ROOT = Path(__file__).resolve().parents[2]
CODE = ("streamq", "producer", "worker", "gateway", "devkit")
NAME = re.compile(r"(STREAMQ_[A-Z0-9_]+|REDIS_URL)")


REGISTRY = ROOT / "streamq" / "env_vars.py"


def modules() -> list[tuple[Path, ast.Module]]:
    return [(path, ast.parse(path.read_text())) for top in CODE for path in sorted((ROOT / top).rglob("*.py"))]


def string_literals(*, outside_registry: bool = False) -> set[str]:
    found: set[str] = set()
    for path, tree in modules():
        if outside_registry and path == REGISTRY:
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                found.add(node.value)
    return found


def constants() -> dict[str, str]:
    """The registry module's ``*_ENV`` constants: the names, spelled once."""
    return {name: value for name, value in vars(env_vars).items() if name.endswith("_ENV") and isinstance(value, str)}


def imported_from_registry() -> set[str]:
    """The ``*_ENV`` constants some module imports from ``streamq.env_vars`` (or reads off it)."""
    found: set[str] = set()
    for path, tree in modules():
        if path == REGISTRY:
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module == "streamq.env_vars":
                found.update(alias.name for alias in node.names)
            elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "env_vars":
                found.add(node.attr)
    return found


def test_every_name_is_spelled_once_in_the_registry() -> None:
    spelled_elsewhere = {value for value in string_literals(outside_registry=True) if NAME.fullmatch(value)}
    assert not spelled_elsewhere, f"import these from streamq.env_vars: {sorted(spelled_elsewhere)}"
    assert sorted(constants().values()) == sorted(BY_NAME), "each registered variable is one constant"


def test_every_registered_variable_is_read() -> None:
    unread = constants().keys() - imported_from_registry()
    assert not unread, f"registered but read nowhere: {sorted(unread)}"


def test_every_flag_the_registry_names_exists() -> None:
    literals = string_literals()
    flags = {var.flag.split()[0] for var in BY_NAME.values() if var.flag}
    assert flags <= literals, sorted(flags - literals)


def test_defaults_kept_beside_their_readers_agree() -> None:
    assert BY_NAME["STREAMQ_METRICS_PORT"].default == str(metrics.DEFAULT_METRICS_PORT)
    assert BY_NAME["STREAMQ_CPU_NICE"].default == str(scheduling.DEFAULT_CPU_NICE)
    assert BY_NAME["STREAMQ_DASHBOARD_PORT"].default == str(dashboard.DEFAULT_PORT)
    assert BY_NAME["STREAMQ_DEMO_MODEL"].default == demo.DEFAULT_MODEL


def test_the_configuration_page_shows_the_registrys_table() -> None:
    page = (ROOT / "docs" / "operations" / "configuration.md").read_text()
    assert markdown_table() in page, "regenerate it: python -m streamq.env_vars"
