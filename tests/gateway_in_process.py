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

from devkit.redis_server import RedisServer, free_port
from gateway.app import create_app
from streamq.protocol.names import RECENT_ENDS_KEY, WORKER_STATS_KEY, WORKER_STATS_SEEN_KEY
from streamq.protocol.roles import GATEWAY

GATEWAY_READS_DASHBOARD = "lrange" in GATEWAY.commands and {
    WORKER_STATS_KEY,
    WORKER_STATS_SEEN_KEY,
    RECENT_ENDS_KEY,
} <= set(GATEWAY.read_only_keys)
"""Whether the gateway's Redis role grants what its dashboard reads (the workers' reports
and the recent ends)."""


def dashboard_redis_url(server: RedisServer) -> str:
    """The gateway role's URL where it may read the dashboard's keys, else the harness's
    own (granted everything)."""
    return server.url_for(GATEWAY) if GATEWAY_READS_DASHBOARD else server.url


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
