"""Scripted engines: ``AsyncLLM``'s interface as the worker uses it, with no model.

Whatever they write is decided in advance, so the parts around the engine can be
measured or tested alone. Two scripts, one interface (``ScriptedEngine``):

- ``ClockedEngine``, the scripted engine of ``python -m worker --engine-factory
  devkit.scripted_engine:create`` (``SCRIPTED_ENGINE`` in ``devkit.worker_process``): every
  running request gets the same token once per step, at a set rate, and an output as vLLM
  sends them (every token, or every ``stream_interval`` tokens). It measures the queue
  layer alone (``bench``'s scale-out and gateway runs) and serves the tests of Redis
  faults and connections. ``$STREAMQ_SCRIPTED_TOKENS_PER_S`` (default 100) and
  ``$STREAMQ_SCRIPTED_MAX_NUM_SEQS`` (256) set it.
- ``TokenScriptEngine``: writes a given token script after a given prompt, with text and
  stop strings as vLLM's output processor makes them on a real tokenizer, optionally only
  as the test releases each token. For tests that must place every token (a take-over's
  continuation, who owns a request); an in-process worker runs it (``given``).

The model's name and the clocked engine's settings are named in ``devkit.worker_process``,
which starts workers on it without importing vLLM.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections import deque
from collections.abc import AsyncGenerator, Sequence
from types import SimpleNamespace
from typing import Any

from vllm import SamplingParams
from vllm.outputs import CompletionOutput, RequestOutput
from vllm.sampling_params import RequestOutputKind
from vllm.v1.engine.detokenizer import IncrementalDetokenizer

from devkit.worker_process import SCRIPTED_MODEL
from streamq.env_vars import SCRIPTED_MAX_NUM_SEQS_ENV, SCRIPTED_TOKENS_PER_S_ENV

TOKEN_TEXT = " tok"
TOKEN_ID = 42
PROMPT_TOKEN_IDS = [1, 2, 3, 4]
"""``ClockedEngine``'s prompt: every prompt is these tokens, whatever its text."""


class ScriptedEngine:
    """What the worker reads of an engine besides ``generate``: its configuration (as
    ``vllm_config`` spells it), its tokenizer, ``shutdown``."""

    def __init__(self, tokenizer: Any, *, max_num_seqs: int, max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.vllm_config = SimpleNamespace(
            scheduler_config=SimpleNamespace(max_num_seqs=max_num_seqs, policy="fcfs"),
            model_config=SimpleNamespace(model=SCRIPTED_MODEL, max_model_len=max_model_len),
        )

    def get_tokenizer(self) -> Any:
        return self.tokenizer

    def shutdown(self) -> None:
        pass


def _delta(
    request_id: str,
    prompt_ids: list[int],
    n: int,
    text: str,
    token_ids: Sequence[int],
    finish_reason: str | None,
    stop_reason: str | None = None,
) -> RequestOutput:
    """One DELTA ``RequestOutput`` whose ``n`` completions each carry ``text`` and ``token_ids``."""
    completions = [
        CompletionOutput(i, text, list(token_ids), None, None, finish_reason=finish_reason, stop_reason=stop_reason)
        for i in range(n)
    ]
    return RequestOutput(request_id, None, prompt_ids, None, completions, finish_reason is not None)


class _FixedPromptTokenizer:
    """Enough of a tokenizer for chat messages and for taking a request over from
    another worker: every text is ``PROMPT_TOKEN_IDS``, and ``TOKEN_ID`` reads ``TOKEN_TEXT``
    (what vLLM's slow incremental detokenizer asks, which a take-over replays the tokens
    already sent through)."""

    is_fast = True

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(PROMPT_TOKEN_IDS)

    def __len__(self) -> int:
        return TOKEN_ID + 1

    def convert_ids_to_tokens(self, ids: Sequence[int], skip_special_tokens: bool = False) -> list[str]:
        return [TOKEN_TEXT if token_id == TOKEN_ID else "" for token_id in ids]

    def convert_tokens_to_string(self, tokens: Sequence[str]) -> str:
        return "".join(tokens)

    def get_added_vocab(self) -> dict[str, int]:
        return {}

    def apply_chat_template(self, messages: list[dict[str, str]], **_: Any) -> str:
        return "\n".join(m["content"] for m in messages)


class _Running:
    """One request being stepped: its outputs waiting for its generator."""

    def __init__(self, request_id: str, max_tokens: int, n: int, stream_interval: int, *, final_only: bool) -> None:
        self.request_id = request_id
        self.remaining = max_tokens
        self.n = n
        self.stream_interval = stream_interval
        """An output every this many tokens (the first and the last at once), as vLLM sends them."""
        self.final_only = final_only
        """One output, the last (``RequestOutputKind.FINAL_ONLY``)."""
        self.generated = 0
        self.unsent = 0
        self.outputs: deque[RequestOutput] = deque()
        self.ready = asyncio.Event()


class ClockedEngine(ScriptedEngine):
    """Tokens on a clock: like ``AsyncLLM`` it advances up to ``max_num_seqs`` requests one
    token per step, first come first served (the others wait in its queue, and one starts
    in the step a slot frees), and yields DELTA ``RequestOutput``s (or, asked for
    ``FINAL_ONLY``, the last alone); a late step is not made up for, as with a real engine
    whose output handler lags."""

    def __init__(self, tokens_per_s: float, max_num_seqs: int) -> None:
        super().__init__(_FixedPromptTokenizer(), max_num_seqs=max_num_seqs, max_model_len=1 << 20)
        self.period_s = 1.0 / tokens_per_s
        self._running: dict[str, _Running] = {}
        self._has_work = asyncio.Event()
        self._stepper: asyncio.Task[None] | None = None

    async def generate(
        self, request_id: str, prompt: Any, sampling_params: SamplingParams, **_: Any
    ) -> AsyncGenerator[RequestOutput, None]:
        if self._stepper is None:
            self._stepper = asyncio.get_running_loop().create_task(self._step_forever(), name="scripted-steps")
        running = _Running(
            request_id,
            sampling_params.max_tokens or 16,
            sampling_params.n,
            sampling_params.stream_interval or 1,
            final_only=sampling_params.output_kind == RequestOutputKind.FINAL_ONLY,
        )
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
        """One engine step: one token for each of the first ``max_num_seqs`` unfinished
        requests, an output for those whose stream interval is up."""
        scheduled = [running for running in self._running.values() if running.remaining > 0]
        for running in scheduled[: self.vllm_config.scheduler_config.max_num_seqs]:
            running.remaining -= 1
            running.generated += 1
            running.unsent += 1
            finish = "length" if running.remaining == 0 else None
            if finish is None and (
                running.final_only or (running.generated > 1 and running.unsent < running.stream_interval)
            ):
                continue
            tokens, running.unsent = running.unsent, 0
            running.outputs.append(
                _delta(
                    running.request_id, PROMPT_TOKEN_IDS, running.n, TOKEN_TEXT * tokens, [TOKEN_ID] * tokens, finish
                )
            )
            running.ready.set()

    def shutdown(self) -> None:
        if self._stepper is not None:
            self._stepper.cancel()
            self._stepper = None


def create(engine_args: object | None = None) -> ClockedEngine:
    """``--engine-factory devkit.scripted_engine:create``: a ``ClockedEngine`` set by the
    environment; the engine arguments are unused."""
    return ClockedEngine(
        tokens_per_s=float(os.environ.get(SCRIPTED_TOKENS_PER_S_ENV, "100")),
        max_num_seqs=int(os.environ.get(SCRIPTED_MAX_NUM_SEQS_ENV, "256")),
    )


class TokenScriptEngine(ScriptedEngine):
    """Writes ``script`` (token ids) after ``prompt_ids``; a prompt that already holds the
    script's first tokens (a take-over's continuation) gets the rest.

    Its outputs carry text and stop strings as vLLM's output processor makes them (its
    incremental detokenizer, on ``tokenizer``), so a continuation can be checked against it.

    :param gated: outputs wait for ``release`` (one output per token, or several tokens in
        one, as an engine whose output handler lags delivers them); else each token is one
        output at once.
    """

    def __init__(self, tokenizer: Any, prompt_ids: list[int], script: list[int], *, gated: bool = False) -> None:
        super().__init__(tokenizer, max_num_seqs=8, max_model_len=4096)
        self.prompt_ids, self.script = prompt_ids, script
        self.gated = gated
        self.started = asyncio.Event()
        """Set when a request starts generating."""
        self._releases: asyncio.Queue[int] = asyncio.Queue()

    def release(self, tokens: int, *, together: bool = False) -> None:
        """Let ``tokens`` more tokens out: one output each, or all in one output."""
        for size in [tokens] if together else [1] * tokens:
            self._releases.put_nowait(size)

    async def generate(
        self, request_id: str, prompt: Any, sampling_params: SamplingParams, priority: int = 0
    ) -> AsyncGenerator[RequestOutput, None]:
        # A plain prompt is tokenized as vLLM's renderer does (with special tokens).
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else prompt["prompt_token_ids"]
        assert ids[: len(self.prompt_ids)] == self.prompt_ids
        done = len(ids) - len(self.prompt_ids)
        assert ids[len(self.prompt_ids) :] == self.script[:done]
        request = SimpleNamespace(request_id=request_id, prompt_token_ids=ids, prompt_embeds=None)
        request.sampling_params = sampling_params
        detokenizer = IncrementalDetokenizer.from_new_request(
            self.tokenizer if sampling_params.detokenize else None,
            request,  # type: ignore[arg-type]
        )
        rest = self.script[done : done + (sampling_params.max_tokens or len(self.script))]
        self.started.set()
        sent = 0
        while sent < len(rest):
            size = await self._releases.get() if self.gated else 1
            tokens, finish = rest[sent : sent + size], None
            sent += len(tokens)
            stop = detokenizer.update(tokens, False)
            if stop:
                finish = "stop"
            elif sent == len(rest):
                finish = "length"
            text = detokenizer.get_next_output_text(finish is not None, delta=True)
            yield _delta(request_id, ids, 1, text, tokens, finish, stop)
            if finish:
                return


def given(engine: Any) -> Any:
    """``--engine-factory devkit.scripted_engine:given`` with the engine as its arguments:
    an in-process worker runs the engine the test built."""
    return engine
