"""A worker asked to stop ends its loop and shuts down even when the one cancellation arq
sends its loop is lost (on Python 3.11, a cancellation landing as an ``asyncio.wait_for``
inside the loop completes is dropped: CI saw workers hang on SIGTERM this way), and
``stop_task`` stops a task that drops a cancellation."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import warnings

import pytest

from streamq.broker.connection import redis_settings_for
from streamq.tasks import stop_task

with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)  # torch's own, raised while vLLM imports
    from worker.arq_worker import StreamqWorker
    from worker.options import OPTIONS_KEY, WorkerOptions
    from worker.settings import worker_settings
    from worker.state import STATE_KEY


class DroppedCancel:
    """Stands in for arq's handle on the loop's task: the cancellation it sends is lost."""

    def __init__(self) -> None:
        self.cancels = 0

    def cancel(self) -> bool:
        self.cancels += 1
        return True


async def test_the_loop_ends_when_the_cancellation_that_stops_it_is_lost(redis_url: str) -> None:
    options = WorkerOptions(engine_factory="devkit.scripted_engine:create", metrics_port=0, cpu_nice=0)
    settings = worker_settings(
        redis_settings=redis_settings_for(redis_url), queue_name="streamq:shutdown-test", ctx={OPTIONS_KEY: options}
    )
    worker = StreamqWorker(**settings, handle_signals=False, max_jobs_from_engine=False)
    loop_task = asyncio.ensure_future(worker.main())
    try:
        async with asyncio.timeout(60):
            while STATE_KEY not in worker.ctx:  # started up, then polling
                await asyncio.sleep(0.05)
            await asyncio.sleep(0.5)
        lost = DroppedCancel()
        worker.main_task = lost  # type: ignore[assignment]
        await worker._wait_for_tasks_to_complete(signal.SIGTERM)  # arq's graceful stop, after the drain
        assert lost.cancels == 1
        async with asyncio.timeout(10):
            await loop_task  # ends by itself, not cancelled
        assert not loop_task.cancelled()
    finally:
        await stop_task(loop_task)
        await worker.close()


async def test_stop_task_stops_a_task_that_drops_a_cancellation() -> None:
    dropped = asyncio.Event()

    async def stubborn() -> None:
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            dropped.set()  # as wait_for does when its inner call completes at the same moment
        await asyncio.sleep(3600)

    task = asyncio.ensure_future(stubborn())
    await asyncio.sleep(0)
    started = asyncio.get_running_loop().time()
    async with asyncio.timeout(30):
        await stop_task(task)
    assert dropped.is_set() and task.cancelled()
    assert asyncio.get_running_loop().time() - started < 10  # cancelled again, not left to the timeout


async def test_stop_task_raises_what_the_task_failed_with_and_lets_its_caller_be_cancelled() -> None:
    async def failing() -> None:
        raise ValueError("broken")

    failed = asyncio.ensure_future(failing())
    await asyncio.sleep(0)
    with pytest.raises(ValueError, match="broken"):
        await stop_task(failed)

    release = asyncio.Event()

    async def unstoppable() -> None:
        while not release.is_set():
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.sleep(3600)

    held = asyncio.ensure_future(unstoppable())
    caller = asyncio.ensure_future(stop_task(held))
    await asyncio.sleep(0.1)
    caller.cancel()  # whoever waits for a task to stop can itself be stopped
    with pytest.raises(asyncio.CancelledError):
        await caller
    release.set()
    await stop_task(held)
