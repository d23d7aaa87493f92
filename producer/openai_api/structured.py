"""OpenAI's ``response_format`` and vLLM's ``structured_outputs`` body fields to a
request's ``structured_outputs``, accepted as ``vllm serve`` accepts them.

``response_format`` ``{"type": "json_object"}`` and ``{"type": "json_schema", ...}``
constrain the output as OpenAI's do; ``structured_outputs`` is vLLM's own field
(``json``, ``regex``, ``choice``, ``grammar``, ``json_object``). Giving a constraint in
both is refused rather than one silently winning. The removed ``guided_*`` fields, which
``vllm serve`` now ignores (unconstrained output), are refused with what replaces them.
Whether a schema, regex or grammar compiles is vLLM's to say, on the worker.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

import msgspec

from producer.errors import InvalidParameter
from streamq.protocol import StructuredOutputs

_REMOVED_GUIDED_FIELDS: Final = {
    "guided_json": 'structured_outputs: {"json": SCHEMA} or response_format json_schema',
    "guided_regex": 'structured_outputs: {"regex": ...}',
    "guided_choice": 'structured_outputs: {"choice": [...]}',
    "guided_grammar": 'structured_outputs: {"grammar": ...}',
    "guided_decoding_backend": "the worker's --structured-outputs-config",
    "guided_whitespace_pattern": "the worker's --structured-outputs-config",
}

STRUCTURED_FIELDS: Final = frozenset({"response_format", "structured_outputs", *_REMOVED_GUIDED_FIELDS})
"""Body fields this module reads: accepted by both endpoints."""

_CONSTRAINTS: Final = ("json", "regex", "choice", "grammar", "json_object")

# vLLM's options beside the constraint: the engine reads them from its own
# configuration, never from a request, so only their neutral values are accepted.
_WORKER_OPTIONS: Final = {
    "disable_any_whitespace": False,
    "disable_additional_properties": False,
    "whitespace_pattern": None,
}


def structured_outputs_of(body: Mapping[str, Any]) -> StructuredOutputs | None:
    """The constraint ``body`` asks for, or ``None``; raises ``InvalidParameter`` naming the field."""
    for name, replacement in _REMOVED_GUIDED_FIELDS.items():
        if name in body:
            raise InvalidParameter(
                f"{name} is no longer part of vLLM's API (vllm serve ignores it); use {replacement}", param=name
            )
    from_format = _from_response_format(body.get("response_format"))
    from_vllm = _from_structured_outputs(body.get("structured_outputs"))
    if from_format is not None and from_vllm is not None:
        raise InvalidParameter(
            "give the output constraint in response_format or in structured_outputs, not both",
            param="response_format",
        )
    return from_format if from_format is not None else from_vllm


def _from_response_format(value: object) -> StructuredOutputs | None:
    if value is None:
        return None
    param = "response_format"
    if not isinstance(value, Mapping) or not isinstance(value.get("type"), str):
        raise InvalidParameter(f"{param} must be an object with a string 'type'", param=param)
    kind = value["type"]
    if kind == "structural_tag":
        raise InvalidParameter(f"{param} type 'structural_tag' is not supported by streamq", param=param)
    if kind not in ("text", "json_object", "json_schema"):
        raise InvalidParameter(
            f"{param}.type must be 'text', 'json_object' or 'json_schema', got {kind!r}", param=f"{param}.type"
        )
    _reject_unknown(value, {"type", "json_schema"}, param)  # a json_schema beside another type is unused, as in vLLM
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputs(json_object=True)
    return StructuredOutputs(json=_json_schema(value.get("json_schema")))


def _json_schema(value: object) -> dict[str, Any]:
    """The schema of ``response_format.json_schema`` (OpenAI's ``{name, description, schema, strict}``)."""
    param = "response_format.json_schema"
    if not isinstance(value, Mapping):
        raise InvalidParameter(
            f"{param} must be an object with 'name' and 'schema' when type is 'json_schema'", param=param
        )
    _reject_unknown(value, {"name", "description", "schema", "strict"}, param)
    if not isinstance(value.get("name"), str) or not value["name"]:
        raise InvalidParameter(f"{param}.name must be a non-empty string", param=f"{param}.name")
    if value.get("description") is not None and not isinstance(value["description"], str):
        raise InvalidParameter(f"{param}.description must be a string", param=f"{param}.description")
    if value.get("strict") is not None and not isinstance(value["strict"], bool):
        raise InvalidParameter(f"{param}.strict must be true or false", param=f"{param}.strict")
    schema = value.get("schema")
    if not isinstance(schema, dict):
        raise InvalidParameter(f"{param}.schema must be a JSON schema object", param=f"{param}.schema")
    return schema


def _from_structured_outputs(value: object) -> StructuredOutputs | None:
    if value is None:
        return None
    param = "structured_outputs"
    if not isinstance(value, Mapping):
        raise InvalidParameter(f'{param} must be an object, e.g. {{"regex": "[0-9]+"}}', param=param)
    _reject_unknown(value, {*_CONSTRAINTS, *_WORKER_OPTIONS, "structural_tag"}, param)
    if value.get("structural_tag") is not None:
        raise InvalidParameter(f"{param}.structural_tag is not supported by streamq", param=f"{param}.structural_tag")
    for name, neutral in _WORKER_OPTIONS.items():
        if value.get(name, neutral) not in (neutral, None):
            raise InvalidParameter(
                f"{param}.{name} is a setting of the worker's engine (--structured-outputs-config), not of a request",
                param=f"{param}.{name}",
            )
    constraint = {name: value[name] for name in _CONSTRAINTS if value.get(name) is not None}
    try:
        return msgspec.convert(constraint, StructuredOutputs)
    except (msgspec.ValidationError, ValueError) as exc:
        raise InvalidParameter(str(exc).replace("`$.", f"`$.{param}."), param=param) from None


def _reject_unknown(value: Mapping[str, Any], allowed: set[str], param: str) -> None:
    unknown = sorted(set(value) - allowed)
    if unknown:
        raise InvalidParameter(f"unsupported field(s) in {param}: {', '.join(unknown)}", param=f"{param}.{unknown[0]}")
