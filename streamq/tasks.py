"""Stopping the background tasks that both sides run (readers, flushers, leases)."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any


async def stop_task(task: asyncio.Task[Any] | None) -> None:
    """Cancel ``task`` and wait until it has finished; ``None`` is a no-op."""
    if task is None:
        return
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
