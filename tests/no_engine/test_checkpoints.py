"""A request that is not streamed: its DELTAs are held and written as checkpoints, one
chunk event per ``checkpoint_tokens`` tokens of a completion, then its end; the log
reassembles to exactly what one event per DELTA would have carried."""

from __future__ import annotations

import uuid
import warnings
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis
from prometheus_client import REGISTRY

from streamq.broker.replay_log import ReplayLog
from streamq.protocol import ChunkEvent, ErrorEvent, FinalEvent, GenerateRequest, Sampling, TokenLogprob, decode_event
from worker.delivery import Delivery, checkpoint_tokens_from_env
from worker.publisher import EventPublisher
from worker.request_events import RequestEvents

with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)  # torch's own, raised while vLLM imports
    from worker.prompt_report import PromptReport


@pytest.fixture
async def publisher(redis_url: str) -> AsyncIterator[tuple[EventPublisher, ReplayLog]]:
    client = aioredis.Redis.from_url(redis_url)
    log = ReplayLog(client)
    publisher = EventPublisher(log)
    publisher.start()
    yield publisher, log
    await publisher.close()
    await client.aclose()


def _sample(name: str, streamed: str) -> float:
    return REGISTRY.get_sample_value(name, {"streamed": streamed}) or 0.0


async def _logged(log: ReplayLog, request_id: str) -> list[ChunkEvent | FinalEvent | ErrorEvent]:
    return [decode_event(raw) for raw in await log.read(request_id)]


async def test_a_request_that_is_not_streamed_writes_a_chunk_per_checkpoint_then_its_final(
    publisher: tuple[EventPublisher, ReplayLog],
) -> None:
    events_before = _sample("streamq_request_events_sum", "false")
    count_before = _sample("streamq_request_events_count", "false")
    pub, log = publisher
    request_id = uuid.uuid4().hex
    events = RequestEvents(pub, request_id, checkpoint_tokens=4)
    # As the engine sends them with a stream interval of 4: the first token at once,
    # then every 4 tokens, then the last ones with the finish reason.
    deltas = [(["a"], [1]), (["b", "c", "d", "e"], [2, 3, 4, 5]), (["f", "g", "h", "i"], [6, 7, 8, 9]), (["j"], [10])]
    for number, (texts, ids) in enumerate(deltas):
        finish = "length" if number == len(deltas) - 1 else None
        events.chunk(0, "".join(texts), ids, finish)
    events.final(["length"], prompt_tokens=3, completion_tokens=10)
    await events.delivered()

    logged = await _logged(log, request_id)
    assert [e.seq for e in logged] == [0, 1, 2, 3], "one contiguous sequence"
    chunks = [e for e in logged if isinstance(e, ChunkEvent)]
    assert [c.token_ids for c in chunks] == [[1, 2, 3, 4, 5], [6, 7, 8, 9], [10]]
    assert "".join(c.text for c in chunks) == "abcdefghij"
    assert [c.finish_reason for c in chunks] == [None, None, "length"]
    assert isinstance(logged[-1], FinalEvent) and logged[-1].completion_tokens == 10
    assert _sample("streamq_request_events_sum", "false") - events_before == 4
    assert _sample("streamq_request_events_count", "false") - count_before == 1


async def test_what_is_held_is_written_before_an_early_end(publisher: tuple[EventPublisher, ReplayLog]) -> None:
    pub, log = publisher
    request_id = uuid.uuid4().hex
    events = RequestEvents(pub, request_id, checkpoint_tokens=100)
    events.chunk(0, "held ", [1], None)
    events.chunk(1, "other", [2, 3], None)
    events.chunk(0, "text", [4], None)
    events.final(["cancelled", "cancelled"], prompt_tokens=3, completion_tokens=4)  # a cancel, a deadline
    await events.delivered()

    logged = await _logged(log, request_id)
    assert [(e.index, e.text, e.token_ids) for e in logged if isinstance(e, ChunkEvent)] == [
        (0, "held text", [1, 4]),
        (1, "other", [2, 3]),
    ]
    assert isinstance(logged[-1], FinalEvent) and [e.seq for e in logged] == [0, 1, 2]


async def test_held_logprobs_follow_their_tokens(publisher: tuple[EventPublisher, ReplayLog]) -> None:
    pub, log = publisher
    request_id = uuid.uuid4().hex
    events = RequestEvents(pub, request_id, checkpoint_tokens=8)
    first, second = TokenLogprob(-0.5, 1, "a", []), TokenLogprob(-1.5, 2, "b", [])
    prompt = PromptReport([5, 6], [None, TokenLogprob(-2.0, 3, "p", [])])
    events.chunk(0, "a", [1], None, [first], prompt)
    events.chunk(0, "b", [2], "stop", [second])
    events.final(["stop"], prompt_tokens=2, completion_tokens=2)
    await events.delivered()

    (chunk, final) = await _logged(log, request_id)
    assert isinstance(chunk, ChunkEvent) and isinstance(final, FinalEvent)
    assert chunk.logprobs == [first, second] and chunk.token_ids == [1, 2]
    assert chunk.prompt_token_ids == [5, 6] and chunk.prompt_logprobs == prompt.logprobs


async def test_an_error_ends_a_held_request_after_its_checkpoint(publisher: tuple[EventPublisher, ReplayLog]) -> None:
    pub, log = publisher
    request_id = uuid.uuid4().hex
    events = RequestEvents(pub, request_id, checkpoint_tokens=8)
    events.chunk(0, "x", [1], None)
    events.error("internal", "boom")
    await events.delivered()
    logged = await _logged(log, request_id)
    assert [type(e) for e in logged] == [ChunkEvent, ErrorEvent] and [e.seq for e in logged] == [0, 1]


def test_a_request_says_whether_it_is_streamed_and_defaults_to_streamed() -> None:
    streamed = GenerateRequest(request_id="r1", prompt="hi")
    whole = GenerateRequest(request_id="r2", prompt="hi", stream=False)
    assert Delivery.of(streamed, 64).streamed and Delivery.of(streamed, 64).checkpoint_tokens is None
    assert Delivery.of(whole, 64).checkpoint_tokens == 64


def test_the_engine_is_asked_for_an_output_per_checkpoint_not_per_token() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # torch's own, raised while vLLM imports
        from worker.job import sampling_params_for

    whole = GenerateRequest(request_id="r", prompt="hi", stream=False, sampling=Sampling(max_tokens=10))
    assert sampling_params_for(whole, Delivery(64)).stream_interval == 64
    slow = GenerateRequest(request_id="r", prompt="hi", stream=False, sampling=Sampling(stream_interval=100))
    assert sampling_params_for(slow, Delivery(64)).stream_interval == 100, "a request may only raise it"
    streamed = GenerateRequest(request_id="r", prompt="hi", sampling=Sampling(stream_interval=8))
    assert sampling_params_for(streamed, Delivery(None)).stream_interval == 8


@pytest.mark.parametrize(("raw", "message"), [("0", "1 or more"), ("many", "integer")])
def test_a_bad_checkpoint_setting_is_refused_by_name(raw: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        checkpoint_tokens_from_env({"STREAMQ_CHECKPOINT_TOKENS": raw})
    assert checkpoint_tokens_from_env({}) == 256
