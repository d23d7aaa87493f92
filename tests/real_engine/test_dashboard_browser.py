"""The dashboard in a real browser: Debian's Chromium driven by Playwright (sync API),
against a real gateway process, real Redis and the session worker on the tiny model.

What a person does and sees: the overview shows the worker and a queue filling up; a
prompt sent from the playground streams its tokens into the page and shows its final; a
running request clicked in the Requests view shows its tokens arriving; Cancel on the page
ends a request as ``cancelled`` (the page says so, and so do the request's status and final
event); the overview fits a phone's width. Each test writes screenshots of what it saw to
``.cache/screenshots/`` (docs/'s pictures come from ``make dashboard-pictures``).

Playwright's sync API cannot run inside a running event loop, so these tests are plain
functions and the producer side (submitting, status, cancel) runs a ``StreamqClient`` on an
event loop of its own thread.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest
import redis.asyncio as aioredis
from playwright.sync_api import Browser, Page, sync_playwright
from playwright.sync_api import Error as PlaywrightError

from devkit.browser import CHROMIUM, launch_chromium
from devkit.gateway_process import GatewayProcess
from devkit.worker_process import WorkerProcess
from producer.client import RequestHandle, StreamqClient
from producer.errors import RequestError
from streamq.broker.registry import WorkerRegistry
from streamq.protocol import WorkerRegistration
from tests.support.session import MAX_MODEL_LEN, OPERATOR_KEY

T = TypeVar("T")

SCREENSHOTS = Path(__file__).resolve().parents[2] / ".cache" / "screenshots"
LAPTOP = {"width": 1280, "height": 860}
PHONE = {"width": 375, "height": 800}
LONG = {"max_tokens": MAX_MODEL_LEN - 32, "ignore_eos": True}
"""Sampling that keeps a request streaming for many seconds on the tiny model."""
WAIT_S = 60.0
"""How long the page may take to show something (a guard against hanging, not a measure)."""


async def _awaiting(work: Awaitable[T]) -> T:
    """``work`` as a coroutine, which is what a loop in another thread runs (``connect``
    gives an awaitable that is not one)."""
    return await work


class Producer:
    """A ``StreamqClient`` (the producer role) on an event loop of its own thread."""

    def __init__(self, url: str, queue: str, admin_url: str) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="producer-loop", daemon=True)
        self._thread.start()
        self.client: StreamqClient = self.call(StreamqClient.connect(url, queue=queue))
        self.admin: aioredis.Redis = self.call(self._admin(admin_url))

    @staticmethod
    async def _admin(url: str) -> aioredis.Redis:
        return aioredis.Redis.from_url(url)

    def call(self, work: Awaitable[T], timeout_s: float = 120) -> T:
        return asyncio.run_coroutine_threadsafe(_awaiting(work), self._loop).result(timeout_s)

    def submit(self, prompt: str, **kwargs: Any) -> RequestHandle:
        return self.call(self.client.submit(prompt, request_id=f"dash-{uuid.uuid4().hex[:12]}", **kwargs))

    def end(self, handle: RequestHandle) -> None:
        """Cancel the request if it still runs, and read its stream to the end."""
        if handle.done:
            return
        self.call(self.client.cancel(handle.request_id, queue=handle.job_queue))
        self.call(handle.result())

    def close(self) -> None:
        self.call(self.client.close())
        self.call(self.admin.aclose())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()


@pytest.fixture(scope="module")
def producer(worker: WorkerProcess, producer_url: str, redis_url: str) -> Iterator[Producer]:
    producer = Producer(producer_url, worker.queue, redis_url)
    yield producer
    producer.close()


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    if not Path(CHROMIUM).exists():
        if os.environ.get("CI"):
            pytest.fail(f"{CHROMIUM} is not installed; .ci/run installs Debian's chromium")
        pytest.skip(f"no {CHROMIUM} (Debian's chromium package)")
    with sync_playwright() as playwright:
        browser = launch_chromium(playwright)
        yield browser
        browser.close()


@pytest.fixture(scope="module")
def screenshots() -> Path:
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    return SCREENSHOTS


@pytest.fixture
def page(browser: Browser) -> Iterator[Page]:
    """A fresh tab at laptop size; any uncaught script error on it fails the test."""
    context = browser.new_context(viewport=LAPTOP)
    context.set_default_timeout(10_000)  # an element that is not there yet fails one poll of wait_until, not the test
    page = context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda error: errors.append(str(error)))
    yield page
    context.close()
    assert not errors, f"script errors on the page: {errors}"


def page_text(page: Page) -> str:
    try:
        return page.inner_text("body")[:6000]
    except PlaywrightError as exc:
        return f"(could not read the page: {exc})"


def wait_until(page: Page, what: str, check: Callable[[], T], timeout_s: float = WAIT_S) -> T:
    """Poll ``check`` until it returns something true; fail saying ``what`` was awaited,
    what was seen last, and the page's text."""
    deadline = time.monotonic() + timeout_s
    last: object = None
    while True:
        try:
            result = check()
        except PlaywrightError as exc:
            last = exc
        else:
            if result:
                return result
            last = result
        if time.monotonic() > deadline:
            pytest.fail(f"{what}: not seen (last: {last!r})\n--- the page ({page.url}) ---\n{page_text(page)}")
        page.wait_for_timeout(200)


def text_of(page: Page, selector: str) -> str:
    """The text of the first element matching ``selector``, or '' when there is none."""
    found = page.locator(selector)
    return found.first.inner_text() if found.count() else ""


def tid(name: str) -> str:
    return f'[data-testid="{name}"]'


def card(model: str) -> str:
    return f'{tid("model-card")}[data-model="{model}"]'


def number(text: str) -> int:
    """A count as the page writes it ("1,234"); 0 for none ("", "–")."""
    digits = text.replace(",", "").strip()
    return int(digits) if digits.isdigit() else 0


def decimal(text: str) -> float:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return 0.0


def chart_last(page: Page, model: str, chart: str, series: str) -> float:
    """The value at the newest point of a series in one of a model's charts (0 without points)."""
    line = page.locator(f'{card(model)} {tid(chart)} polyline[data-series="{series}"]')
    return float(line.first.get_attribute("data-last") or 0) if line.count() else 0.0


def open_dashboard(page: Page, gateway: GatewayProcess, view: str) -> None:
    page.goto(f"{gateway.url}/dashboard#/{view}")
    wait_until(page, "the live snapshot stream connected", lambda: text_of(page, tid("live-status")) == "live")


@pytest.fixture
def parked(producer: Producer) -> Iterator[WorkerRegistration]:
    """A model registered by a 'worker' that never takes jobs: its requests stay waiting."""
    name = f"parked-{uuid.uuid4().hex[:8]}"
    registration = WorkerRegistration(worker_id=name, model=name, queue=f"streamq:queue:{name}")
    registry = WorkerRegistry(producer.admin)
    producer.call(registry.register(registration, ttl_ms=600_000))
    yield registration
    producer.call(registry.unregister(registration))
    producer.call(producer.admin.delete(registration.queue))


def test_a_prompt_from_the_playground_streams_into_the_page(
    page: Page, gateway: GatewayProcess, producer: Producer, model: str, screenshots: Path
) -> None:
    open_dashboard(page, gateway, "playground")
    wait_until(
        page, f"{model} offered in the model list", lambda: model in page.get_by_test_id("pg-model").inner_text()
    )
    page.get_by_test_id("pg-model").select_option(model)
    page.get_by_test_id("pg-mode-completion").check()
    page.get_by_test_id("pg-prompt").fill("Once upon a time")
    page.get_by_test_id("pg-max-tokens").fill("48")
    page.get_by_test_id("pg-temperature").fill("0")
    page.get_by_test_id("pg-ignore-eos").check()  # the random tiny model may end early otherwise
    page.get_by_test_id("pg-send").click()

    wait_until(page, "the first tokens in the output", lambda: page.get_by_test_id("pg-output").inner_text().strip())
    wait_until(page, "the finish reason", lambda: page.get_by_test_id("pg-finish").inner_text() == "length")
    usage = page.get_by_test_id("pg-usage").inner_text()
    assert "completion 48," in usage, page_text(page)
    assert page.get_by_test_id("pg-ttft").inner_text() != "–", page_text(page)
    assert page.get_by_test_id("pg-error").is_hidden(), page_text(page)
    request_id = page.get_by_test_id("pg-request-link").inner_text()
    assert request_id, page_text(page)
    shown = page.get_by_test_id("pg-output").inner_text()
    page.screenshot(path=screenshots / "playground.png", full_page=True)

    # What the page showed is what the request generated: its view replays the same text.
    status = producer.call(producer.client.status(request_id))
    assert status.state == "finished" and status.completion_tokens == 48, status
    page.get_by_test_id("pg-request-link").click()
    wait_until(page, "the request's final in its view", lambda: text_of(page, tid("final-finish-reasons")) == "length")
    assert page.get_by_test_id("request-text").inner_text() == shown, page_text(page)


def test_a_running_request_clicked_shows_its_tokens_arriving(
    page: Page, gateway: GatewayProcess, producer: Producer, screenshots: Path
) -> None:
    handle = producer.submit("Tell me everything", **LONG)
    try:
        open_dashboard(page, gateway, "requests")
        row = f'{tid("running-row")}[data-key="{handle.request_id}"]'
        wait_until(page, f"{handle.request_id} among the running requests", lambda: page.locator(row).count())
        page.screenshot(path=screenshots / "requests-one.png", full_page=True)
        page.locator(f"{row} td:nth-child(2)").click()  # the row, not its link

        wait_until(page, "the request's view", lambda: text_of(page, tid("request-id")) == handle.request_id)
        text = page.get_by_test_id("request-text")
        seen = wait_until(page, "tokens in the request's view", lambda: len(text.inner_text()))
        wait_until(page, "more tokens arriving while it runs", lambda: len(text.inner_text()) > seen)
        assert text_of(page, tid("request-state")) == "running", page_text(page)
        assert page.get_by_test_id("cancel-button").is_visible(), page_text(page)
        page.screenshot(path=screenshots / "request.png", full_page=True)
    finally:
        producer.end(handle)


def test_cancel_on_the_page_ends_the_request_cancelled(
    page: Page, gateway: GatewayProcess, producer: Producer, screenshots: Path
) -> None:
    handle = producer.submit("Go on and on", **LONG)
    try:
        open_dashboard(page, gateway, f"requests/{handle.request_id}")
        wait_until(page, "tokens streaming", lambda: page.get_by_test_id("request-text").inner_text())
        page.get_by_test_id("cancel-button").click()

        wait_until(page, "the cancelled final", lambda: text_of(page, tid("final-finish-reasons")) == "cancelled")
        wait_until(page, "the status ended", lambda: text_of(page, tid("request-state")) == "finished")
        assert "Cancel sent" in page.get_by_test_id("cancel-result").inner_text(), page_text(page)
        assert page.get_by_test_id("cancel-button").is_hidden(), page_text(page)
        page.screenshot(path=screenshots / "request-cancelled.png", full_page=True)

        status = producer.call(producer.client.status(handle.request_id))
        assert status.state == "finished" and status.finish_reasons == ["cancelled"], status
        completion = producer.call(handle.result())
        assert completion.finish_reasons == ["cancelled"], completion
        shown = number(text_of(page, tid("final-completion-tokens")))
        assert shown == completion.completion_tokens < LONG["max_tokens"], page_text(page)
    finally:
        producer.end(handle)


def test_a_request_view_shows_each_completion_and_an_error(
    page: Page, gateway: GatewayProcess, producer: Producer
) -> None:
    two = producer.submit("Twice", n=2, max_tokens=8, temperature=1.0, seed=3, ignore_eos=True)
    both = producer.call(two.result())
    open_dashboard(page, gateway, f"requests/{two.request_id}")
    wait_until(page, "the final of the request with n=2", lambda: text_of(page, tid("final-finish-reasons")))
    assert text_of(page, tid("final-finish-reasons")) == "length, length", page_text(page)
    boxes = page.get_by_test_id("request-text")
    assert boxes.count() == 2, page_text(page)
    for index, text in enumerate(both.texts):
        box = page.locator(f'{tid("request-text")}[data-index="{index}"]')
        assert box.text_content() == text, (index, text, page_text(page))

    refused = producer.submit("Nope", max_tokens=8, structured_outputs={"regex": "(unclosed"})
    with pytest.raises(RequestError) as failure:
        producer.call(refused.result())
    open_dashboard(page, gateway, f"requests/{refused.request_id}")
    wait_until(page, "the error of the refused request", lambda: text_of(page, tid("final-error-code")))
    assert text_of(page, tid("final-error-code")) == failure.value.code, page_text(page)
    assert text_of(page, tid("request-state")) == "failed", page_text(page)
    assert page.get_by_test_id("cancel-button").is_hidden(), page_text(page)


def test_the_overview_shows_the_worker_busy_and_the_queue_filling(
    page: Page,
    gateway: GatewayProcess,
    producer: Producer,
    worker: WorkerProcess,
    model: str,
    parked: WorkerRegistration,
    screenshots: Path,
) -> None:
    open_dashboard(page, gateway, "overview")
    live_workers = f"{card(model)} {tid('model-live-workers')}"
    wait_until(page, f"a card for {model} with a live worker", lambda: number(text_of(page, live_workers)) >= 1)
    waiting = f"{card(parked.model)} {tid('model-waiting')}"
    before = number(text_of(page, waiting))  # no card yet: nothing waits

    busy = [producer.submit(f"Keep going {i}", **LONG) for i in range(3)]
    queued = [producer.submit(f"Wait {i}", model=parked.model, max_tokens=4) for i in range(5)]
    try:
        wait_until(
            page,
            f"{before + len(queued)} requests waiting for {parked.model} (from {before})",
            lambda: number(text_of(page, waiting)) == before + len(queued),
        )
        running = f"{card(model)} {tid('model-running')}"
        wait_until(
            page, f"{len(busy)} requests running on {model}", lambda: number(text_of(page, running)) >= len(busy)
        )
        rate = f"{card(model)} {tid('model-tokens-per-s')}"
        wait_until(page, "tokens per second above 0", lambda: decimal(text_of(page, rate)) > 0)
        wait_until(
            page,
            "Redis's memory beside the queue",
            lambda: "maxmemory-policy noeviction" in text_of(page, tid("redis-memory")),
        )
        # The charts' newest points show the same: the queue filled, the worker busy.
        wait_until(
            page,
            f"{len(queued)} waiting at the newest point of {parked.model}'s queue chart",
            lambda: chart_last(page, parked.model, "queue-chart", "waiting") >= before + len(queued),
        )
        wait_until(
            page,
            f"{len(busy)} running at the newest point of {model}'s queue chart",
            lambda: chart_last(page, model, "queue-chart", "running") >= len(busy),
        )
        page.screenshot(path=screenshots / "overview.png", full_page=True)

        page.get_by_test_id("nav-requests").click()
        rows = [f'{tid("running-row")}[data-key="{handle.request_id}"] {tid("running-tokens")}' for handle in busy]
        wait_until(
            page,
            "each busy request running with tokens so far",
            lambda: all(number(text_of(page, row)) > 0 for row in rows),
        )
        page.screenshot(path=screenshots / "requests.png", full_page=True)

        page.get_by_test_id("nav-workers").click()
        assert worker.process is not None
        row = f'{tid("worker-row")}:has-text("{model}"):has-text("{worker.process.pid}")'
        wait_until(
            page,
            f"the session worker (pid {worker.process.pid}) live with {len(busy)} requests in flight",
            lambda: (
                text_of(page, f"{row} {tid('worker-state')}") == "live"
                and number(text_of(page, f"{row} {tid('worker-in-flight')}")) >= len(busy)
            ),
        )
        page.screenshot(path=screenshots / "workers.png", full_page=True)
    finally:
        for handle in busy + queued:
            producer.end(handle)


def test_the_overview_fits_a_phone(browser: Browser, gateway: GatewayProcess, model: str, screenshots: Path) -> None:
    context = browser.new_context(viewport=PHONE, is_mobile=True, has_touch=True)
    try:
        page = context.new_page()
        errors: list[str] = []
        page.on("pageerror", lambda error: errors.append(str(error)))
        open_dashboard(page, gateway, "overview")
        wait_until(page, f"the card of {model}", lambda: page.locator(card(model)).count())
        widths = page.evaluate(
            "({page: document.documentElement.scrollWidth, body: document.body.scrollWidth, screen: window.innerWidth})"
        )
        assert widths["page"] <= widths["screen"] and widths["body"] <= widths["screen"], (widths, page_text(page))
        page.screenshot(path=screenshots / "overview-phone.png", full_page=True)
        assert not errors, f"script errors on the page: {errors}"
    finally:
        context.close()


def test_a_gateway_with_keys_asks_for_the_operator_key(page: Page, keyed_gateway: GatewayProcess, model: str) -> None:
    page.goto(f"{keyed_gateway.url}/dashboard#/overview")
    form = page.get_by_test_id("key-panel")
    wait_until(page, "the key form", form.is_visible)
    assert page.get_by_test_id("key-message").inner_text().strip(), page_text(page)  # the gateway's reason

    page.get_by_test_id("key-input").fill("sk-not-this-one")
    page.get_by_test_id("key-save").click()
    wait_until(page, "the key form again for a wrong key", form.is_visible)

    page.get_by_test_id("key-input").fill(OPERATOR_KEY)
    page.get_by_test_id("key-save").click()
    wait_until(page, f"the card of {model} with the key", lambda: page.locator(card(model)).count())
    assert form.is_hidden(), page_text(page)

    # The key stays for this tab's session: a reload needs no form.
    page.reload()
    wait_until(page, "the live snapshot after a reload", lambda: text_of(page, tid("live-status")) == "live")
    assert form.is_hidden(), page_text(page)
