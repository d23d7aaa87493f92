"""Stored Responses API responses, in Redis so that any gateway answers for any of them and
a gateway that dies loses none: what the request asked (its body, model, creation time and
the chat messages before its input) under ``streamq:response:<request_id>``, kept as long as
the request's replay log, which holds its output. Who may read one is the request's owner
key (``KeyLimiter.claim``), as for a request's status.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgspec

from gateway.key_limits import OWNER_TTL_MS
from streamq.protocol.names import RESPONSE_KEY_PREFIX


class StoredResponse(msgspec.Struct, kw_only=True):
    """What a stored response's request asked."""

    body: dict[str, Any]
    """The Responses API body as its client sent it."""
    model: str
    created_at: int
    history: list[dict[str, Any]] = msgspec.field(default_factory=list)
    """The chat messages of the conversation it continues (``previous_response_id``)."""


@dataclass
class ResponseStore:
    """Reads and writes stored responses on the gateway's Redis."""

    redis: Any
    _decoder: msgspec.json.Decoder[StoredResponse] = field(default_factory=lambda: msgspec.json.Decoder(StoredResponse))

    async def save(self, request_id: str, stored: StoredResponse) -> None:
        await self.redis.set(RESPONSE_KEY_PREFIX + request_id, msgspec.json.encode(stored), px=OWNER_TTL_MS)

    async def load(self, request_id: str) -> StoredResponse | None:
        raw = await self.redis.get(RESPONSE_KEY_PREFIX + request_id)
        return None if raw is None else self._decoder.decode(raw)
