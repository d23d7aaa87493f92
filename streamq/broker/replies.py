"""Redis replies as text: redis-py returns bytes or str depending on how the client was
made (``decode_responses``), and streamq's code takes either."""

from __future__ import annotations


def as_text(value: bytes | str) -> str:
    """``value`` as a str, decoding bytes as UTF-8."""
    return value.decode() if isinstance(value, bytes) else value
