"""A worker asked to stop ends its loop and shuts down even when the one cancellation arq
sends its loop is lost (on Python 3.11, a cancellation landing as an ``asyncio.wait_for``
inside the loop completes is dropped: CI saw workers hang on SIGTERM this way), and
``stop_task`` stops a task that drops a cancellation. Its probes on the metrics port say
when it may be routed to (``/ready``: registered, and not draining to stop) and whether
its engine lives (``/health``)."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import socket
import uuid
import warnings
from typing import Any

import httpx
import pytest

from devkit.redis_server import free_port
from devkit.worker_process import SCRIPTED_ENGINE
from producer.client import StreamqClient
from streamq.protocol import ChunkEvent
from streamq.tasks import stop_task

with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)  # torch's own, raised while vLLM imports
    from worker import metrics
    from worker.arq_worker import StreamqWorker
    from worker.config import WorkerConfig
    from worker.presence import Presence
    from worker.state import STATE_KEY, state_of


class DroppedCancel:
    """Stands in for arq's handle on the loop's task: the cancellation it sends is lost."""

    def __init__(self) -> None:
        self.cancels = 0

    def cancel(self) -> bool:
        self.cancels += 1
        return True


async def test_the_loop_ends_when_the_cancellation_that_stops_it_is_lost(redis_url: str) -> None:
    config = WorkerConfig(
        redis_url=redis_url,
        queue="streamq:queue:shutdown-test",  # inside the roles' queue patterns: it registers on the shared Redis
        max_jobs=256,
        engine_factory="devkit.scripted_engine:create",
        metrics_port=0,
        cpu_nice=0,
    )
    worker = StreamqWorker(config, handle_signals=False)
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


async def _answer(http: httpx.AsyncClient, path: str) -> httpx.Response:
    """``path``'s answer, once the worker's endpoint is up (refused until its engine is)."""
    async with asyncio.timeout(60):
        while True:
            with contextlib.suppress(httpx.ConnectError):
                return await http.get(path)
            await asyncio.sleep(0.05)


async def test_ready_once_registered_and_until_the_drain_health_until_the_engine_dies(
    redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    registering = asyncio.Event()
    register = Presence.start

    async def held_registration(self: Presence) -> None:
        await registering.wait()
        await register(self)

    monkeypatch.setattr(Presence, "start", held_registration)
    port, queue = free_port(), f"streamq:queue:probes-{uuid.uuid4().hex[:8]}"
    config = WorkerConfig(
        redis_url=redis_url,
        queue=queue,
        drain_seconds=60,
        max_jobs=256,
        engine_factory=SCRIPTED_ENGINE,
        metrics_port=port,
        cpu_nice=0,
    )
    worker = StreamqWorker(config, handle_signals=False)
    loop_task = asyncio.ensure_future(worker.main())
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=10) as http:
            before = await _answer(http, "/ready")
            assert (before.status_code, before.text) == (503, "not ready: not registered yet\n")
            registering.set()
            async with asyncio.timeout(30):
                while (ready := await http.get("/ready")).status_code != 200:
                    await asyncio.sleep(0.05)
            assert ready.text == "ready\n"
            assert (await http.get("/health")).status_code == 200
            for path in ("/metrics", "/"):  # every other path: the exposition
                scrape = await http.get(path)
                assert scrape.status_code == 200 and "streamq_requests_in_flight" in scrape.text

            async with await StreamqClient.connect(redis_url, queue=queue) as client:
                running = await client.submit("Keep going", max_tokens=3000, ignore_eos=True)  # 30 s of tokens
                assert isinstance(await anext(aiter(running)), ChunkEvent)
                worker.handle_sig_wait_for_completion(signal.SIGTERM)  # what arq's SIGTERM handler runs
                draining = await http.get("/ready")
                assert (draining.status_code, draining.text) == (503, "not ready: stopping: takes no more jobs\n")
                assert (await http.get("/health")).status_code == 200
                assert [task.done() for task in worker.tasks.values()] == [False]  # still draining

                state_of(worker.ctx).engine_dead = True
                dead = await http.get("/health")
                assert (dead.status_code, dead.text) == (503, "unhealthy: the engine died\n")
                assert (await http.get("/ready")).text == "not ready: the engine died\n"
                await client.cancel(running.request_id)
    finally:
        await stop_task(loop_task)
        await worker.close()
    with pytest.raises(httpx.ConnectError):  # the port is closed with the worker
        async with httpx.AsyncClient() as http:
            await http.get(f"http://127.0.0.1:{port}/ready")


def test_a_taken_metrics_port_costs_only_the_endpoint(caplog: pytest.LogCaptureFixture) -> None:
    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        port: Any = taken.getsockname()[1]
        assert metrics.serve_metrics(port) is None
    assert f"metrics endpoint not started: port {port}" in caplog.text
