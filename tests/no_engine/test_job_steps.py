"""The steps of a request's run in the worker (``worker/job.py``), each alone: the deadlines,
and emitting an engine output, streamed or in checkpoints."""

from __future__ import annotations

import time
import warnings
from types import SimpleNamespace
from typing import Any

import pytest

from streamq.protocol import ChunkEvent, FinalEvent, FinishReason, GenerateRequest, PromptEcho, decode_event
from worker.request_events import RequestEvents
from worker.state import RedisClock

with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)  # torch's own, raised while vLLM imports
    from vllm.outputs import CompletionOutput, RequestOutput

    from worker.job import _emit, _prompt, _prompt_token_ids, _Readers, _time_left
    from worker.progress import Progress
    from worker.prompt_report import PromptReporter


class RecordingPublisher:
    """The publisher's interface as ``RequestEvents`` uses it, recording what it is given."""

    def __init__(self) -> None:
        self.events: list[ChunkEvent | FinalEvent] = []

    def publish_chunk(self, event: ChunkEvent, *, deltas: int = 1) -> int:
        self.events.append(event)
        return 0

    def extendable(self, generation: int) -> bool:
        return False

    def publish(self, request_id: str, seq: int, attempt: int, payload: bytes, *, terminal: bool = False) -> None:
        event = decode_event(payload)
        assert isinstance(event, FinalEvent)
        self.events.append(event)


def _state() -> Any:
    return SimpleNamespace(clock=RedisClock())


def _now_ms() -> int:
    return int(time.time() * 1000)


@pytest.mark.parametrize(
    ("waited_s", "fields", "attempt", "expected"),
    [
        (1.0, {}, 1, None),
        (1.0, {"deadline_s": 10}, 1, 9.0),
        (11.0, {"deadline_s": 10}, 1, FinishReason.TIMEOUT),
        (3.0, {"queue_timeout_s": 2}, 1, FinishReason.QUEUE_TIMEOUT),
        (3.0, {"queue_timeout_s": 2}, 2, None),  # a take-over has left the queue long ago
    ],
)
def test_the_deadlines_count_from_the_enqueue(
    waited_s: float, fields: dict[str, Any], attempt: int, expected: float | FinishReason | None
) -> None:
    request = GenerateRequest(request_id="r", prompt="hi", **fields)
    left = _time_left(_state(), _now_ms() - round(waited_s * 1000), request, attempt)
    if isinstance(expected, float):
        assert isinstance(left, float) and left == pytest.approx(expected, abs=0.5)
    else:
        assert left == expected


def _output(text: str, ids: list[int], finish: str | None) -> RequestOutput:
    completion = CompletionOutput(0, text, ids, None, None, finish_reason=finish)
    return RequestOutput("r", None, [1, 2, 3], None, [completion], finish is not None)


@pytest.mark.parametrize("checkpoint_tokens", [None, 3])
def test_emitting_outputs_tallies_their_tokens_and_ends_with_the_final(checkpoint_tokens: int | None) -> None:
    publisher = RecordingPublisher()
    events = RequestEvents(publisher, "r", checkpoint_tokens=checkpoint_tokens)  # type: ignore[arg-type]
    progress = Progress(1)
    for output in (_output("a", [1], None), _output("bcd", [2, 3, 4], None), _output("e", [5], "length")):
        _emit(events, progress, output, _Readers(None, None))
    chunks = [e for e in publisher.events if isinstance(e, ChunkEvent)]
    streamed = checkpoint_tokens is None
    assert [c.token_ids for c in chunks] == ([[1], [2, 3, 4], [5]] if streamed else [[1, 2, 3, 4], [5]])
    final = publisher.events[-1]
    assert isinstance(final, FinalEvent) and final.completion_tokens == 5 == progress.completion_tokens
    assert (final.prompt_tokens, final.finish_reasons) == (3, ["length"])
    assert [e.seq for e in publisher.events] == list(range(len(publisher.events)))


class BosTokenizer:
    """A tokenizer that spells each character as its code point and adds a BOS (1) unless
    asked not to."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return ([1] if add_special_tokens else []) + [ord(c) for c in text]

    def decode(self, ids: list[int] | int) -> str:
        return "".join("<s>" if i == 1 else chr(i) for i in ([ids] if isinstance(ids, int) else ids))


async def test_the_prompt_the_engine_gets_is_tokenized_as_the_request_says() -> None:
    engine = SimpleNamespace(get_tokenizer=BosTokenizer)
    text = GenerateRequest(request_id="r", prompt="hi")
    assert await _prompt_token_ids(engine, text) is None  # vLLM tokenizes it, special tokens added
    bare = GenerateRequest(request_id="r", prompt="hi", add_special_tokens=False)
    assert await _prompt_token_ids(engine, bare) == [ord("h"), ord("i")]
    ids = GenerateRequest(request_id="r", prompt_token_ids=[1, 104])
    assert await _prompt_token_ids(engine, ids) == [1, 104]  # as given
    cut = GenerateRequest(request_id="r", prompt="hi", truncate_prompt_tokens=2)
    assert await _prompt_token_ids(engine, cut) == [1, ord("h"), ord("i")]  # tokenized here, to be cut


async def test_the_prompt_is_cut_to_truncate_prompt_tokens_after_the_template() -> None:
    tokenizer = BosTokenizer()
    tokenizer.truncation_side = "right"  # type: ignore[attr-defined]
    engine = SimpleNamespace(get_tokenizer=lambda: tokenizer, model_config=SimpleNamespace(max_model_len=8))
    state = SimpleNamespace(engine=engine)
    left = GenerateRequest(request_id="r", prompt="hello", truncate_prompt_tokens=3, truncation_side="left")
    assert (await _prompt(state, left)).token_ids == [ord(c) for c in "llo"]  # type: ignore[arg-type]
    right = GenerateRequest(request_id="r", prompt="hello", truncate_prompt_tokens=3)
    assert (await _prompt(state, right)).token_ids == [1, ord("h"), ord("e")]  # type: ignore[arg-type]


def test_echo_reports_the_prompts_text_and_its_first_token() -> None:
    request = GenerateRequest(request_id="r", prompt_token_ids=[1, 104, 105], echo=True)
    reporter = PromptReporter(request, None, BosTokenizer())
    output = RequestOutput("r", None, [1, 104, 105], None, [], False)
    report = reporter.report(output)
    assert report is not None and report.echo == PromptEcho(text="<s>hi", first_token="<s>")
    assert report.token_ids == [1, 104, 105] and report.logprobs is None
    assert reporter.report(output) is None  # once: the request's first chunk only


def test_return_prompt_token_ids_reports_the_ids_without_the_text() -> None:
    request = GenerateRequest(request_id="r", prompt="hi", return_prompt_token_ids=True)
    engine = SimpleNamespace(get_tokenizer=BosTokenizer)
    reporter = PromptReporter.for_request(request, None, engine, with_prompt=True)  # type: ignore[arg-type]
    assert reporter is not None
    report = reporter.report(RequestOutput("r", "hi", [1, 104, 105], None, [], False))
    assert report is not None and report.token_ids == [1, 104, 105] and report.echo is None
    plain = GenerateRequest(request_id="r", prompt="hi")
    assert PromptReporter.for_request(plain, None, engine, with_prompt=True) is None  # type: ignore[arg-type]
