"""The body of a completion callback and its signature.

A request that carries ``callback`` gets one POST of ``CallbackBody`` (JSON) when it ends,
signed with HMAC-SHA256 over ``<timestamp>.<body bytes>``; ``verify`` is what a receiver
runs (PROTOCOL.md shows the same in a few lines for any language).
"""

from __future__ import annotations

import hashlib
import hmac
import time
from typing import Literal

import msgspec

from streamq.protocol.names import PROTOCOL_VERSION

SIGNATURE_SCHEME = "sha256="
DEFAULT_TOLERANCE_S = 300
"""How old a delivery ``verify`` accepts, by its timestamp header."""


class CallbackError(msgspec.Struct):
    code: str
    message: str


class CallbackBody(msgspec.Struct, omit_defaults=True):
    """What a request's callback URL receives when the request ends."""

    request_id: str
    state: Literal["finished", "failed"]
    ended_ms: int
    """Unix ms (Redis's clock) when the request ended."""
    finish_reasons: list[str] | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    texts: list[str] | None = None
    """Finished, unless the callback asked ``include_text: false``: the whole text of each
    completion, in index order."""
    error: CallbackError | None = None
    """Failed: the error event's code and message."""
    v: int = PROTOCOL_VERSION


def signature(secret: str | bytes, timestamp: str, body: bytes) -> str:
    """The ``X-Streamq-Signature`` value of ``body`` sent at ``timestamp`` (Unix seconds)."""
    key = secret.encode() if isinstance(secret, str) else secret
    digest = hmac.new(key, timestamp.encode() + b"." + body, hashlib.sha256).hexdigest()
    return SIGNATURE_SCHEME + digest


def verify(
    secret: str | bytes,
    timestamp: str,
    signed: str,
    body: bytes,
    *,
    tolerance_s: float = DEFAULT_TOLERANCE_S,
    now: float | None = None,
) -> bool:
    """True if ``signed`` (the signature header) is ``body``'s, made at ``timestamp`` (the
    timestamp header) no more than ``tolerance_s`` from ``now``: a receiver's check."""
    try:
        age = abs((time.time() if now is None else now) - int(timestamp))
    except ValueError:
        return False
    return age <= tolerance_s and hmac.compare_digest(signature(secret, timestamp, body), signed)
