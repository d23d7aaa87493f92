"""A streamed response as the SSE text a client reads: one event per chunk, ``id: <seq>.<digest>``
when resumable, ``[DONE]``."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

from gateway.sse import SseEncoder
from producer.client import event_digest
from producer.openai_api.chunks import ChunkBuilder
from producer.openai_api.responses import ResponseMeta
from streamq.protocol import ChunkEvent, ErrorEvent, Event, FinalEvent, encode_event

EVENTS: list[Event] = [
    ChunkEvent(request_id="r1", seq=0, text="Hi", token_ids=[1]),
    ChunkEvent(request_id="r1", seq=1, text="", token_ids=[2]),
    ChunkEvent(request_id="r1", seq=2, text=" é", token_ids=[3], finish_reason="stop"),
    FinalEvent(request_id="r1", seq=3, finish_reasons=["stop"], prompt_tokens=2, completion_tokens=3),
]


def event_id(event: Event, prompt: int) -> str:
    """What the gateway labels a resumable stream's event with: its seq and its digest as logged."""
    return f"{event.seq}.{event_digest(encode_event(event))}"


def encode(events: list[Event], *, chat: bool = True, event_ids: bool = False, include_usage: bool = False) -> str:
    builder = ChunkBuilder(ResponseMeta(chat, "r1", "tiny", 1700), include_usage)
    encoder = SseEncoder(builder, event_ids=event_id if event_ids else None)
    return b"".join(encoder.encode(event) for event in events).decode()


def blocks(text: str) -> list[list[str]]:
    """The SSE events of ``text``, each as its lines."""
    assert text.endswith("\n\n")
    return [block.split("\n") for block in text[:-2].split("\n\n")]


def test_each_chunk_is_one_data_event_and_the_stream_ends_with_done() -> None:
    events = blocks(encode(EVENTS))
    assert [len(lines) for lines in events] == [1, 1, 1, 1, 1]
    assert events[-1] == ["data: [DONE]"]
    contents = [json.loads(lines[0].removeprefix("data: "))["choices"][0]["delta"]["content"] for lines in events[:-1]]
    assert contents == ["", "Hi", "", " é"]


def test_data_is_compact_json_that_keeps_non_ascii_text() -> None:
    first = encode(EVENTS[:1], chat=False)
    assert first.startswith('data: {"id":"cmpl-r1","object":"text_completion",')
    assert first.endswith("\n\n") and first.count("\n") == 2
    assert "é" in encode(EVENTS[2:3], chat=False)


def test_resumable_streams_label_each_event_with_its_seq_and_digest() -> None:
    """Each SSE event of one event (the role chunk and the first text chunk are both event 0)
    carries ``id: <seq>.<digest>``, the digest of the event's JSON as logged."""
    digests = [event_digest(encode_event(event)) for event in EVENTS]
    assert len(set(digests)) == 4 and all(len(d) == 16 and int(d, 16) >= 0 for d in digests)
    events = blocks(encode(EVENTS, event_ids=True, include_usage=True))
    assert [lines[0] for lines in events[:-1]] == [f"id: {seq}.{digests[seq]}" for seq in (0, 0, 1, 2, 3)]
    assert json.loads(events[4][1].removeprefix("data: "))["usage"]["total_tokens"] == 5
    assert events[-1] == ["data: [DONE]"]


def test_events_carry_no_id_unless_resumable() -> None:
    assert "id:" not in encode(EVENTS, include_usage=True)


def test_a_partial_character_is_an_event_with_empty_text() -> None:
    (event,) = blocks(encode(EVENTS[1:2], chat=False))
    assert json.loads(event[0].removeprefix("data: "))["choices"][0]["text"] == ""


def test_an_error_ends_the_stream_with_an_error_event_then_done() -> None:
    error = ErrorEvent(request_id="r1", seq=1, code="worker_lost", message="gone")
    events = blocks(encode([EVENTS[0], error], chat=False, event_ids=True))
    assert events[1][0] == f"id: 1.{event_digest(encode_event(error))}"
    assert json.loads(events[1][1].removeprefix("data: "))["error"]["code"] == "worker_lost"
    assert events[2] == ["data: [DONE]"]


async def test_a_stream_releases_its_key_admission_before_its_client_reads_done() -> None:
    """A client that sends its next request the moment it reads ``[DONE]`` must find its key's
    place (``max_streams``) free: the stream's account closes before those bytes go out."""
    from gateway.routes.completions import _sse_text
    from producer.openai_api.errors import waited_too_long

    closed_when: list[int] = []
    sent: list[bytes] = []

    class Account:
        def charge(self, prompt_tokens: int, completion_tokens: int) -> None:
            pass

        async def close(self, *, succeeded: bool = True) -> None:
            closed_when.append(len(sent))

    async def rest() -> AsyncIterator[tuple[int, Event] | None]:
        for event in EVENTS[1:]:
            yield 0, event

    encoder = SseEncoder(ChunkBuilder(ResponseMeta(True, "r1", "tiny", 1700), False))
    stream = _sse_text(encoder, (0, EVENTS[0]), rest(), Account(), timed_out=waited_too_long("tiny", 1), arrived=None)  # type: ignore[arg-type]
    async for text in stream:
        sent.append(text)
    assert sent[-1].endswith(b"data: [DONE]\n\n")
    assert closed_when == [len(sent) - 1]  # closed once, before the last bytes were sent
