"""STUB: owned by the batches helper (see the design notes)."""

from __future__ import annotations

from prometheus_client import Counter

LINES = Counter("streamq_batch_lines", "Batch lines answered", ["result"])
