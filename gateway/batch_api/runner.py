"""STUB: the runner (lead's)."""

from __future__ import annotations

from typing import Any


class BatchRunner:
    def __init__(self, client: Any, files: Any, batches: Any, auth: Any, limiter: Any, config: Any) -> None:
        pass

    def start(self) -> None:
        pass

    async def stop(self) -> None:
        pass
