"""Stopping the background tasks that both sides run (readers, flushers, leases)."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

CANCEL_AGAIN_AFTER_S = 1.0


async def stop_task(task: asyncio.Task[Any] | None) -> None:
    """Cancel ``task`` and wait until it has finished; ``None`` is a no-op; an error it
    ended with is raised here.

    Cancelled again every ``CANCEL_AGAIN_AFTER_S`` until it is done: on Python 3.11 a
    cancellation that lands just as an ``asyncio.wait_for`` inside the task completes is
    dropped (redis-py sends every command through one), and the task would run on while
    this waited for ever. A cancellation of the caller itself goes through."""
    if task is None:
        return
    while not task.done():
        task.cancel()
        await asyncio.wait((task,), timeout=CANCEL_AGAIN_AFTER_S)
    with contextlib.suppress(asyncio.CancelledError):
        task.result()
