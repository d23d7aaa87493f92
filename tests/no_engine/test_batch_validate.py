"""A batch's input checked as the Batch API's ``validating`` state checks it
(``gateway.batch_api.validate``): each failure named by OpenAI's code with its line number,
read a line at a time; a good file gives its request count and its one model."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import pytest

from gateway.batch_api.validate import MAX_ERRORS_KEPT, Validation, validate_input

CHAT = "/v1/chat/completions"


def line(custom_id: Any, body: Any = None, *, url: str = CHAT, method: str = "POST", **extra: Any) -> str:
    body = {"model": "m", "messages": [{"role": "user", "content": "Hi"}]} if body is None else body
    return json.dumps({"custom_id": custom_id, "method": method, "url": url, "body": body, **extra})


async def physical_lines(data: bytes) -> AsyncIterator[tuple[int, bytes]]:
    """What ``Storage.read_lines`` yields: every line, blank ones too, with the offset past it."""
    offset = 0
    for raw in data.split(b"\n")[: -1 if data.endswith(b"\n") else None]:
        offset += len(raw) + 1
        yield min(offset, len(data)), raw


async def validate(*lines: str, max_lines: int = 1000, max_bytes: int = 1 << 20) -> Validation:
    data = "".join(text + "\n" for text in lines).encode()
    return await validate_input(physical_lines(data), endpoint=CHAT, max_lines=max_lines, max_bytes=max_bytes)


def codes(result: Validation) -> list[tuple[str, int | None, str | None]]:
    return [(error["code"], error["line"], error["param"]) for error in result.errors]


async def test_a_good_file_counts_its_requests_and_names_its_one_model() -> None:
    result = await validate(line("a"), "", line("b"), "  ", line("c", {"model": "m", "prompt": "x"}))
    assert (result.ok, result.total, result.model, result.errors) == (True, 3, "m", [])


async def test_lines_that_name_no_model_leave_the_default_one() -> None:
    result = await validate(line("a", {"messages": []}), line("b", {"messages": []}))
    assert (result.ok, result.total, result.model) == (True, 2, None)


FAILURES: list[tuple[str, str, str | None]] = [
    ("{not json", "invalid_json_line", None),
    ("[1, 2]", "invalid_json_line", None),
    (json.dumps({"method": "POST", "url": CHAT, "body": {}}), "missing_required_parameter", "custom_id"),
    (line(5), "invalid_type", "custom_id"),
    (json.dumps({"custom_id": "a", "url": CHAT, "body": {}}), "missing_required_parameter", "method"),
    (line("a", method="GET"), "invalid_method", "method"),
    (json.dumps({"custom_id": "a", "method": "POST", "body": {}}), "missing_required_parameter", "url"),
    (line("a", url="/v1/completions"), "invalid_url", "url"),
    (json.dumps({"custom_id": "a", "method": "POST", "url": CHAT}), "missing_required_parameter", "body"),
    (line("a", []), "invalid_type", "body"),
    (line("a", {"model": "m", "messages": [], "stream": True}), "streaming_unsupported", "body.stream"),
    (line("a", extra=1), "unknown_parameter", "extra"),
    ("[" * 100_000, "invalid_json_line", None),
]


@pytest.mark.parametrize(("bad", "code", "param"), FAILURES)
async def test_each_bad_line_is_named_by_its_code_line_and_param(bad: str, code: str, param: str | None) -> None:
    result = await validate(line("first"), "", bad, line("last"))
    assert not result.ok and result.error_count == 1
    assert codes(result) == [(code, 3, param)]
    assert result.errors[0]["message"]


async def test_a_line_that_is_not_utf8_is_not_json() -> None:
    data = (line("a") + "\n").encode() + b'{"custom_id": "\xff\xfe"}\n'
    result = await validate_input(physical_lines(data), endpoint=CHAT, max_lines=10, max_bytes=1 << 20)
    assert codes(result) == [("invalid_json_line", 2, None)]


async def test_a_duplicate_custom_id_is_named_at_its_second_line() -> None:
    result = await validate(line("a"), line("b"), line("a"))
    assert codes(result) == [("duplicate_custom_id", 3, "custom_id")]
    assert "'a'" in result.errors[0]["message"]


async def test_a_second_model_fails_the_batch_at_its_first_line() -> None:
    other = {"model": "other", "messages": []}
    result = await validate(line("a"), line("b", other), line("c"), line("d", other))
    assert codes(result) == [("mismatched_model", 2, "body.model"), ("mismatched_model", 4, "body.model")]
    assert result.model == "m"


async def test_an_empty_file_and_one_of_blank_lines_fail_as_empty() -> None:
    for data in (b"", b"\n  \n\n"):
        result = await validate_input(physical_lines(data), endpoint=CHAT, max_lines=10, max_bytes=100)
        assert codes(result) == [("empty_file", None, "input_file_id")]


async def test_more_requests_than_the_bound_stop_the_reading_at_the_first_one_past_it() -> None:
    read: list[int] = []

    async def counted(data: bytes) -> AsyncIterator[tuple[int, bytes]]:
        async for item in physical_lines(data):
            read.append(item[0])
            yield item

    data = "".join(line(f"c{i}") + "\n" for i in range(10)).encode()
    result = await validate_input(counted(data), endpoint=CHAT, max_lines=3, max_bytes=1 << 20)
    assert codes(result) == [("too_many_requests", 4, "input_file_id")]
    assert len(read) == 4


async def test_more_bytes_than_the_bound_stop_the_reading_at_the_line_past_it() -> None:
    one = line("c0")
    result = await validate(*(line(f"c{i}") for i in range(5)), max_bytes=2 * (len(one) + 1) + 3)
    assert codes(result) == [("file_too_large", 3, "input_file_id")]


async def test_every_error_is_counted_and_the_first_hundred_kept() -> None:
    result = await validate(*(["{bad"] * (MAX_ERRORS_KEPT + 5)))
    assert result.error_count == MAX_ERRORS_KEPT + 5 and len(result.errors) == MAX_ERRORS_KEPT
    assert [error["line"] for error in result.errors] == list(range(1, MAX_ERRORS_KEPT + 1))
