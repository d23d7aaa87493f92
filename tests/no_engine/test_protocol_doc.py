"""PROTOCOL.md (the client contract) and docs/internals.md (how workers keep it) against
the contract in ``streamq.protocol``: every name, limit, code, finish reason and script
the code defines is documented in one of them, with the same value, and the tables list
nothing the code lacks."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from streamq import env_vars
from streamq.protocol import ErrorCode, FinishReason, envelope, names
from streamq.protocol.roles import ROLES
from streamq.protocol.scripts import script_names

ROOT = Path(__file__).resolve().parents[2]
DOC = (ROOT / "PROTOCOL.md").read_text(encoding="utf-8")
INTERNALS = (ROOT / "docs" / "internals.md").read_text(encoding="utf-8")
CODE_SPANS = re.findall(r"`([^`\n]+)`", DOC + "\n" + INTERNALS)


def table_after(marker: str, doc: str = DOC) -> list[list[str]]:
    """The rows (cells stripped, header and rule left out) of the first table after the
    line containing ``marker`` in ``doc`` (PROTOCOL.md unless given)."""
    lines = doc.splitlines()
    start = next(i for i, line in enumerate(lines) if marker in line)
    rows: list[list[str]] = []
    for line in lines[start + 1 :]:
        if line.startswith("|"):
            rows.append([cell.strip() for cell in line.strip().strip("|").split("|")])
        elif rows:
            break
    return rows[2:]


def first_column(marker: str, doc: str = DOC) -> set[str]:
    """The code spans of the first column of the table after ``marker``."""
    return {row[0].strip("`") for row in table_after(marker, doc)}


def public_constants(module: object, kind: type) -> dict[str, object]:
    return {
        name: value
        for name, value in vars(module).items()
        if name.isupper() and not name.startswith("_") and type(value) is kind
    }


def test_every_error_code_is_documented_and_nothing_else() -> None:
    assert first_column("Terminal error codes") == {code.value for code in ErrorCode}


def test_every_finish_reason_is_documented_and_nothing_else() -> None:
    assert first_column("Finish reasons") == {reason.value for reason in FinishReason}


def test_every_lua_script_is_documented_and_nothing_else() -> None:
    assert first_column("## Lua scripts", INTERNALS) == set(script_names())


def test_every_limit_is_documented_with_its_value() -> None:
    contract = {row[0].strip("`"): row[1] for row in table_after("## Limits and timings")}
    internal = {row[0].strip("`"): row[1] for row in table_after("## Limits and timings", INTERNALS)}
    assert not contract.keys() & internal.keys(), "a limit documented in both PROTOCOL.md and docs/internals.md"
    documented = contract | internal
    numbers = {
        **public_constants(names, int),
        **public_constants(names, float),
        **public_constants(envelope, int),
    }
    assert documented.keys() == numbers.keys()
    for name, value in numbers.items():
        assert float(documented[name]) == value, name


@pytest.mark.parametrize("name", sorted(public_constants(names, str)))
def test_every_name_appears_in_the_doc(name: str) -> None:
    value = getattr(names, name)
    assert any(value in span for span in CODE_SPANS), f"{name} = {value!r} is not in the docs"


def test_the_request_id_pattern_is_documented_verbatim() -> None:
    assert names.REQUEST_ID_PATTERN.pattern in CODE_SPANS


def test_every_environment_variable_is_documented_with_its_default() -> None:
    """PROTOCOL.md documents the variables a component in another language would read or
    set; their names are the registry's (``streamq.env_vars``), their defaults the wire's."""
    documented = {row[0].strip("`"): row[1].strip("`") for row in table_after("## Environment")}
    defaults = {
        env_vars.REDIS_URL_ENV: names.DEFAULT_REDIS_URL,
        env_vars.QUEUE_ENV: names.DEFAULT_QUEUE,
        env_vars.DRAIN_SECONDS_ENV: str(names.DEFAULT_DRAIN_SECONDS),
        env_vars.LOG_MAXLEN_ENV: str(names.LOG_MAXLEN),
        env_vars.LOG_TTL_ENV: str(names.LOG_TTL_MS // 1000),
        env_vars.API_KEYS_ENV: "(none)",
        env_vars.COALESCE_ENV: "1",
        env_vars.CHECKPOINT_TOKENS_ENV: str(names.DEFAULT_CHECKPOINT_TOKENS),
        env_vars.AFFINITY_WINDOW_ENV: f"{names.AFFINITY_WINDOW_MS / 1000:g}",
        env_vars.KEEP_RESULT_ENV: str(names.DEFAULT_KEEP_RESULT_S),
        env_vars.CALLBACK_SECRET_ENV: "(none)",
        env_vars.EVENTS_REDIS_URL_ENV: "(none)",
        env_vars.MODEL_MEMORY_ENV: str(names.DEFAULT_MODEL_MEMORY_S),
        env_vars.DECLARED_MODELS_ENV: "(none)",
        env_vars.DURABLE_ENDS_ENV: names.DEFAULT_DURABLE_ENDS,
    }
    assert defaults.keys() <= env_vars.BY_NAME.keys()
    assert documented == defaults


def test_redis_roles_are_documented_as_the_code_grants_them() -> None:
    documented = [line for line in INTERNALS.splitlines() if line.startswith("ACL SETUSER ")]
    assert documented == [role.setuser() for role in ROLES]


def test_every_test_the_ownership_rules_name_exists() -> None:
    """Each rule of "Ownership" names the test that holds it: a renamed or deleted test
    must not leave the rule unproven on paper."""
    tests = Path(__file__).resolve().parents[1]
    defined = {name for path in tests.rglob("*.py") for name in re.findall(r"def (test_\w+)", path.read_text())}
    cells = [cell for row in table_after("Each pair of writers", INTERNALS) for cell in row[2:]]
    named = [span for cell in cells for span in re.findall(r"`([^`]+)`", cell)]
    assert named, "the ownership table names no tests"
    for span in named:
        name = span.split(" ")[0].split("[")[0]
        if name.startswith("tests/"):
            assert (tests.parent / name).exists(), name
        else:
            assert name in defined, f"docs/internals.md names {name}, which no test defines"
    for span in re.findall(r"\(`(test_\w+)`\)", " ".join(cells)):
        assert span in defined, span
