"""Latency and throughput, computed the way ``vllm bench serve`` computes them.

A request is clocked from just before it is sent: TTFT is the first chunk's arrival, each later
chunk one inter-token latency (k tokens in a chunk: one entry), output tok/s all output tokens
over the batch's wall time; percentiles are numpy's linear ones, as vLLM's. Paths (a) and (b) use it.
Given the benchmark's processes by role, each level also records their CPU time over the batch
(not the warm-up) per delivered token.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TypeVar

import numpy as np

from bench.cpu import CpuWindow, WindowCpu

P = TypeVar("P")

StreamFn = Callable[[P], AsyncIterator[int]]
"""Sends one request and yields the number of tokens in each chunk as it arrives."""


@dataclass
class RequestTiming:
    ttft_s: float
    itl_s: list[float] = field(default_factory=list)
    output_tokens: int = 0


@dataclass(frozen=True)
class PathResult:
    """One path at one concurrency: the row of the results table."""

    path: str
    concurrency: int
    num_prompts: int
    duration_s: float
    output_tokens: int
    output_tok_s: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    itl_p50_ms: float
    itl_p99_ms: float
    cpu_us_per_token: dict[str, float] = field(default_factory=dict)  # by role, over the measured batch
    cpu_percent: dict[str, float] = field(default_factory=dict)  # by role, 100 = one core
    chunks_per_token: float | None = None
    """Chunks the client received per output token: 1.0 when every token came alone, less
    when the engine's output queue or the worker's publisher merged several into one."""

    def with_cpu(self, cpu: WindowCpu) -> PathResult:
        """This row with what each process spent on its batch."""
        return replace(self, cpu_us_per_token=cpu.us_per_token(self.output_tokens), cpu_percent=cpu.percent())

    def cpu_line(self) -> str:
        return ", ".join(f"{role} {us:.0f}" for role, us in self.cpu_us_per_token.items())


async def time_request(stream: StreamFn[P], prompt: P) -> RequestTiming:
    """Clock one streamed request like vLLM's client does."""
    sent = last = time.perf_counter()
    timing: RequestTiming | None = None
    async for tokens in stream(prompt):
        now = time.perf_counter()
        if timing is None:
            timing = RequestTiming(ttft_s=now - sent)
        else:
            timing.itl_s.append(now - last)
        timing.output_tokens += tokens
        last = now
    if timing is None:
        raise RuntimeError("a request produced no chunk")
    return timing


async def run_batch(stream: StreamFn[P], prompts: Sequence[P], concurrency: int) -> tuple[float, list[RequestTiming]]:
    """Send every prompt, at most ``concurrency`` in flight; the wall time and timings.

    All tasks start at once behind a semaphore, as ``vllm bench serve`` does with
    ``--request-rate inf --max-concurrency N``.
    """
    limit = asyncio.Semaphore(concurrency)

    async def limited(prompt: P) -> RequestTiming:
        async with limit:
            return await time_request(stream, prompt)

    started = time.perf_counter()
    timings = await asyncio.gather(*(limited(p) for p in prompts))
    return time.perf_counter() - started, list(timings)


def summarize(path: str, concurrency: int, duration_s: float, timings: Sequence[RequestTiming]) -> PathResult:
    ttfts = [t.ttft_s for t in timings]
    itls = [gap for t in timings for gap in t.itl_s]
    output_tokens = sum(t.output_tokens for t in timings)
    chunks = sum(1 + len(t.itl_s) for t in timings if t.output_tokens)
    return PathResult(
        path=path,
        concurrency=concurrency,
        num_prompts=len(timings),
        duration_s=duration_s,
        output_tokens=output_tokens,
        output_tok_s=output_tokens / duration_s,
        ttft_p50_ms=_ms(ttfts, 50),
        ttft_p99_ms=_ms(ttfts, 99),
        itl_p50_ms=_ms(itls, 50),
        itl_p99_ms=_ms(itls, 99),
        chunks_per_token=chunks / output_tokens if output_tokens else None,
    )


def _ms(values: Sequence[float], percentile: float) -> float:
    return float(np.percentile(values or [0.0], percentile)) * 1000


async def measure_levels(
    path: str,
    stream: StreamFn[P],
    prompts_for: Callable[[int], Sequence[P]],
    concurrencies: Sequence[int],
    roles: Mapping[str, list[int]] | None = None,
) -> list[PathResult]:
    """Run each concurrency level after one warm-up request, as ``vllm bench serve``
    runs its initial test request before every invocation; with ``roles`` (processes by
    role), the CPU each role spent on the level's batch."""
    results = []
    for concurrency in concurrencies:
        prompts = prompts_for(concurrency)
        await time_request(stream, prompts[0])
        window = CpuWindow(roles or {})
        window.start()
        duration, timings = await run_batch(stream, prompts, concurrency)
        cpu = window.stop()
        result = summarize(path, concurrency, duration, timings)
        if roles:
            result = result.with_cpu(cpu)
        print(
            f"[{path}] c={concurrency}: {result.output_tok_s:,.0f} tok/s, TTFT p50 {result.ttft_p50_ms:.1f} ms, "
            f"ITL p50 {result.itl_p50_ms:.2f} ms ({len(prompts)} requests, {duration:.1f}s); "
            f"CPU us/token: {result.cpu_line()}",
            flush=True,
        )
        results.append(result)
    return results
