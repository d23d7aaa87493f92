"""A gateway app served by uvicorn inside the test's event loop, on a free port: real
HTTP (streams, disconnects) with the app's state at hand, and no process to start."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import uvicorn
from fastapi import FastAPI

from devkit.redis_server import free_port
from gateway.app import create_app


@asynccontextmanager
async def serving(app: FastAPI) -> AsyncIterator[str]:
    """Serve ``app`` until the block ends; yields its base URL."""
    port = free_port()
    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", timeout_graceful_shutdown=2)
    server = uvicorn.Server(config)
    task = asyncio.ensure_future(server.serve())
    try:
        async with asyncio.timeout(30):
            while not server.started:
                if task.done():
                    task.result()
                    raise RuntimeError("the gateway stopped before it started")
                await asyncio.sleep(0.02)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        await task


@asynccontextmanager
async def gateway_client(redis_url: str, **options: Any) -> AsyncIterator[tuple[FastAPI, httpx.AsyncClient]]:
    """``create_app(redis_url, **options)`` served in-process, and an HTTP client on it."""
    app = create_app(redis_url, **options)
    async with serving(app) as url, httpx.AsyncClient(base_url=url, timeout=30) as http:
        yield app, http
