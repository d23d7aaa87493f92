"""A pooling request's results on the wire and in the client: the pooled event's framing
(JSON, a newline, raw bytes), the request's validation, ``Pooled``'s unpacking with and
without numpy, and the producer's refusals of a request its model cannot run."""

from __future__ import annotations

import base64
import json
import struct
from typing import Any

import msgspec
import numpy
import pytest

import producer.pooled
from producer.pooled import Pooled, check_task, inputs_of
from streamq.broker.registry import Routes
from streamq.protocol import (
    MAX_POOLED_BYTES,
    MAX_POOLING_INPUTS,
    ChunkEvent,
    FinalEvent,
    GenerateRequest,
    InvalidRequest,
    PooledEvent,
    Pooling,
    WorkerRegistration,
    decode_event,
    encode_event,
    event_json,
    parse_request,
)

VECTORS = [[1.0, -0.5, 0.25], [0.0, 2.0, -3.0]]
PACKED = struct.pack("<6f", *VECTORS[0], *VECTORS[1])


def pooled_event(data: bytes = PACKED, **fields: Any) -> PooledEvent:
    fields = {"shapes": [[3], [3]], "prompt_tokens": [4, 7], **fields}
    return PooledEvent(request_id="r1", seq=0, attempt=1, data=data, **fields)


@pytest.mark.parametrize("data", [PACKED, b"\n\n" + PACKED + b"\n", b'{"type":"final"}\n'])
def test_a_pooled_event_round_trips_with_any_bytes(data: bytes) -> None:
    """The data may hold newlines and JSON-looking bytes: a reader splits at the first newline."""
    event = pooled_event(data)
    assert decode_event(encode_event(event)) == event


def test_the_json_line_holds_no_raw_newline() -> None:
    wire = encode_event(pooled_event())
    header, data = wire.split(b"\n", 1)
    assert data == PACKED
    fields = json.loads(header)
    assert fields["type"] == "pooled" and "data" not in fields
    assert (fields["shapes"], fields["prompt_tokens"], fields["dtype"]) == ([[3], [3]], [4, 7], "float32")


def test_event_json_is_the_header_alone() -> None:
    event = pooled_event()
    assert event_json(event).encode() == encode_event(event).split(b"\n", 1)[0]


def test_a_text_with_newlines_is_escaped_in_other_events() -> None:
    """A chunk's text with newlines stays on one JSON line (no bytes after it)."""
    chunk = ChunkEvent(request_id="r1", seq=0, attempt=1, index=0, text="line one\nline two\n", token_ids=[1, 2])
    wire = encode_event(chunk)
    assert b"\n" not in wire
    assert decode_event(wire) == chunk


def test_bytes_after_a_non_pooled_event_are_refused() -> None:
    final = FinalEvent(request_id="r1", seq=1, attempt=1, finish_reasons=["stop"], prompt_tokens=3, completion_tokens=0)
    with pytest.raises(msgspec.DecodeError, match="only a pooled event carries data"):
        decode_event(encode_event(final) + b"\n" + PACKED)


def test_a_pooled_event_without_data_decodes_without_it() -> None:
    event = pooled_event(msgspec.UNSET)  # type: ignore[arg-type]
    wire = encode_event(event)
    assert b"\n" not in wire
    decoded = decode_event(wire)
    assert isinstance(decoded, PooledEvent) and decoded.data is msgspec.UNSET


def pooling_request(**fields: Any) -> GenerateRequest:
    return parse_request({"request_id": "r1", "inputs": ["a"], "pooling": {"task": "embed"}, **fields})


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"inputs": []}, "inputs must not be empty"),
        ({"inputs": ["a", []]}, "inputs[1] is an empty token-id list"),
        ({"inputs": [[3, -1]]}, "inputs[0]: token ids must be 0 or more"),
        ({"inputs": ["a"] * (MAX_POOLING_INPUTS + 1)}, f"the limit is {MAX_POOLING_INPUTS}"),
        ({"pooling": None}, "'inputs' and 'pooling' go together"),
        ({"inputs": None, "prompt": "a"}, "'inputs' and 'pooling' go together"),
        ({"prompt": "a"}, "exactly one of"),
        ({"sampling": {"max_tokens": 5}}, "no generation fields, got sampling"),
        ({"echo": True}, "no generation fields, got echo"),
        ({"truncation_side": "left"}, "no generation fields, got truncation_side"),
        ({"pooling": {"task": "token_embed"}}, "task"),
        ({"pooling": {"task": "embed", "dimensions": 0}}, "dimensions must be positive"),
        ({"pooling": {"task": "embed", "normalize": True}}, "normalize"),
        ({"inputs": [{"text": "a"}]}, "inputs[0]"),
    ],
)
def test_a_bad_pooling_request_is_refused(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(InvalidRequest) as error:
        pooling_request(**fields)
    assert message in str(error.value)


def test_a_good_pooling_request_parses() -> None:
    request = pooling_request(inputs=["a", [1, 2]], pooling={"task": "classify", "use_activation": False})
    assert request.inputs == ["a", [1, 2]]
    assert request.pooling == Pooling(task="classify", use_activation=False)


@pytest.mark.parametrize(
    ("inputs", "expected"),
    [
        ("one text", ["one text"]),
        ([1, 2, 3], [[1, 2, 3]]),
        ((1, 2), [[1, 2]]),
        (["a", (1, 2), [3]], ["a", [1, 2], [3]]),
        ([], []),
        (None, None),
    ],
)
def test_inputs_are_read_as_the_wire_takes_them(inputs: Any, expected: Any) -> None:
    assert inputs_of(inputs) == expected


@pytest.mark.parametrize(
    ("inputs", "message"),
    [
        ({"text": "a"}, "inputs must be a text, a token-id list or a list of them, got dict"),
        (b"bytes", "got bytes"),
        (42, "got int"),
        ([{"text": "a"}], "inputs[0] must be a text or a list of token ids, got dict"),
        (["a", b"bytes"], "inputs[1] must be a text or a list of token ids, got bytes"),
        (["a", 1], "inputs[1] must be a text or a list of token ids, got int"),
        ([1.5, 2.5], "inputs[0] must be a text or a list of token ids, got float"),
        ([[1, "2"]], "inputs[0] must be a text or a list of token ids, got list"),
        ([True, False], "got bool"),
    ],
)
def test_inputs_of_other_types_are_refused_not_reread(inputs: Any, message: str) -> None:
    """A dict would otherwise pass as its keys, bytes as their values: texts the caller never meant."""
    with pytest.raises(InvalidRequest) as error:
        inputs_of(inputs)
    assert message in str(error.value)


def test_pooled_unpacks_numpy_views() -> None:
    pooled = Pooled.of_event(pooled_event(), "worker-1")
    assert (len(pooled), pooled.prompt_tokens, pooled.total_prompt_tokens, pooled.worker_id) == (
        2,
        [4, 7],
        11,
        "worker-1",
    )
    vectors = pooled.vectors
    assert all(isinstance(v, numpy.ndarray) and v.dtype == numpy.float32 for v in vectors)
    assert [v.tolist() for v in vectors] == VECTORS
    assert pooled.as_lists() == VECTORS
    assert [base64.b64decode(b) for b in pooled.as_base64()] == [PACKED[:12], PACKED[12:]]


def test_pooled_unpacks_lists_without_numpy(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(producer.pooled, "HAVE_NUMPY", False)
    pooled = Pooled.of_event(pooled_event())
    assert pooled.vectors == VECTORS
    assert all(type(v) is list for v in pooled.vectors)
    assert pooled.as_lists() == VECTORS


@pytest.mark.parametrize("have_numpy", [True, False])
def test_results_of_more_than_one_dimension_keep_their_shape(monkeypatch: pytest.MonkeyPatch, have_numpy: bool) -> None:
    monkeypatch.setattr(producer.pooled, "HAVE_NUMPY", have_numpy)
    event = PooledEvent(request_id="r1", seq=0, attempt=1, shapes=[[2, 3]], prompt_tokens=[2], data=PACKED)
    assert Pooled.of_event(event).as_lists() == [VECTORS]


@pytest.mark.parametrize("have_numpy", [True, False])
def test_results_that_do_not_fill_their_shapes_are_refused(monkeypatch: pytest.MonkeyPatch, have_numpy: bool) -> None:
    monkeypatch.setattr(producer.pooled, "HAVE_NUMPY", have_numpy)
    with pytest.raises(ValueError, match="24 bytes of results for 7 values"):
        _ = Pooled.of_event(pooled_event(shapes=[[3], [4]])).vectors


def test_results_of_another_dtype_are_refused() -> None:
    with pytest.raises(ValueError, match="float16"):
        Pooled.of_event(pooled_event(dtype="float16"))


def routes(*registrations: WorkerRegistration) -> Routes:
    return Routes(workers=list(registrations), known_models={r.model: r.queue for r in registrations})


GENERATOR = WorkerRegistration(worker_id="g", model="gen", queue="streamq:queue:gen")
EMBEDDER = WorkerRegistration(
    worker_id="e", model="emb", queue="streamq:queue:emb", tasks=("embed", "token_embed"), pooled_size=128
)
BIG_EMBEDDER = WorkerRegistration(
    worker_id="b", model="big", queue="streamq:queue:big", tasks=("embed",), pooled_size=4096
)


def generation_request() -> GenerateRequest:
    return parse_request({"request_id": "r1", "prompt": "hello"})


def test_check_task_refuses_generation_on_a_pooling_model() -> None:
    with pytest.raises(InvalidRequest, match=r"^This model does not support generation \(model 'emb'"):
        check_task(generation_request(), routes(EMBEDDER), "emb")


def test_check_task_refuses_pooling_on_a_generation_model() -> None:
    with pytest.raises(InvalidRequest, match=r"^This model does not support pooling \(model 'gen'"):
        check_task(pooling_request(), routes(GENERATOR), "gen")


def test_check_task_refuses_a_task_the_model_lacks() -> None:
    request = pooling_request(pooling={"task": "classify"})
    with pytest.raises(InvalidRequest, match=r"^Unsupported task: 'classify' Supported tasks: embed, token_embed"):
        check_task(request, routes(EMBEDDER), "emb")


def test_check_task_passes_what_the_model_runs() -> None:
    check_task(pooling_request(), routes(EMBEDDER, GENERATOR), "emb")
    check_task(generation_request(), routes(EMBEDDER, GENERATOR), "gen")


def test_check_task_leaves_a_model_with_no_live_worker_to_its_worker() -> None:
    check_task(pooling_request(), routes(GENERATOR), "nobody")
    check_task(generation_request(), routes(), "nobody")


def test_check_task_bounds_the_results_bytes() -> None:
    most = MAX_POOLED_BYTES // (4096 * 4)
    check_task(pooling_request(inputs=["a"] * most), routes(BIG_EMBEDDER), "big")
    with pytest.raises(InvalidRequest, match=f"send at most {most} inputs per request"):
        check_task(pooling_request(inputs=["a"] * (most + 1)), routes(BIG_EMBEDDER), "big")
