"""``make dashboard-pictures``: the dashboard's pictures in docs/, made again.

A throwaway Redis, one worker on the tiny random model (served as ``tiny-llama``, a few
slots) and a gateway; Chromium (Playwright) opens the dashboard first, so the gateway
samples for the whole run, then bursts of requests of different lengths (a few refused,
a few cancelled) run for ``--seconds``. Then it writes ``dashboard-overview.png``,
``-workers.png``, ``-requests.png``, ``-request.png`` (a request streaming) and
``-playground.png`` (a completion from the playground) at 1280 px wide, and stops
everything, as it does on Ctrl-C or SIGTERM. The model's text is noise.

    python -m devkit.dashboard_pictures [--seconds 180] [--out docs]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import random
import re
import secrets
import signal
import sys
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from playwright.sync_api import Error as PlaywrightError
from playwright.sync_api import Page, expect, sync_playwright

from devkit.browser import CHROMIUM, launch_chromium
from devkit.gateway_process import GatewayProcess
from devkit.redis_server import RedisServer
from devkit.tiny_model import DEFAULT_DIR, build_tiny_model
from devkit.worker_process import WorkerProcess, tiny_engine_flags
from producer.client import RequestHandle, StreamqClient
from producer.errors import RequestError
from streamq.protocol.roles import GATEWAY, PRODUCER, WORKER

MODEL = "tiny-llama"
SLOTS = 6
MAX_MODEL_LEN = 1024
LOGS = Path(".cache")
WIDTH = 1280
WAIT_MS = 60_000
TOPICS = ["queues", "workers", "streams", "tokens", "latency", "backpressure"]


async def _finish(handle: RequestHandle) -> None:
    """Read a request to its end (so its events do not pile up); an error event is expected."""
    with contextlib.suppress(RequestError):
        await handle.result()


async def traffic(url: str, stop: threading.Event) -> None:
    """Bursts that swell and ebb over about 80 s, of requests from 40 to 600 tokens, from
    three tenants at two priorities; about 1 in 30 is refused (a regex that does not
    compile) and now and then a running one is cancelled. At ``stop``, what still runs
    is cancelled and read to its end."""
    rng = random.Random(7)
    tasks: dict[str, tuple[RequestHandle, asyncio.Task[None]]] = {}
    async with StreamqClient.connect(url) as client:
        started = time.monotonic()
        while not stop.is_set():
            wave = math.sin((time.monotonic() - started) / 80 * 2 * math.pi)
            for _ in range(1 + round(2.5 * (1 + wave))):
                sampling: dict[str, Any] = {"max_tokens": rng.choice([40, 120, 250, 400, 600]), "ignore_eos": True}
                if rng.random() < 1 / 30:
                    sampling["structured_outputs"] = {"regex": "(unclosed"}
                handle = await client.submit(
                    f"Tell me about {rng.choice(TOPICS)}.",
                    model=MODEL,
                    request_id=f"req-{uuid.uuid4().hex[:12]}",
                    tenant=rng.choice(["default", "acme", "globex"]),
                    priority=rng.choice([0, 0, 0, 5]),
                    **sampling,
                )
                tasks[handle.request_id] = (handle, asyncio.create_task(_finish(handle)))
            for request_id in [key for key, (_, task) in tasks.items() if task.done()]:
                del tasks[request_id]
            if tasks and rng.random() < 0.15:
                await rng.choice(list(tasks.values()))[0].cancel()
            await asyncio.sleep(rng.uniform(2.0, 4.0))
        for handle, _ in tasks.values():
            await handle.cancel()
        await asyncio.wait_for(asyncio.gather(*(task for _, task in tasks.values())), timeout=60)


def tid(name: str) -> str:
    return f'[data-testid="{name}"]'


def picture(page: Page, path: Path, max_height: int | None = None) -> None:
    """A screenshot of the page as tall as its content (no empty band below), at most ``max_height``."""
    bottom = int(page.evaluate("Math.ceil(document.querySelector('main').getBoundingClientRect().bottom + scrollY)"))
    height = min(bottom, max_height) if max_height else bottom
    page.screenshot(path=path, full_page=True, clip={"x": 0, "y": 0, "width": WIDTH, "height": height})


def open_view(page: Page, view: str) -> None:
    """Click a view in the page's menu and wait until its live snapshot is drawn."""
    page.get_by_test_id(f"nav-{view}").click()
    expect(page.get_by_test_id("live-status")).to_have_text("live", timeout=WAIT_MS)
    page.wait_for_timeout(1500)  # a snapshot or two drawn


async def submit_long(url: str) -> str:
    """One request that streams for many seconds (ahead of the queue: lower runs sooner), left running; its id."""
    async with StreamqClient.connect(url) as client:
        handle = await client.submit(
            "Tell me a long story.",
            model=MODEL,
            request_id=f"req-{uuid.uuid4().hex[:12]}",
            max_tokens=MAX_MODEL_LEN - 32,
            ignore_eos=True,
            priority=-1,
        )
        await handle.close()
        return handle.request_id


def watch_request(page: Page, request_id: str) -> None:
    """Open the request's view and wait until its tokens stream in, live."""
    page.evaluate("id => { location.hash = `#/requests/${id}`; }", request_id)
    expect(page.get_by_test_id("request-id")).to_have_text(request_id, timeout=WAIT_MS)
    # The page's own tokens/s shows once it has seen half a second of live tokens.
    expect(page.get_by_test_id("timing-tokens-per-s")).to_have_text(re.compile(r"^[0-9]"), timeout=WAIT_MS)
    page.wait_for_timeout(500)


def shoot(page: Page, out: Path, producer_url: str) -> None:
    """The pictures, while the traffic still runs (all but the playground's)."""
    open_view(page, "overview")
    picture(page, out / "dashboard-overview.png")

    open_view(page, "workers")
    expect(page.locator(f"{tid('worker-row')} {tid('worker-state')}").first).to_have_text("live")
    picture(page, out / "dashboard-workers.png")

    open_view(page, "requests")
    expect(page.locator(tid("running-row")).first).to_be_visible(timeout=WAIT_MS)
    picture(page, out / "dashboard-requests.png", max_height=860)  # the recent ends run far below

    with ThreadPoolExecutor(1) as pool:  # Playwright's sync API holds this thread's event loop
        request_id = pool.submit(asyncio.run, submit_long(producer_url)).result()
    watch_request(page, request_id)
    picture(page, out / "dashboard-request.png")
    if page.get_by_test_id("cancel-button").is_visible():  # as a person would, once seen enough
        page.get_by_test_id("cancel-button").click()
        expect(page.get_by_test_id("request-state")).to_have_text("finished", timeout=WAIT_MS)


def shoot_playground(page: Page, out: Path) -> None:
    open_view(page, "playground")
    expect(page.get_by_test_id("pg-model")).to_contain_text(MODEL, timeout=WAIT_MS)
    page.get_by_test_id("pg-model").select_option(MODEL)
    page.get_by_test_id("pg-mode-completion").check()
    page.get_by_test_id("pg-prompt").fill("Once upon a time")
    page.get_by_test_id("pg-max-tokens").fill("64")
    page.get_by_test_id("pg-ignore-eos").check()  # the random model may end early otherwise
    page.get_by_test_id("pg-send").click()
    expect(page.get_by_test_id("pg-finish")).to_have_text("length", timeout=WAIT_MS)
    picture(page, out / "dashboard-playground.png")


def run(redis: RedisServer, seconds: float, out: Path) -> None:
    LOGS.mkdir(parents=True, exist_ok=True)
    for log in ("worker", "gateway"):
        (LOGS / f"dashboard-pictures-{log}.log").write_text("")
    flags = tiny_engine_flags(build_tiny_model(DEFAULT_DIR), max_model_len=MAX_MODEL_LEN)
    flags += ["--served-model-name", MODEL, "--max-jobs", str(SLOTS)]
    worker = WorkerProcess(redis.url_for(WORKER), flags, log_path=LOGS / "dashboard-pictures-worker.log")
    gateway = GatewayProcess(redis.url_for(GATEWAY), LOGS / "dashboard-pictures-gateway.log")
    stop = threading.Event()
    producer = threading.Thread(target=lambda: asyncio.run(traffic(redis.url_for(PRODUCER), stop)), name="traffic")
    try:
        gateway.wait_ready()
        print(f"dashboard-pictures: starting a worker (log: {worker.log_path}) ...", flush=True)
        worker.start().wait_ready()
        with sync_playwright() as playwright:
            browser = launch_chromium(playwright)
            page = browser.new_page(viewport={"width": WIDTH, "height": 860})
            page.goto(f"{gateway.url}/dashboard#/overview")  # from now on the gateway samples
            expect(page.get_by_test_id("live-status")).to_have_text("live", timeout=WAIT_MS)
            producer.start()
            print(f"dashboard-pictures: {seconds:.0f} s of traffic; watching {gateway.url}/dashboard", flush=True)
            deadline = time.monotonic() + seconds
            while time.monotonic() < deadline:
                if not producer.is_alive():
                    raise RuntimeError("the traffic stopped early (see above)")
                page.wait_for_timeout(1000)
            shoot(page, out, redis.url_for(PRODUCER))
            stop.set()
            producer.join()
            shoot_playground(page, out)
            browser.close()
        print(f"dashboard-pictures: wrote {out}/dashboard-{{overview,workers,requests,request,playground}}.png")
    finally:
        # A second Ctrl-C must not leave processes behind while these stop.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        stop.set()
        if producer.is_alive():
            producer.join(timeout=90)  # it cancels what still runs, while the worker is up
        print(f"dashboard-pictures: gateway stopped (exit code {gateway.stop()})", flush=True)
        print(f"dashboard-pictures: worker stopped (exit code {worker.stop()})", flush=True)


_interrupted = threading.Event()


def _interrupt(signum: int, frame: object) -> None:
    """Ctrl-C or SIGTERM. A terminal's Ctrl-C reaches Chromium too, so Playwright may
    report its browser gone rather than the interrupt: the flag tells the two apart."""
    _interrupted.set()
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m devkit.dashboard_pictures", description="The dashboard's pictures in docs/, made again."
    )
    parser.add_argument("--seconds", type=float, default=180, help="how long the traffic runs first (default 180)")
    parser.add_argument("--out", type=Path, default=Path("docs"), help="where the pictures go (default docs)")
    args = parser.parse_args(argv)
    if args.seconds <= 0:
        parser.error("--seconds must be above 0")
    if not Path(CHROMIUM).exists():
        parser.error(f"no {CHROMIUM}: install Debian's chromium package")
    args.out.mkdir(parents=True, exist_ok=True)
    signal.signal(signal.SIGINT, _interrupt)
    signal.signal(signal.SIGTERM, _interrupt)
    started = time.monotonic()
    try:
        with RedisServer(user="streamq", password=secrets.token_hex(16)) as redis:
            run(redis, args.seconds, args.out)
    except (KeyboardInterrupt, PlaywrightError):
        if not _interrupted.is_set():
            raise
        print("\ndashboard-pictures: interrupted; stopped everything", flush=True)
        return 130
    print(f"dashboard-pictures: done in {time.monotonic() - started:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
