"""Requests generated from ``vllm serve``'s own OpenAPI schema, sent to it and to the
gateway: the way a property-based fuzzer (schemathesis) finds where the two answer
differently.

The cases are drawn by hypothesis with ``derandomize``: the same cases every run, so a
difference found once is found again, never a flake. Each body is sent as drawn, except
that it names the served model (a drawn model name is unknown to both) and asks for a few
tokens at most (the drawn counts go up to 2^53).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import httpx
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings

TOKEN_FIELDS = ("max_tokens", "max_completion_tokens", "n", "best_of")
"""Drawn counts capped at ``MAX_COUNT`` when positive (a negative or zero one is left, to
be refused)."""
MAX_COUNT = 2


@dataclass(frozen=True)
class Answers:
    """One drawn body and how each server answered it."""

    body: Any
    serve_status: int
    gateway_status: int
    gateway_text: str

    def describe(self) -> str:
        return (
            f"vllm serve {self.serve_status}, gateway {self.gateway_status} "
            f"({self.gateway_text[:300]}) for {json.dumps(self.body)[:400]}"
        )


def drawn_bodies(schema: dict[str, Any], path: str, count: int) -> list[Any]:
    """``count`` request bodies for ``POST path`` drawn from ``schema`` (the same each run)."""
    operation = schemathesis.openapi.from_dict(schema)[path]["POST"]
    bodies: list[Any] = []

    @settings(
        max_examples=count,
        derandomize=True,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
        phases=[Phase.generate],
    )
    @given(case=operation.as_strategy())
    def draw(case: Any) -> None:
        bodies.append(case.body)

    draw()
    return bodies


def bounded(body: Any, model: str) -> Any:
    """``body`` naming ``model`` and asking for at most ``MAX_COUNT`` tokens and choices."""
    if not isinstance(body, dict):
        return body
    body = {**body, "model": model}
    for name in TOKEN_FIELDS:
        value = body.get(name)
        if isinstance(value, int) and not isinstance(value, bool) and value > MAX_COUNT:
            body[name] = MAX_COUNT
    return body


def answered(serve_url: str, gateway_url: str, path: str, body: Any) -> Answers:
    """``body`` sent to both servers (streams read to their end)."""
    statuses = []
    text = ""
    for url in (serve_url, gateway_url):
        response = httpx.post(url + path, json=body, timeout=120)
        statuses.append(response.status_code)
        text = response.text
    return Answers(body, statuses[0], statuses[1], text)
