"""Resume arithmetic (``worker/progress.py``): what a job tallies, what a taken-over
job rebuilds from the replay log, and how it goes on (continued or generated again)."""

from __future__ import annotations

import warnings
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from streamq.protocol import ChunkEvent, ErrorEvent, FinalEvent, encode_event, parse_request

with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)  # torch's own, raised while vLLM imports
    from transformers import AutoTokenizer
    from vllm import SamplingParams

    from worker.progress import NotResumable, Progress

ANSWER = "The key to happiness is a quiet mind and good friends."


class _Log:
    """A replay log holding ``entries``, as ``Progress.take_over`` reads it."""

    def __init__(self, *entries: bytes) -> None:
        self.entries = list(entries)
        self.taken_over_by: tuple[str, int] | None = None

    async def take_over(self, request_id: str, attempt: int) -> list[bytes]:
        self.taken_over_by = (request_id, attempt)
        return self.entries


class _Engine:
    """Writes ``script`` one token per output and records what it was asked for."""

    def __init__(self, tokenizer: Any, script: list[int]) -> None:
        self.tokenizer, self.script = tokenizer, script
        self.asked: list[tuple[list[int], SamplingParams]] = []

    def get_tokenizer(self) -> Any:
        return self.tokenizer

    async def generate(self, request_id: str, prompt: Any, sampling_params: SamplingParams) -> Any:
        self.asked.append((list(prompt["prompt_token_ids"]), sampling_params))
        for i, token in enumerate(self.script):
            last = i + 1 == len(self.script)
            completion = SimpleNamespace(
                token_ids=[token], text=self.tokenizer.decode([token]), finish_reason="length" if last else None
            )
            yield SimpleNamespace(outputs=[completion], finished=last)


@pytest.fixture(scope="module")
def tokenizer(tiny_model: Path) -> Any:
    return AutoTokenizer.from_pretrained(tiny_model)


def _sent(tokenizer: Any, text: str) -> Progress:
    """The progress of an attempt that sent ``text``, one token per chunk, then died."""
    progress = Progress(1)
    for token in tokenizer.encode(text, add_special_tokens=False):
        progress.add(0, [token], None)
        progress.texts[0].append(tokenizer.decode([token]))
    return progress


def test_a_tally_counts_every_completions_tokens_and_keeps_their_reasons() -> None:
    progress = Progress(2)
    progress.add(0, [1, 2], None)
    progress.add(1, [3], "stop")
    progress.add(0, [4], None)
    progress.set_prompt_tokens(7)
    progress.set_prompt_tokens(3)  # a continuation's longer prompt: the original's length stays
    progress.end_unfinished("cancelled")
    assert progress.token_ids == [[1, 2, 4], [3]]
    assert progress.summary("r1") == {
        "request_id": "r1",
        "finish_reasons": ["cancelled", "stop"],
        "prompt_tokens": 7,
        "completion_tokens": 4,
    }


async def test_a_take_over_rebuilds_what_earlier_attempts_published() -> None:
    log = _Log(
        encode_event(ChunkEvent(request_id="r1", seq=0, index=0, text="He", token_ids=[5, 6])),
        b"not an event",
        encode_event(ChunkEvent(request_id="r1", seq=1, index=1, text="Hi", token_ids=[7], finish_reason="stop")),
        encode_event(ChunkEvent(request_id="r1", seq=2, index=0, text="llo", token_ids=[8])),
    )
    progress = await Progress.take_over(log, "r1", 3, 2)  # type: ignore[arg-type]
    assert log.taken_over_by == ("r1", 3)
    assert (progress.token_ids, progress.texts) == ([[5, 6, 8], [7]], [["He", "llo"], ["Hi"]])
    assert progress.finish_reasons == [None, "stop"]
    assert (progress.next_seq, progress.ended) == (3, False)


@pytest.mark.parametrize(
    "last",
    [
        FinalEvent(request_id="r1", seq=1, finish_reasons=["length"], prompt_tokens=9, completion_tokens=1),
        ErrorEvent(request_id="r1", seq=1, code="internal", message="boom"),
    ],
)
async def test_a_take_over_of_an_ended_request_knows_it_ended(last: FinalEvent | ErrorEvent) -> None:
    log = _Log(encode_event(ChunkEvent(request_id="r1", seq=0, text="a", token_ids=[1])), encode_event(last))
    progress = await Progress.take_over(log, "r1", 2, 1)  # type: ignore[arg-type]
    assert (progress.ended, progress.next_seq) == (True, 2)
    if isinstance(last, FinalEvent):
        assert (progress.finish_reasons, progress.prompt_tokens) == (["length"], 9)


@pytest.mark.parametrize(("finish_reason", "max_tokens"), [("stop", None), (None, 3)], ids=["finished", "budget-spent"])
async def test_nothing_is_left_to_generate_after_a_finished_or_spent_completion(
    finish_reason: str | None, max_tokens: int | None
) -> None:
    progress = Progress(1)
    progress.add(0, [1, 2, 3], finish_reason)
    request = parse_request({"request_id": "r1", "prompt": "hi"})
    assert await progress.continuation(None, request, None, SamplingParams(max_tokens=max_tokens)) is None  # type: ignore[arg-type]


async def test_several_completions_cannot_resume() -> None:
    progress = Progress(2)
    progress.add(0, [1], None)
    request = parse_request({"request_id": "r1", "prompt": "hi", "sampling": {"n": 2}})
    with pytest.raises(NotResumable):
        await progress.continuation(None, request, None, SamplingParams(n=2))  # type: ignore[arg-type]


async def test_a_continuation_asks_only_for_the_rest_after_the_tokens_sent(tokenizer: Any) -> None:
    progress = _sent(tokenizer, "The key to")
    sent = list(progress.token_ids[0])
    rest = tokenizer.encode(" happiness", add_special_tokens=False)
    engine = _Engine(tokenizer, rest)
    request = parse_request({"request_id": "r1", "prompt": "Tell me"})
    params = SamplingParams(max_tokens=20, min_tokens=2, stop=["!"], temperature=0)
    continuation = await progress.continuation(engine, request, None, params)  # type: ignore[arg-type]
    assert continuation is not None and not continuation.regenerate and continuation.exact
    outputs = [output async for output in continuation.generate(engine, "r1")]  # type: ignore[arg-type]

    prompt_ids = tokenizer.encode("Tell me")
    ((asked_prompt, asked_params),) = engine.asked
    assert asked_prompt == prompt_ids + sent
    assert asked_params.max_tokens == 20 - len(sent)
    assert asked_params.min_tokens == max(0, 2 - len(sent))
    assert (params.max_tokens, params.stop) == (20, ["!"])  # the request's own params are untouched
    assert progress.prompt_tokens == len(prompt_ids)
    assert [t for o in outputs for t in o.outputs[0].token_ids] == rest
    assert "".join(o.outputs[0].text for o in outputs) == " happiness"


@pytest.mark.parametrize(
    ("sampling", "regenerate", "exact"),
    [
        ({"temperature": 0}, False, True),
        ({"temperature": 0, "presence_penalty": 1.0}, True, True),
        ({"temperature": 0.7, "seed": 3}, True, True),
        ({"temperature": 0.7}, False, True),
        ({"temperature": 0.7, "frequency_penalty": 1.0}, False, False),
    ],
    ids=["greedy", "greedy-penalised", "seeded", "random", "random-penalised"],
)
async def test_state_the_engine_cannot_carry_over_decides_how_a_request_goes_on(
    tokenizer: Any, sampling: dict[str, Any], regenerate: bool, exact: bool
) -> None:
    """Penalties count only generated tokens and a seed drives the sampler from the
    start: what would come out again is generated again; what would not is approximate."""
    progress = _sent(tokenizer, "The key")
    request = parse_request({"request_id": "r1", "prompt": "Tell me"})
    engine = _Engine(tokenizer, [])
    continuation = await progress.continuation(engine, request, None, SamplingParams(max_tokens=20, **sampling))  # type: ignore[arg-type]
    assert continuation is not None
    assert (continuation.regenerate, continuation.exact) == (regenerate, exact)


async def test_a_regeneration_sends_only_what_follows_the_part_already_sent(tokenizer: Any) -> None:
    progress = _sent(tokenizer, "The key to")
    engine = _Engine(tokenizer, tokenizer.encode(ANSWER, add_special_tokens=False))
    request = parse_request({"request_id": "r1", "prompt": "Tell me"})
    params = SamplingParams(max_tokens=50, temperature=0.7, seed=3)
    continuation = await progress.continuation(engine, request, None, params)  # type: ignore[arg-type]
    assert continuation is not None and continuation.regenerate
    outputs = [output async for output in continuation.generate(engine, "r1")]  # type: ignore[arg-type]
    assert "".join(o.outputs[0].text for o in outputs) == ANSWER.removeprefix("The key to")
    assert outputs[-1].finished and continuation.exact
    assert engine.asked[0][0] == tokenizer.encode("Tell me")  # from the start: the original prompt only


async def test_a_regeneration_that_differs_continues_from_the_tokens_sent_instead(tokenizer: Any) -> None:
    progress = _sent(tokenizer, "The key to")
    sent = list(progress.token_ids[0])
    engine = _Engine(tokenizer, tokenizer.encode("A queue decouples", add_special_tokens=False))
    request = parse_request({"request_id": "r1", "prompt": "Tell me"})
    params = SamplingParams(max_tokens=50, temperature=0.7, seed=3)
    continuation = await progress.continuation(engine, request, None, params)  # type: ignore[arg-type]
    assert continuation is not None
    outputs = [output async for output in continuation.generate(engine, "r1")]  # type: ignore[arg-type]
    assert not continuation.exact  # the rest may differ from an undisturbed run
    (_, _), (extended_prompt, _) = engine.asked
    assert extended_prompt == tokenizer.encode("Tell me") + sent
    assert outputs[-1].finished
