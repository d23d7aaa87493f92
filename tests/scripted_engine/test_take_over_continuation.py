"""How a take-over continues a request (``Progress.continuation``): for every point an
attempt may have died at, the answer taken over equals the undisturbed one, on an engine
that replays a fixed script; and neither the continuation nor a chat template's
rendering stalls the worker's event loop.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from streamq.protocol import parse_request

NEVER = "@@ no such words in the answer @@"
"""A stop string the answer never holds: vLLM holds back its length - 1 characters."""


no_torch_warnings = pytest.mark.filterwarnings("ignore::DeprecationWarning")  # torch's, on importing vLLM


def _slow_tokenizer(tiny_model: Path) -> Any:
    """The tiny model's tokenizer, taking as long as one rendering and encoding a
    very long prompt would."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)

    class Slow(type(tokenizer)):  # type: ignore[misc]
        def apply_chat_template(self, *args: Any, **kwargs: Any) -> Any:
            time.sleep(0.5)
            return super().apply_chat_template(*args, **kwargs)

        def encode(self, *args: Any, **kwargs: Any) -> Any:
            time.sleep(0.5)
            return super().encode(*args, **kwargs)

    tokenizer.__class__ = Slow
    return SimpleNamespace(get_tokenizer=lambda: tokenizer)


async def _longest_loop_stall(work: Any) -> float:
    """The longest the event loop went without running a 10 ms ticker while ``work`` ran."""
    longest, last = 0.0, time.monotonic()

    async def tick() -> None:
        nonlocal longest, last
        while True:
            await asyncio.sleep(0.01)
            now = time.monotonic()
            longest, last = max(longest, now - last), now

    ticker = asyncio.create_task(tick())
    await asyncio.sleep(0.02)
    try:
        await work
    finally:
        ticker.cancel()
    return longest


@no_torch_warnings
async def test_chat_templating_does_not_stall_the_event_loop(tiny_model: Path) -> None:
    from worker.job import _prompt_token_ids

    request = parse_request({"request_id": "long-chat", "messages": [{"role": "user", "content": "hi " * 1000}]})
    assert await _longest_loop_stall(_prompt_token_ids(_slow_tokenizer(tiny_model), request)) < 0.2


@no_torch_warnings
async def test_taking_over_a_plain_prompt_does_not_stall_the_event_loop(tiny_model: Path) -> None:
    from vllm import SamplingParams

    from worker.progress import Progress

    request = parse_request({"request_id": "long-prompt", "prompt": "hi " * 1000})
    progress = Progress(1)
    progress.add(0, [40, 41], None)
    work = progress.continuation(_slow_tokenizer(tiny_model), request, None, SamplingParams(max_tokens=10))
    assert await _longest_loop_stall(work) < 0.2


async def _collect(outputs: Any) -> list[tuple[str, list[int], str | None]]:
    return [(o.outputs[0].text, list(o.outputs[0].token_ids), o.outputs[0].finish_reason) async for o in outputs]


@no_torch_warnings
@pytest.mark.parametrize(
    "sampling",
    [
        {"stop": [NEVER]},  # text held back, never released by a stop
        {"stop": ["café — 東"]},  # a stop string that every take-over point before it may split
        {"stop": ["東京", "naïve"], "include_stop_str_in_output": True},
        {"stop": ["東京"], "min_tokens": 30},
        {"stop": ["café — 東"], "temperature": 0.5, "seed": 3},  # generated again from the start
        {"stop": ["café — 東"], "presence_penalty": 1.0, "temperature": 0},
    ],
)
async def test_every_take_over_point_gives_the_undisturbed_text(tiny_model: Path, sampling: dict[str, Any]) -> None:
    """For each number of tokens an attempt may have sent before it died, the
    answer taken over equals the undisturbed one (multi-byte characters split across
    tokens included), on an engine that replays a fixed script."""
    from transformers import AutoTokenizer
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import RequestOutputKind

    from devkit.scripted_engine import TokenScriptEngine
    from worker.progress import Progress

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    request = parse_request({"request_id": "scripted", "prompt": "Tell me a story"})
    prompt_ids = list(tokenizer.encode(request.prompt))
    script = tokenizer.encode(
        "Once a naïve café — 東京 at night, a naïve café — 東京 by day.", add_special_tokens=False
    )
    engine = TokenScriptEngine(tokenizer, prompt_ids, script)

    def params() -> SamplingParams:
        return SamplingParams(max_tokens=len(script), output_kind=RequestOutputKind.DELTA, **sampling)

    calm = await _collect(engine.generate("calm", TokensPrompt(prompt_token_ids=prompt_ids), params()))
    expected = ("".join(t for t, _, _ in calm), [i for _, ids, _ in calm for i in ids], calm[-1][2])
    for sent in range(1, len(calm) - 1):
        progress = Progress(1)
        for text, ids, finish in calm[:sent]:
            progress.add(0, ids, finish)
            progress.texts[0].append(text)
        continuation = await progress.continuation(engine, request, None, params())  # type: ignore[arg-type]
        assert continuation is not None
        rest = calm[:sent] + await _collect(continuation.generate(engine, "taken-over"))  # type: ignore[arg-type]
        got = ("".join(t for t, _, _ in rest), [i for _, ids, _ in rest for i in ids], rest[-1][2])
        assert got == expected, f"taken over after {sent} tokens"
