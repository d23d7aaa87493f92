"""A streamed response's chunks as Server-Sent Events, ended by ``data: [DONE]``.

Resumable requests label each event with ``id: <seq>`` (the replay log's sequence number).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from producer.openai_api.responses import ChunkBuilder
from streamq.protocol import TERMINAL_EVENTS, ChunkEvent, ErrorEvent, FinalEvent

DONE = "data: [DONE]\n\n"


def sse(data: dict[str, Any], seq: int | None) -> str:
    """One SSE event; ``id:`` only on resumable streams (some clients, ``vllm bench serve``
    among them, read every event as ``data:`` alone)."""
    prefix = f"id: {seq}\n" if seq is not None else ""
    return f"{prefix}data: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n"


@dataclass
class StreamEncoder:
    """Turns one request's events into SSE text, in order."""

    chunks: ChunkBuilder
    event_ids: bool

    def encode(self, event: ChunkEvent | FinalEvent | ErrorEvent) -> str:
        seq = event.seq if self.event_ids else None
        text = "".join(sse(chunk, seq) for chunk in self.chunks.chunks(event))
        return text + DONE if isinstance(event, TERMINAL_EVENTS) else text
