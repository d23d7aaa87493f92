"""``submit``'s structured-output options: each becomes the request's constraint, and a bad
one exits 2 with the reason before anything reaches Redis."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from producer.cli import build_parser, with_default_subcommand
from producer.structured_args import structured_outputs_from_args
from streamq.protocol import StructuredOutputs

SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}


def constraint(*argv: str) -> StructuredOutputs | None:
    return structured_outputs_from_args(build_parser().parse_args(with_default_subcommand([*argv, "Hello"])))


def test_each_option_becomes_the_requests_constraint(tmp_path: Path) -> None:
    schema_file, grammar_file = tmp_path / "schema.json", tmp_path / "answer.gbnf"
    schema_file.write_text(json.dumps(SCHEMA))
    grammar_file.write_text('root ::= "yes" | "no"\n')

    assert constraint() is None
    assert constraint("--json-schema", json.dumps(SCHEMA)) == StructuredOutputs(json=SCHEMA)
    assert constraint("--json-schema", f"@{schema_file}") == StructuredOutputs(json=SCHEMA)
    assert constraint("--regex", "[0-9]{3}") == StructuredOutputs(regex="[0-9]{3}")
    assert constraint("--choice", "yes", "--choice", "no") == StructuredOutputs(choice=["yes", "no"])
    assert constraint("--grammar", f"@{grammar_file}") == StructuredOutputs(grammar='root ::= "yes" | "no"\n')
    assert constraint("--grammar", 'root ::= "a"') == StructuredOutputs(grammar='root ::= "a"')
    assert constraint("--json-object") == StructuredOutputs(json_object=True)


@pytest.mark.parametrize(
    ("argv", "reason"),
    [
        (("--json-schema", "{not json"), "not valid JSON"),
        (("--json-schema", "[1, 2]"), "must be a JSON object, got list"),
        (("--json-schema", "@/no/such/schema.json"), "cannot read /no/such/schema.json"),
        (("--grammar", "   "), "the grammar is empty"),
        (("--grammar", "@/no/such/grammar.gbnf"), "cannot read /no/such/grammar.gbnf"),
        (("--regex", "a", "--choice", "b"), "not allowed with argument"),
        (("--json-object", "--json-schema", "{}"), "not allowed with argument"),
    ],
)
def test_a_bad_option_exits_2_with_its_reason(
    argv: tuple[str, ...], reason: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        build_parser().parse_args(with_default_subcommand([*argv, "Hello"]))
    assert exited.value.code == 2
    assert reason in capsys.readouterr().err
