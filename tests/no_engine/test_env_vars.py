"""The registry of environment variables (``streamq/env_vars.py``) holds the code and the
docs to one list: every ``STREAMQ_*`` name the code reads is registered and every one
registered is read, every flag it names exists, the defaults kept as constants elsewhere
agree, and docs/operations/configuration.md shows the registry's table."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from devkit import dashboard, demo
from streamq.env_vars import BY_NAME, markdown_table
from worker import metrics, scheduling

ROOT = Path(__file__).resolve().parents[2]
CODE = ("streamq", "producer", "worker", "gateway", "devkit")
NAME = re.compile(r"(STREAMQ_[A-Z0-9_]+|REDIS_URL)")


def string_literals() -> set[str]:
    found: set[str] = set()
    for top in CODE:
        for path in (ROOT / top).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Constant) and isinstance(node.value, str):
                    found.add(node.value)
    return found


def test_every_variable_the_code_reads_is_registered_and_every_registered_one_is_read() -> None:
    literals = string_literals()
    read = {value for value in literals if NAME.fullmatch(value)}
    assert read == set(BY_NAME), f"unregistered: {sorted(read - set(BY_NAME))}; not read: {sorted(set(BY_NAME) - read)}"


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
