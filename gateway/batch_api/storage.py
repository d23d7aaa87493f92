"""STUB: owned by the files helper (see the design notes)."""

from __future__ import annotations

from typing import Any


class Storage:
    @classmethod
    def from_url(cls, url: str, s3_options: dict[str, str]) -> Storage:
        return cls()

    def __getattr__(self, name: str) -> Any:
        raise NotImplementedError(name)
