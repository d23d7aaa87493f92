"""Streams through one ``python -m gateway`` in a closed loop, and what the gateway spent on them.

Shared by the gateway benchmarks (``bench.gateway_cpu``, ``bench.gateway_keys``): each
client task streams one request after another until the window ends; a chunk is a
``data:`` line of a completion chunk (not an error body, not ``[DONE]``).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import httpx

from bench.cpu import cpu_seconds
from devkit.gateway_process import GatewayProcess


@dataclass
class Round:
    """One arm's streams over one window."""

    arm: str
    tokens: int
    seconds: float
    gateway_cpu_s: float
    errors: int
    """Requests the gateway answered with another status than 200."""

    @property
    def tok_s(self) -> float:
        return self.tokens / self.seconds

    @property
    def us_per_token(self) -> float:
        """The gateway's CPU microseconds per streamed token (= ms per 1,000 tokens)."""
        return 1e6 * self.gateway_cpu_s / max(self.tokens, 1)


@dataclass
class _Tally:
    chunks: int = 0
    errors: int = 0


async def _stream_loop(
    http: httpx.AsyncClient, path: str, body: dict[str, object], headers: dict[str, str], until: float, tally: _Tally
) -> None:
    while time.monotonic() < until:
        async with http.stream("POST", path, json=body, headers=headers) as response:
            if response.status_code != 200:
                tally.errors += 1
                await response.aread()
                continue
            async for line in response.aiter_lines():
                if line.startswith('data: {"id"'):
                    tally.chunks += 1
                if time.monotonic() >= until:
                    break


async def measure(
    arm: str,
    gateway: GatewayProcess,
    path: str,
    body: dict[str, object],
    *,
    concurrency: int,
    seconds: float,
    headers: dict[str, str] | None = None,
) -> Round:
    """``concurrency`` closed-loop streams of ``body`` to ``path`` for ``seconds``, after
    one second of warm-up, and the gateway process's CPU time over that window."""
    assert gateway.process is not None
    pid = gateway.process.pid
    tally = _Tally()
    headers = headers or {}
    limits = httpx.Limits(max_connections=concurrency)
    async with httpx.AsyncClient(base_url=gateway.url, timeout=60, limits=limits) as http:
        await _stream_loop(http, path, body, headers, time.monotonic() + 1, _Tally())  # warm-up
        before = cpu_seconds(pid)
        started = time.monotonic()
        until = started + seconds
        await asyncio.gather(*(_stream_loop(http, path, body, headers, until, tally) for _ in range(concurrency)))
        elapsed = time.monotonic() - started
        cpu = cpu_seconds(pid) - before
    return Round(arm, tally.chunks, elapsed, cpu, tally.errors)
