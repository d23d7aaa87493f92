"""Headless Chromium for the dashboard's browser tests and pictures: Debian's ``chromium``
driven by Playwright (Playwright's own browser download is not reachable everywhere)."""

from __future__ import annotations

from playwright.sync_api import Browser, Playwright

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",  # containers, and root in CI
    "--disable-gpu",
    # Nothing that reaches out to the network: a closed network refuses it, many at a time.
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


def launch_chromium(playwright: Playwright) -> Browser:
    """Debian's Chromium, headless, with nothing of its own on the network."""
    return playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
