"""Take-over arithmetic (``worker/progress.py``, ``worker/regeneration.py``): what a job
tallies, what a taken-over job rebuilds from the replay log, and how it goes on
(continued from its tokens, or generated again from the start with the same seed and
checked, per completion, against what was sent)."""

from __future__ import annotations

import warnings
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import msgspec
import pytest

from streamq.broker.replay_log import TakeOver
from streamq.protocol import ChunkEvent, ErrorEvent, FinalEvent, encode_event, parse_request

with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)  # torch's own, raised while vLLM imports
    from transformers import AutoTokenizer
    from vllm import SamplingParams
    from vllm.outputs import CompletionOutput, RequestOutput
    from vllm.sampling_params import SamplingType, StructuredOutputsParams

    from worker.progress import Continuation, Progress
    from worker.regeneration import SEED_BITS, Regeneration, RegenerationDiffers, assigned_seed, with_take_over_seed

ANSWER = "The key to happiness is a quiet mind and good friends."


class _Log:
    """A replay log holding ``entries``, as ``Progress.take_over`` reads it."""

    def __init__(self, *entries: bytes, owns: bool = True) -> None:
        self.entries = list(entries)
        self.owns = owns
        self.taken_over_by: tuple[str, int] | None = None

    async def take_over(self, request_id: str, attempt: int) -> TakeOver:
        self.taken_over_by = (request_id, attempt)
        return TakeOver(self.owns, self.entries)


class _Engine:
    """Writes ``script`` one token per output and records what it was asked for."""

    def __init__(self, tokenizer: Any, script: list[int]) -> None:
        self.tokenizer, self.script = tokenizer, script
        self.asked: list[tuple[list[int], SamplingParams]] = []

    def get_tokenizer(self) -> Any:
        return self.tokenizer

    async def generate(self, request_id: str, prompt: Any, sampling_params: SamplingParams, priority: int = 0) -> Any:
        self.asked.append((prompt if isinstance(prompt, str) else list(prompt["prompt_token_ids"]), sampling_params))
        for i, token in enumerate(self.script):
            last = i + 1 == len(self.script)
            completion = SimpleNamespace(
                index=0,
                token_ids=[token],
                text=self.tokenizer.decode([token]),
                logprobs=None,
                finish_reason="length" if last else None,
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
    assert msgspec.to_builtins(progress.summary("r1")) == {  # the result arq stores
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
    assert (progress.next_seq, progress.ended, progress.superseded) == (3, False, False)


async def test_a_take_over_that_finds_a_newer_owner_is_superseded() -> None:
    """Two workers claimed the job one after the other: the older attempt's take-over,
    coming second, must not generate."""
    log = _Log(encode_event(ChunkEvent(request_id="r1", seq=0, text="a", token_ids=[1])), owns=False)
    progress = await Progress.take_over(log, "r1", 2, 1)  # type: ignore[arg-type]
    assert (progress.superseded, progress.ended) == (True, False)


@pytest.mark.parametrize(
    "last",
    [
        FinalEvent(request_id="r1", seq=1, finish_reasons=["length"], prompt_tokens=9, completion_tokens=1),
        ErrorEvent(request_id="r1", seq=1, code="internal", message="boom"),
    ],
)
async def test_a_take_over_of_an_ended_request_knows_it_ended(last: FinalEvent | ErrorEvent) -> None:
    chunk = encode_event(ChunkEvent(request_id="r1", seq=0, text="a", token_ids=[1]))
    log = _Log(chunk, encode_event(last), owns=False)
    progress = await Progress.take_over(log, "r1", 2, 1)  # type: ignore[arg-type]
    assert (progress.ended, progress.next_seq, progress.superseded) == (True, 2, False)
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


async def test_a_continuation_asks_only_for_the_rest_after_the_tokens_sent(tokenizer: Any) -> None:
    progress = _sent(tokenizer, "The key to")
    sent = list(progress.token_ids[0])
    rest = tokenizer.encode(" happiness", add_special_tokens=False)
    engine = _Engine(tokenizer, rest)
    request = parse_request({"request_id": "r1", "prompt": "Tell me"})
    params = SamplingParams(max_tokens=20, min_tokens=2, stop=["!"], temperature=0)
    continuation = await progress.continuation(engine, request, None, params)  # type: ignore[arg-type]
    assert isinstance(continuation, Continuation)
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
    ("sampling", "regenerates"),
    [
        ({"temperature": 0}, False),
        ({"temperature": 0.7}, False),
        ({"temperature": 0, "seed": 3}, False),  # greedy: the seed draws nothing
        ({"temperature": 0, "repetition_penalty": 1.2}, False),  # counts the prompt too
        ({"temperature": 0, "presence_penalty": 1.0}, True),
        ({"temperature": 0.7, "frequency_penalty": 1.0}, True),
        ({"temperature": 0.7, "seed": 3}, True),
        ({"temperature": 0.7, "n": 2}, True),
        ({"temperature": 0, "structured_outputs": StructuredOutputsParams(choice=["yes", "no"])}, True),
    ],
    ids=[
        "greedy",
        "random",
        "greedy-seeded",
        "repetition-penalty",
        "greedy-penalised",
        "random-penalised",
        "seeded",
        "n2",
        "structured",
    ],
)
async def test_state_the_engine_cannot_carry_over_decides_how_a_request_goes_on(
    tokenizer: Any, sampling: dict[str, Any], regenerates: bool
) -> None:
    """Several completions, a grammar, penalties that count generated tokens and a
    seeded sampler all carry state a continued prompt would lose: such a request is
    generated again from the start; any other continues from the tokens sent."""
    n = sampling.get("n", 1)
    progress = Progress(n)
    for index in range(n):
        progress.add(index, tokenizer.encode("The key", add_special_tokens=False), None)
        progress.texts[index].append("The key")
    request = parse_request({"request_id": "r1", "prompt": "Tell me"})
    engine = _Engine(tokenizer, [])
    params = with_take_over_seed(SamplingParams(max_tokens=20, **sampling), "r1")
    continuation = await progress.continuation(engine, request, None, params)  # type: ignore[arg-type]
    assert isinstance(continuation, Regeneration if regenerates else Continuation)


@pytest.mark.parametrize(
    ("sampling", "seeded"),
    [
        ({"temperature": 0.7}, False),  # continues from its tokens: vLLM's unseeded sampling
        ({"temperature": 0}, False),
        ({"temperature": 0, "presence_penalty": 1.0}, False),  # greedy: regenerates without a seed
        ({"temperature": 0.7, "presence_penalty": 1.0}, True),
        ({"temperature": 0.7, "n": 2}, True),
        ({"temperature": 1.0, "structured_outputs": StructuredOutputsParams(json={"type": "object"})}, True),
    ],
    ids=["random", "greedy", "greedy-penalised", "random-penalised", "n2", "structured"],
)
def test_a_seed_is_assigned_only_to_what_a_take_over_would_sample_again(sampling: dict[str, Any], seeded: bool) -> None:
    params = SamplingParams(max_tokens=20, **sampling)
    assigned = with_take_over_seed(params, "req-1")
    if not seeded:
        assert assigned is params and assigned.seed is None
        return
    assert assigned.seed == assigned_seed("req-1") == with_take_over_seed(params.clone(), "req-1").seed
    assert assigned.sampling_type == SamplingType.RANDOM_SEED
    assert (assigned.n, assigned.temperature, assigned.max_tokens) == (params.n, params.temperature, 20)
    assert params.seed is None  # the request's own params are untouched


def test_an_assigned_seed_is_the_request_ids_and_leaves_room_for_every_completion() -> None:
    """Every worker derives the same seed from the request id (nothing is stored), other
    ids get other seeds, and completion ``i``'s seed (``seed + i``) fits in 64 signed bits."""
    seeds = {assigned_seed(f"req-{i}") for i in range(1000)}
    assert len(seeds) == 1000
    assert all(0 <= seed < 2**SEED_BITS for seed in seeds)
    assert 2**SEED_BITS + 10_000 < 2**63
    given = with_take_over_seed(SamplingParams(temperature=0.7, n=2, seed=5), "req-1")
    assert given.seed == 5  # a seed the request gives is its own


class _ParallelEngine:
    """An engine whose completions are ``scripts`` (token ids; token ``t``'s text is
    ``<t>``), generated in lockstep one token per step as vLLM streams ``n > 1`` DELTAs:
    one output per step holding each unfinished completion's token and logprob."""

    def __init__(self, *scripts: list[int]) -> None:
        self.scripts = scripts
        self.asked: list[tuple[Any, SamplingParams]] = []

    async def generate(self, request_id: str, prompt: Any, sampling_params: SamplingParams, priority: int = 0) -> Any:
        self.asked.append((prompt, sampling_params))
        for step in range(max(map(len, self.scripts))):
            completions = [
                CompletionOutput(
                    index,
                    f"<{script[step]}>",
                    [script[step]],
                    None,
                    [{script[step]: float(-step)}],
                    finish_reason="length" if step + 1 == len(script) else None,
                )
                for index, script in enumerate(self.scripts)
                if step < len(script)
            ]
            yield RequestOutput(request_id, None, [1, 2], None, completions, step + 1 == max(map(len, self.scripts)))


def _delivered(n: int, *sent: tuple[int, list[int], str | None]) -> Progress:
    """The progress of an attempt that sent, per ``(index, tokens, finish reason)``,
    one chunk per token, then died."""
    progress = Progress(n)
    for index, tokens, finish_reason in sent:
        for i, token in enumerate(tokens):
            progress.add(index, [token], finish_reason if i + 1 == len(tokens) else None)
            progress.texts[index].append(f"<{token}>")
    return progress


async def _rest(progress: Progress, engine: _ParallelEngine, n: int) -> list[Any]:
    request = parse_request({"request_id": "r1", "prompt": "Tell me", "sampling": {"n": n}})
    params = SamplingParams(n=n, temperature=1.0, seed=7, max_tokens=10, prompt_logprobs=2)
    regeneration = await progress.continuation(None, request, None, params)  # type: ignore[arg-type]
    assert isinstance(regeneration, Regeneration)
    return [output async for output in regeneration.generate(engine, "r1")]  # type: ignore[arg-type]


async def test_each_completion_of_a_regeneration_sends_only_what_it_had_not_sent() -> None:
    """Completion 0 had sent 2 tokens, completion 1 had finished, completion 2 had sent
    nothing: what follows is exactly each one's rest, logprobs aligned with the tokens,
    and the finished completion sends nothing again."""
    engine = _ParallelEngine([10, 11, 12, 13], [20, 21], [30, 31, 32])
    progress = _delivered(3, (0, [10, 11], None), (1, [20, 21], "length"))
    outputs = await _rest(progress, engine, 3)

    ((prompt, params),) = engine.asked
    assert prompt == "Tell me"  # the original prompt, from the start
    assert (params.seed, params.n, params.prompt_logprobs) == (7, 3, None)  # prompt logprobs went out already
    sent: dict[int, list[tuple[list[int], str, Any, str | None]]] = {}
    for output in outputs:
        for c in output.outputs:
            sent.setdefault(c.index, []).append((list(c.token_ids), c.text, list(c.logprobs), c.finish_reason))
    assert sent == {
        0: [([12], "<12>", [{12: -2.0}], None), ([13], "<13>", [{13: -3.0}], "length")],
        2: [
            ([30], "<30>", [{30: -0.0}], None),
            ([31], "<31>", [{31: -1.0}], None),
            ([32], "<32>", [{32: -2.0}], "length"),
        ],
    }
    assert outputs[-1].finished and not any(o.finished for o in outputs[:-1])


async def test_a_delta_spanning_the_part_already_sent_is_cut_there() -> None:
    """An engine step may carry several tokens: the sent ones (and their logprobs and
    text) are cut off, the rest goes out."""
    request = parse_request({"request_id": "r1", "prompt": "Tell me", "sampling": {"n": 2}})
    progress = _delivered(2, (0, [10, 11], None))

    class _Wide:
        async def generate(
            self, request_id: str, prompt: Any, sampling_params: SamplingParams, priority: int = 0
        ) -> Any:
            logprobs = [{t: -1.0 * t} for t in (10, 11, 12)]
            first = CompletionOutput(0, "<10><11><12>", [10, 11, 12], None, logprobs, finish_reason="length")
            second = CompletionOutput(1, "<40>", [40], None, None, finish_reason="length")
            yield RequestOutput(request_id, None, [1], None, [first, second], True)

    regeneration = await progress.continuation(None, request, None, SamplingParams(n=2, temperature=1, seed=1))  # type: ignore[arg-type]
    assert isinstance(regeneration, Regeneration)
    (output,) = [o async for o in regeneration.generate(_Wide(), "r1")]  # type: ignore[arg-type]
    first, second = output.outputs
    assert (first.token_ids, first.text, first.logprobs) == ([12], "<12>", [{12: -12.0}])
    assert (second.token_ids, second.text) == ([40], "<40>")


@pytest.mark.parametrize(
    ("sent", "reason"),
    [
        (
            [(0, [10, 11], None), (1, [20, 99], None)],
            "completion 1 had sent: token 2 of the 2 sent differs (regenerated 21, sent 99)",
        ),
        (
            [(0, [10, 11, 12, 13, 14], None)],
            "completion 0 had sent: the regeneration finished after 4 tokens, but 5 had been sent",
        ),
        (
            [(0, [10, 11], "stop")],
            "completion 0 had sent: it had finished after 2 tokens, but the regeneration goes on",
        ),
        (
            [(1, [20, 21, 22], "stop")],
            "completion 1 had sent: it had finished (stop) after 3 tokens, the regeneration finished (length) after 3",
        ),
    ],
    ids=["other-token", "regeneration-ends-sooner", "regeneration-goes-on", "other-finish-reason"],
)
async def test_a_regeneration_that_differs_from_what_was_sent_ends_the_request(
    sent: list[tuple[int, list[int], str | None]], reason: str
) -> None:
    """Nothing that might differ goes out: the take-over fails, saying which completion
    differed where (the job turns that into a ``worker_lost`` error)."""
    engine = _ParallelEngine([10, 11, 12, 13], [20, 21, 22])
    with pytest.raises(RegenerationDiffers) as raised:
        await _rest(_delivered(2, *sent), engine, 2)
    assert str(raised.value) == f"generating the request again from the start did not reproduce what {reason}"


async def test_a_regeneration_that_differs_sends_nothing_of_the_differing_step() -> None:
    engine = _ParallelEngine([10, 11, 12], [20, 21, 22])
    request = parse_request({"request_id": "r1", "prompt": "Tell me", "sampling": {"n": 2}})
    progress = _delivered(2, (0, [10], None), (1, [20, 23], None))
    regeneration = await progress.continuation(None, request, None, SamplingParams(n=2, temperature=1, seed=1))  # type: ignore[arg-type]
    assert isinstance(regeneration, Regeneration)
    got: list[Any] = []
    with pytest.raises(RegenerationDiffers, match=r"completion 1 had sent: token 2 of the 2 sent differs"):
        async for output in regeneration.generate(engine, "r1"):  # type: ignore[arg-type]
            got.append(output)
    assert got == []  # the step holding completion 0's next token also held completion 1's mismatch


async def test_a_regeneration_sends_only_what_follows_the_part_already_sent(tokenizer: Any) -> None:
    progress = _sent(tokenizer, "The key to")
    engine = _Engine(tokenizer, tokenizer.encode(ANSWER, add_special_tokens=False))
    request = parse_request({"request_id": "r1", "prompt": "Tell me"})
    params = SamplingParams(max_tokens=50, temperature=0.7, seed=3)
    continuation = await progress.continuation(engine, request, None, params)  # type: ignore[arg-type]
    assert isinstance(continuation, Regeneration)
    outputs = [output async for output in continuation.generate(engine, "r1")]  # type: ignore[arg-type]
    assert "".join(o.outputs[0].text for o in outputs) == ANSWER.removeprefix("The key to")
    assert outputs[-1].finished
    assert engine.asked[0][0] == "Tell me"  # from the start: the original prompt only
