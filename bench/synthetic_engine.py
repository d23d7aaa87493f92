"""A scripted engine for the scale-out run: tokens at a set rate, no model compute.

``python -m worker --engine-factory bench.synthetic_engine:create`` measures the queue layer
alone. Like ``AsyncLLM`` it yields DELTA ``RequestOutput``s and advances every running request
one token per step; a late step is not made up for, as with a real engine whose output handler
lags. ``STREAMQ_SYNTH_TOKENS_PER_S`` (default 100) and ``STREAMQ_SYNTH_MAX_NUM_SEQS`` (256) set it.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections import deque
from collections.abc import AsyncGenerator
from types import SimpleNamespace
from typing import Any

from vllm import SamplingParams
from vllm.outputs import CompletionOutput, RequestOutput

from bench.config import SYNTH_MAX_NUM_SEQS_ENV, SYNTH_TOKENS_PER_S_ENV

TOKEN_TEXT = " tok"
TOKEN_ID = 42
PROMPT_TOKEN_IDS = [1, 2, 3, 4]


class _Running:
    """One request being stepped: its outputs waiting for its generator."""

    def __init__(self, request_id: str, max_tokens: int, n: int) -> None:
        self.request_id = request_id
        self.remaining = max_tokens
        self.n = n
        self.outputs: deque[RequestOutput] = deque()
        self.ready = asyncio.Event()


class _ScriptedTokenizer:
    """Enough of a tokenizer for chat messages and for resuming a request elsewhere:
    every text is the same few prompt tokens."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(PROMPT_TOKEN_IDS)

    def apply_chat_template(self, messages: list[dict[str, str]], **_: Any) -> str:
        return "\n".join(m["content"] for m in messages)


class SyntheticEngine:
    """``AsyncLLM``'s interface as the worker uses it, producing tokens on a clock."""

    def __init__(self, tokens_per_s: float, max_num_seqs: int) -> None:
        self.period_s = 1.0 / tokens_per_s
        self.vllm_config = SimpleNamespace(
            scheduler_config=SimpleNamespace(max_num_seqs=max_num_seqs, policy="fcfs"),
            model_config=SimpleNamespace(model="synthetic", max_model_len=1 << 20),
        )
        self._running: dict[str, _Running] = {}
        self._has_work = asyncio.Event()
        self._stepper: asyncio.Task[None] | None = None

    async def generate(
        self, request_id: str, prompt: Any, sampling_params: SamplingParams, **_: Any
    ) -> AsyncGenerator[RequestOutput, None]:
        if self._stepper is None:
            self._stepper = asyncio.get_running_loop().create_task(self._step_forever(), name="synthetic-steps")
        running = _Running(request_id, sampling_params.max_tokens or 16, sampling_params.n)
        self._running[request_id] = running
        self._has_work.set()
        try:
            while True:
                await running.ready.wait()
                running.ready.clear()
                while running.outputs:
                    output = running.outputs.popleft()
                    yield output
                    if output.finished:
                        return
        finally:
            self._running.pop(request_id, None)

    async def _step_forever(self) -> None:
        next_step = time.monotonic()
        while True:
            if not self._running:
                self._has_work.clear()
                await self._has_work.wait()
                next_step = time.monotonic()
            self._step()
            next_step = max(next_step + self.period_s, time.monotonic())
            await asyncio.sleep(next_step - time.monotonic())

    def _step(self) -> None:
        """One engine step: one token for every running request."""
        for running in list(self._running.values()):
            if running.remaining <= 0:
                continue
            running.remaining -= 1
            finished = running.remaining == 0
            completions = [
                CompletionOutput(
                    index=i,
                    text=TOKEN_TEXT,
                    token_ids=[TOKEN_ID],
                    cumulative_logprob=None,
                    logprobs=None,
                    finish_reason="length" if finished else None,
                )
                for i in range(running.n)
            ]
            running.outputs.append(
                RequestOutput(running.request_id, None, PROMPT_TOKEN_IDS, None, completions, finished)
            )
            running.ready.set()

    def get_tokenizer(self) -> _ScriptedTokenizer:
        return _ScriptedTokenizer()

    def shutdown(self) -> None:
        if self._stepper is not None:
            self._stepper.cancel()
            self._stepper = None


def create(engine_args: object | None = None) -> SyntheticEngine:
    """``--engine-factory bench.synthetic_engine:create``; the engine arguments are unused."""
    return SyntheticEngine(
        tokens_per_s=float(os.environ.get(SYNTH_TOKENS_PER_S_ENV, "100")),
        max_num_seqs=int(os.environ.get(SYNTH_MAX_NUM_SEQS_ENV, "256")),
    )
