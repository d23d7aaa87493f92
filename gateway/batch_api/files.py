"""STUB: owned by the files helper (see the design notes)."""

from __future__ import annotations

from typing import Any

from gateway.batch_api.config import BatchApiConfig
from gateway.batch_api.storage import Storage


class FileStore:
    def __init__(self, redis: Any, storage: Storage, config: BatchApiConfig) -> None:
        self.redis, self.storage, self.config = redis, storage, config

    def start(self) -> None:
        pass

    async def stop(self) -> None:
        pass
