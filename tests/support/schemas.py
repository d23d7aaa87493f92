"""JSON schemas the tiny random model's answers end in: bounded values only (an enum, a
small integer range, no other properties), so a constrained answer cannot run on."""

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "enum": ["ann", "bob", "eve"]},
        "age": {"type": "integer", "minimum": 0, "maximum": 99},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}
