"""The ``submit`` command's structured-output options: at most one of ``--json-schema``,
``--regex``, ``--choice`` (repeated), ``--grammar``, ``--json-object``.

Values are checked by argparse (exit status 2 with the reason) before anything is sent:
a schema must be a JSON object, a file named with ``@`` must be readable. Whether a
schema, regex or grammar compiles is vLLM's to say, on the worker (an ``invalid_request``
error).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from streamq.protocol import StructuredOutputs


def _text_or_file(value: str) -> str:
    """``@PATH``: the file's text; anything else: the value itself."""
    if not value.startswith("@"):
        return value
    try:
        return Path(value[1:]).read_text()
    except OSError as exc:
        raise argparse.ArgumentTypeError(f"cannot read {value[1:]}: {exc.strerror or exc}") from None


def json_schema_argument(value: str) -> dict[str, object]:
    """A JSON schema, inline or ``@file``: must parse as a JSON object."""
    text = _text_or_file(value)
    try:
        schema = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not valid JSON: {exc}") from None
    if not isinstance(schema, dict):
        raise argparse.ArgumentTypeError(f"a JSON schema must be a JSON object, got {type(schema).__name__}")
    return schema


def grammar_argument(value: str) -> str:
    """An EBNF (GBNF or Lark) grammar, inline or ``@file``; not empty."""
    text = _text_or_file(value)
    if not text.strip():
        raise argparse.ArgumentTypeError("the grammar is empty")
    return text


def add_structured_output_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(
        "structured outputs", "constrain every prompt's output (vLLM's structured outputs); at most one of these"
    )
    exclusive = group.add_mutually_exclusive_group()
    exclusive.add_argument(
        "--json-schema",
        type=json_schema_argument,
        metavar="SCHEMA",
        help="JSON schema the output validates against: inline JSON or @FILE",
    )
    exclusive.add_argument("--regex", metavar="REGEX", help="regular expression the whole output matches")
    exclusive.add_argument(
        "--choice",
        action="append",
        metavar="TEXT",
        help="the output is exactly one of these (repeat: --choice yes --choice no)",
    )
    exclusive.add_argument(
        "--grammar", type=grammar_argument, metavar="GRAMMAR", help="EBNF (GBNF or Lark) grammar: inline or @FILE"
    )
    exclusive.add_argument("--json-object", action="store_true", help="the output is a JSON object (any)")


def structured_outputs_from_args(args: argparse.Namespace) -> StructuredOutputs | None:
    """The constraint the parsed options ask for, or ``None``."""
    if args.json_schema is not None:
        return StructuredOutputs(json=args.json_schema)
    if args.regex is not None:
        return StructuredOutputs(regex=args.regex)
    if args.choice is not None:
        return StructuredOutputs(choice=args.choice)
    if args.grammar is not None:
        return StructuredOutputs(grammar=args.grammar)
    if args.json_object:
        return StructuredOutputs(json_object=True)
    return None
