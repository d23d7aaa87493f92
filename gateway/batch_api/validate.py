"""A batch's input file checked before any line of it runs, as OpenAI's ``validating``
state does: every line a request for the batch's endpoint (``producer.batch_line``, the
checks ``streamq batch`` makes too), each ``custom_id`` once, one model, within the limits.

The file is read a line at a time (``Storage.read_lines``). Memory: the line being read,
the errors kept (at most ``MAX_ERRORS_KEPT``), and one 16-byte digest per ``custom_id``
seen, to find duplicates: about 100 bytes a line with Python's set, 5 MB at the default
50,000 lines, never more than ``max_lines`` of them.

A body that vLLM would refuse (``temperature: -1``) is no validation failure: that line
runs, and its 400 lands in the batch's error file, as at OpenAI.
"""

from __future__ import annotations

import hashlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Final

from producer.batch_line import LineProblem, parse_request_line

MAX_ERRORS_KEPT: Final = 100
"""Errors a failed batch names (OpenAI's ``errors.data``); ``Validation.error_count`` counts them all."""


@dataclass
class Validation:
    total: int = 0
    """Lines holding a request (blank lines are skipped, and not counted)."""
    model: str | None = None
    """The one model every line that names one names (``None`` when none names one)."""
    errors: list[dict[str, Any]] = field(default_factory=list)
    """OpenAI's ``BatchError``s: ``{"code", "message", "line", "param"}``, the first ``MAX_ERRORS_KEPT``."""
    error_count: int = 0

    @property
    def ok(self) -> bool:
        return self.error_count == 0

    def fail(self, problem: LineProblem, line: int | None) -> None:
        self.error_count += 1
        if len(self.errors) < MAX_ERRORS_KEPT:
            self.errors.append({"code": problem.code, "message": problem.message, "line": line, "param": problem.param})


async def validate_input(
    lines: AsyncIterator[tuple[int, bytes]], *, endpoint: str, max_lines: int, max_bytes: int
) -> Validation:
    """Check every physical line of ``lines`` (``(offset just past the line, the line)``,
    as ``Storage.read_lines`` gives them; lines are numbered from 1, blank ones too, as an
    editor shows them). Past ``max_lines`` requests or ``max_bytes`` bytes it stops
    reading, with that error."""
    result = Validation()
    seen: set[bytes] = set()
    number = 0
    async for offset, raw in lines:
        number += 1
        if not raw.strip():
            continue
        if offset > max_bytes:
            message = f"the input file is larger than the {max_bytes} bytes a batch may read"
            result.fail(LineProblem("file_too_large", message, "input_file_id"), number)
            break
        result.total += 1
        if result.total > max_lines:
            message = f"the input file holds more than the {max_lines} requests a batch may have"
            result.fail(LineProblem("too_many_requests", message, "input_file_id"), number)
            break
        parsed = parse_request_line(raw, (endpoint,))
        if parsed.custom_id is not None:
            digest = hashlib.blake2b(parsed.custom_id.encode(), digest_size=16).digest()
            if digest in seen and parsed.problem is None:
                message = f"custom_id {parsed.custom_id!r} is not unique: an earlier line has it"
                result.fail(LineProblem("duplicate_custom_id", message, "custom_id"), number)
                continue
            seen.add(digest)
        if parsed.problem is not None:
            result.fail(parsed.problem, number)
            continue
        assert parsed.body is not None, "a line without a problem has a body"
        model = parsed.body.get("model")
        if not isinstance(model, str):
            continue  # no model: the default one; not a string: that line's own 400 when it runs
        if result.model is None:
            result.model = model
        elif model != result.model:
            message = f"model {model!r} is not the batch's model {result.model!r}: a batch runs one model"
            result.fail(LineProblem("mismatched_model", message, "body.model"), number)
    if result.total == 0 and result.ok:
        message = "the input file is empty: a batch needs at least one request"
        result.fail(LineProblem("empty_file", message, "input_file_id"), None)
    return result
