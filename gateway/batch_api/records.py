"""STUB: owned by the batches helper (see the design notes)."""

from __future__ import annotations

from typing import Any

from gateway.batch_api.config import BatchApiConfig


class BatchStore:
    def __init__(self, redis: Any, config: BatchApiConfig) -> None:
        self.redis, self.config = redis, config
