"""STUB: owned by the batches helper (see the design notes)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Validation:
    total: int = 0
    model: str | None = None
    errors: list[dict[str, Any]] = field(default_factory=list)


async def validate_input(
    lines: AsyncIterator[tuple[int, bytes]], *, endpoint: str, max_lines: int, max_bytes: int
) -> Validation:
    raise NotImplementedError
