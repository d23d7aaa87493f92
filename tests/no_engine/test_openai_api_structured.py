"""``response_format`` and vLLM's ``structured_outputs`` body fields map onto a request's
``structured_outputs`` for both endpoints, as ``vllm serve`` takes them; bad shapes are
refused with a 400 naming the field."""

from __future__ import annotations

from typing import Any

import pytest

from producer.errors import InvalidParameter
from producer.openai_api.errors import api_error_for
from producer.openai_api.requests import chat_request_to_submit_kwargs, completion_request_to_submit_kwargs
from streamq.protocol import StructuredOutputs, parse_request

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
CHAT = {"messages": [{"role": "user", "content": "Hi"}]}
COMPLETION = {"prompt": "Hi"}

# (body fields, the structured_outputs they ask for; None: none)
MAPPINGS: list[tuple[dict[str, Any], StructuredOutputs | None]] = [
    ({"response_format": {"type": "text"}}, None),
    ({"response_format": None}, None),
    ({"response_format": {"type": "json_object"}}, StructuredOutputs(json_object=True)),
    (
        {"response_format": {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}}},
        StructuredOutputs(json=SCHEMA),
    ),
    (
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "answer", "description": "d", "schema": SCHEMA, "strict": True},
            }
        },
        StructuredOutputs(json=SCHEMA),
    ),
    ({"structured_outputs": {"json": SCHEMA}}, StructuredOutputs(json=SCHEMA)),
    ({"structured_outputs": {"json": '{"type": "integer"}'}}, StructuredOutputs(json='{"type": "integer"}')),
    ({"structured_outputs": {"regex": "[a-z]+"}}, StructuredOutputs(regex="[a-z]+")),
    ({"structured_outputs": {"choice": ["yes", "no"]}}, StructuredOutputs(choice=["yes", "no"])),
    ({"structured_outputs": {"grammar": 'root ::= "a"'}}, StructuredOutputs(grammar='root ::= "a"')),
    ({"structured_outputs": {"json_object": True}}, StructuredOutputs(json_object=True)),
    (
        {"structured_outputs": {"regex": "a", "json": None, "disable_any_whitespace": False, "structural_tag": None}},
        StructuredOutputs(regex="a"),
    ),
    # A text response_format beside vLLM's field asks for one constraint only.
    ({"response_format": {"type": "text"}, "structured_outputs": {"regex": "a"}}, StructuredOutputs(regex="a")),
]

# (body fields, the param the 400 names, text of its message)
BAD: list[tuple[dict[str, Any], str, str]] = [
    ({"response_format": "json"}, "response_format", "string 'type'"),
    ({"response_format": {}}, "response_format", "string 'type'"),
    ({"response_format": {"type": "xml"}}, "response_format.type", "'xml'"),
    ({"response_format": {"type": "structural_tag", "format": {}}}, "response_format", "structural_tag"),
    ({"response_format": {"type": "json_object", "schema": SCHEMA}}, "response_format.schema", "schema"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema", "'name' and 'schema'"),
    (
        {"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA}}},
        "response_format.json_schema.name",
        "name",
    ),
    (
        {"response_format": {"type": "json_schema", "json_schema": {"name": "a"}}},
        "response_format.json_schema.schema",
        "JSON schema object",
    ),
    (
        {"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": "{}"}}},
        "response_format.json_schema.schema",
        "JSON schema object",
    ),
    (
        {"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA, "strict": "y"}}},
        "response_format.json_schema.strict",
        "strict",
    ),
    (
        {"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA, "x": 1}}},
        "response_format.json_schema.x",
        "x",
    ),
    ({"structured_outputs": "[0-9]+"}, "structured_outputs", "must be an object"),
    ({"structured_outputs": {}}, "structured_outputs", "exactly one"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs", "exactly one"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs", "must not be empty"),
    ({"structured_outputs": {"choice": "yes"}}, "structured_outputs", "structured_outputs.choice"),
    ({"structured_outputs": {"json": [1, 2]}}, "structured_outputs", "structured_outputs.json"),
    ({"structured_outputs": {"json": "{not json"}}, "structured_outputs", "not valid JSON"),
    ({"structured_outputs": {"json_object": False}}, "structured_outputs", "must be true"),
    ({"structured_outputs": {"regex": "a", "backend": "xgrammar"}}, "structured_outputs.backend", "backend"),
    ({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs.structural_tag", "not supported"),
    (
        {"structured_outputs": {"regex": "a", "disable_any_whitespace": True}},
        "structured_outputs.disable_any_whitespace",
        "--structured-outputs-config",
    ),
    (
        {"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
        "response_format",
        "not both",
    ),
    ({"guided_json": SCHEMA}, "guided_json", 'structured_outputs: {"json"'),
    ({"guided_regex": "a"}, "guided_regex", "regex"),
    ({"guided_choice": ["a"]}, "guided_choice", "choice"),
    ({"guided_grammar": "x"}, "guided_grammar", "grammar"),
    ({"guided_decoding_backend": "xgrammar"}, "guided_decoding_backend", "--structured-outputs-config"),
]


@pytest.mark.parametrize(("fields", "expected"), MAPPINGS)
@pytest.mark.parametrize("chat", [True, False], ids=["chat", "completions"])
def test_a_constraint_in_the_body_becomes_the_requests_structured_outputs(
    fields: dict[str, Any], expected: StructuredOutputs | None, chat: bool
) -> None:
    to_kwargs = chat_request_to_submit_kwargs if chat else completion_request_to_submit_kwargs
    kwargs = to_kwargs({**(CHAT if chat else COMPLETION), **fields})
    assert kwargs.get("structured_outputs") == expected
    # What the gateway hands submit() makes a valid request carrying the constraint.
    request = parse_request(
        {
            "request_id": "r",
            "prompt": "Hi",
            "sampling": {k: v for k, v in kwargs.items() if k not in ("prompt", "messages")},
        }
    )
    assert request.sampling.structured_outputs == expected


@pytest.mark.parametrize(("fields", "param", "reason"), BAD)
@pytest.mark.parametrize("chat", [True, False], ids=["chat", "completions"])
def test_a_bad_constraint_is_a_400_naming_its_field(
    fields: dict[str, Any], param: str, reason: str, chat: bool
) -> None:
    to_kwargs = chat_request_to_submit_kwargs if chat else completion_request_to_submit_kwargs
    with pytest.raises(InvalidParameter) as caught:
        to_kwargs({**(CHAT if chat else COMPLETION), **fields})
    assert reason in str(caught.value)
    error = api_error_for(caught.value)
    assert error.status == 400
    assert error.body()["error"]["param"] == param
