"""One line of an OpenAI batch file (``{"custom_id", "method", "url", "body"}``), checked:
what ``streamq batch`` (``producer.batch``) and the gateway's Batch API
(``gateway.batch_api.validate``) both refuse in a line, with OpenAI's error code where it
has one, so that the two read a file alike."""

from __future__ import annotations

import json
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any, Final

LINE_FIELDS: Final = frozenset({"custom_id", "method", "url", "body"})


@dataclass(frozen=True)
class LineProblem:
    """Why a line cannot run: OpenAI's batch error ``code``, a ``message`` for a person,
    and the ``param`` at fault (``body.stream``, ``url``...) where there is one."""

    code: str
    message: str
    param: str | None = None


@dataclass(frozen=True)
class RequestLine:
    """A parsed line: ``custom_id`` is set once the line has a string one (even when a
    later check fails), ``body`` only when every check passed."""

    custom_id: str | None
    url: str = ""
    body: dict[str, Any] | None = None
    problem: LineProblem | None = None


def parse_request_line(raw: str | bytes, urls: Collection[str]) -> RequestLine:
    """Check one non-blank line of a batch file; ``urls``: the endpoints a line may name
    (one: the batch's own endpoint, as the Batch API requires)."""
    try:
        obj = json.loads(raw)
    except (ValueError, RecursionError) as exc:  # not UTF-8 is a ValueError too; nesting past the stack
        return RequestLine(None, problem=LineProblem("invalid_json_line", f"not valid JSON: {exc}"))
    if not isinstance(obj, dict):
        return RequestLine(None, problem=LineProblem("invalid_json_line", "must be a JSON object"))
    if "custom_id" not in obj:
        return RequestLine(None, problem=_missing("custom_id"))
    custom_id = obj["custom_id"]
    if not isinstance(custom_id, str):
        return RequestLine(None, problem=LineProblem("invalid_type", "custom_id must be a string", "custom_id"))
    url = str(obj.get("url"))
    return RequestLine(custom_id, url, *_body_or_problem(obj, urls))


def _body_or_problem(obj: dict[str, Any], urls: Collection[str]) -> tuple[dict[str, Any] | None, LineProblem | None]:
    unknown = sorted(set(obj) - LINE_FIELDS)
    if unknown:
        message = f"unknown field(s) in the batch line: {', '.join(unknown)}"
        return None, LineProblem("unknown_parameter", message, unknown[0])
    for field in ("method", "url", "body"):
        if field not in obj:
            return None, _missing(field)
    if obj["method"] != "POST":
        return None, LineProblem("invalid_method", f"method must be POST, got {obj['method']!r}", "method")
    if obj["url"] not in urls:
        return None, LineProblem("invalid_url", _url_message(obj["url"], urls), "url")
    body = obj["body"]
    if not isinstance(body, dict):
        return None, LineProblem("invalid_type", "body must be a JSON object", "body")
    if body.get("stream"):
        message = "a batch request must not be sent in stream mode"
        return None, LineProblem("streaming_unsupported", message, "body.stream")
    return body, None


def _missing(field: str) -> LineProblem:
    return LineProblem("missing_required_parameter", f"missing required parameter: {field}", field)


def _url_message(url: Any, urls: Collection[str]) -> str:
    if len(urls) == 1:
        (endpoint,) = urls
        return f"URL {url!r} does not match the batch's endpoint {endpoint!r}"
    return f"URL {url!r} is not supported; supported: {', '.join(urls)}"
