"""``worker.pooling.encode_all`` against a stand-in engine: every input in the engine at once,
results packed in input order, an input the engine refuses named by its index with the
others aborted, and results past ``MAX_POOLED_BYTES`` refused rather than published."""

from __future__ import annotations

import asyncio
import warnings
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any, ClassVar

import numpy
import pytest

from streamq.protocol import GenerateRequest, InvalidRequest, parse_request

with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)  # torch's own, raised while vLLM imports
    from vllm.exceptions import VLLMValidationError

    import worker.pooling
    from worker.pooling import encode_all


class CharacterTokenizer:
    """A token per character, called as a Hugging Face tokenizer is: a batch at once. The
    worker tokenizes with a copy of the engine's tokenizer: the calls are the class's."""

    batches: ClassVar[list[list[str]]] = []

    def __call__(self, texts: list[str], **_: Any) -> dict[str, list[list[int]]]:
        self.batches.append(texts)
        return {"input_ids": [[ord(c) for c in text] for text in texts]}


class StandInEngine:
    """Answers each input with a vector of its length, after every input has arrived (so a
    request whose inputs were sent one after another would never finish)."""

    def __init__(self, inputs: int, *, refuse: int | None = None) -> None:
        self.model_config = SimpleNamespace(max_model_len=64)
        self.tokenizer = CharacterTokenizer()
        self.all_arrived = asyncio.Event()
        self.arrived: list[str] = []
        self.aborted: list[str] = []
        self.inputs = inputs
        self.refuse = refuse

    def get_tokenizer(self) -> CharacterTokenizer:
        return self.tokenizer

    async def encode(self, prompt: Any, params: Any, request_id: str, **_: Any) -> AsyncIterator[Any]:
        self.arrived.append(request_id)
        if len(self.arrived) == self.inputs:
            self.all_arrived.set()
        index = int(request_id.rsplit("#", 1)[1])
        try:
            if index == self.refuse:
                raise VLLMValidationError("too long")
            await self.all_arrived.wait()
            await asyncio.sleep(0.01 * (self.inputs - index))  # the last input finishes first
        except asyncio.CancelledError:
            self.aborted.append(request_id)
            raise
        tokens = prompt.get("prompt_token_ids") if isinstance(prompt, dict) else None
        size = len(tokens) if tokens else len(str(prompt))
        yield SimpleNamespace(
            outputs=SimpleNamespace(data=numpy.full(size, index, dtype="f4")), prompt_token_ids=[0] * size
        )


def request(inputs: list[str | list[int]]) -> GenerateRequest:
    return parse_request({"request_id": "r1", "inputs": inputs, "pooling": {"task": "embed"}})


async def test_every_input_runs_at_once_its_texts_tokenized_together_and_results_come_back_in_order() -> None:
    engine = StandInEngine(3)
    async with asyncio.timeout(30):  # inputs sent one after another would wait here for ever
        results = await encode_all(engine, request(["ab", [1, 2, 3], "abcd"]), 0, lambda: None)  # type: ignore[arg-type]
    assert engine.arrived == ["r1#0", "r1#1", "r1#2"]
    assert CharacterTokenizer.batches[-1] == ["ab", "abcd"], "the texts are tokenized in one call"
    assert results.shapes == [[2], [3], [4]] and results.prompt_tokens == [2, 3, 4]
    values = numpy.frombuffer(results.data, dtype="<f4")
    assert values.tolist() == [0, 0, 1, 1, 1, 2, 2, 2, 2]


async def test_an_input_the_engine_refuses_is_named_and_the_others_are_aborted() -> None:
    engine = StandInEngine(3, refuse=1)
    with pytest.raises(InvalidRequest, match=r"^inputs\[1\]: too long"):
        await encode_all(engine, request(["a", "b", "c"]), 0, lambda: None)  # type: ignore[arg-type]
    await asyncio.sleep(0)  # the cancelled inputs see their cancellation
    assert sorted(engine.aborted) == ["r1#0", "r1#2"]


async def test_results_past_the_bound_are_refused_not_published(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(worker.pooling, "MAX_POOLED_BYTES", 16)
    with pytest.raises(InvalidRequest, match="past the 16-byte bound"):
        await encode_all(StandInEngine(2), request(["abc", "def"]), 0, lambda: None)  # type: ignore[arg-type]
