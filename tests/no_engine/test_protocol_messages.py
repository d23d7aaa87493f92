"""The wire contract's bodies, without Redis or an engine: events, requests,
registrations and jobs as versioned JSON (never pickle) that round-trips; forward
compatibility and enum members on the wire; request bounds; malformed input refused
with the reason; and a producer that imports none of vLLM."""

from __future__ import annotations

import json
import subprocess
import sys

import msgspec
import pytest

from streamq.protocol import (
    BAD_PAYLOAD_MARKER,
    ChunkEvent,
    ErrorCode,
    ErrorEvent,
    FinalEvent,
    FinishReason,
    InvalidRequest,
    WorkerRegistration,
    decode_event,
    decode_registration,
    deserialize_job,
    encode_event,
    encode_registration,
    events_channel,
    is_valid_request_id,
    parse_request,
    serialize_job,
)


def test_events_round_trip_as_versioned_json() -> None:
    events = [
        ChunkEvent(request_id="r1", seq=0, index=0, text="", token_ids=[226], finish_reason=None),
        ChunkEvent(request_id="r1", seq=1, index=1, text="héllo", token_ids=[5, 6], finish_reason="stop"),
        FinalEvent(request_id="r1", seq=2, finish_reasons=["stop", "length"], prompt_tokens=3, completion_tokens=9),
        ErrorEvent(request_id="r1", seq=3, code="invalid_request", message="nope"),
    ]
    for event in events:
        wire = encode_event(event)
        assert json.loads(wire)["v"] == 1
        assert decode_event(wire) == event
    assert json.loads(encode_event(events[0])) == {
        "type": "chunk",
        "v": 1,
        "request_id": "r1",
        "seq": 0,
        "attempt": 1,
        "index": 0,
        "text": "",
        "token_ids": [226],
        "finish_reason": None,
    }


def test_request_with_sampling_parses() -> None:
    request = parse_request(
        {"request_id": "abc-1", "prompt": "Hi", "sampling": {"max_tokens": 5, "temperature": 0, "stop": ["\n"]}}
    )
    assert request.sampling.to_dict() == {"max_tokens": 5, "temperature": 0.0, "stop": ["\n"]}


def test_chat_request_parses() -> None:
    request = parse_request({"request_id": "c", "messages": [{"role": "user", "content": "Hi"}]})
    assert request.messages is not None and request.messages[0].content == "Hi"


@pytest.mark.parametrize(
    ("raw", "reason"),
    [
        ({"prompt": "x"}, "request_id"),
        ({"request_id": "a b", "prompt": "x"}, "request_id must match"),
        ({"request_id": "x" * 129, "prompt": "x"}, "request_id must match"),
        ({"request_id": "../../etc", "prompt": "x"}, "request_id must match"),
        ({"request_id": "r", "prompt": ""}, "prompt must not be empty"),
        ({"request_id": "r"}, "exactly one"),
        ({"request_id": "r", "prompt": "x", "messages": [{"role": "u", "content": "y"}]}, "exactly one"),
        ({"request_id": "r", "prompt": "x", "extra": 1}, "extra"),
        ({"request_id": "r", "prompt": "x", "sampling": {"max_tokens": 1.5}}, "max_tokens"),
        ({"request_id": "r", "prompt": "x" * 1_000_001}, "limit"),
        ({"request_id": "r", "messages": [{"role": "user"}]}, "content"),
        ("just a string", "Expected `object`"),
    ],
)
def test_malformed_requests_are_rejected_with_the_reason(raw: object, reason: str) -> None:
    with pytest.raises(InvalidRequest) as raised:
        parse_request(raw)
    assert reason in str(raised.value)


def test_request_ids_cannot_reach_other_keys() -> None:
    assert is_valid_request_id("chatcmpl-123_abc.def:9")
    for bad in ("", "a*", "a b", "x\n", "a/b", "*", "-leading-dash", 5, None):
        assert not is_valid_request_id(bad)
    assert events_channel("r1") == "streamq:events:r1"


def test_jobs_are_json_not_pickle() -> None:
    job = {"t": 1, "f": "generate", "a": [{"request_id": "r", "prompt": "x"}], "k": {}, "et": 1_764_450_000_000}
    wire = serialize_job(job)
    assert json.loads(wire) == job
    assert deserialize_job(wire) == job


def test_failed_job_results_serialize_their_exception() -> None:
    wire = serialize_job({"s": False, "r": ValueError("bad temperature")})
    assert json.loads(wire)["r"] == {"error": "ValueError", "message": "bad temperature"}


@pytest.mark.parametrize(
    ("payload", "reason"),
    [
        (b"\x80\x04\x95 pickle bytes", "not valid JSON"),
        (b"[1]", "JSON object"),
        (b'{"t": 1, "f": "generate", "a": [], "k": {}}', "`et`"),
        (b'{"t": 1, "f": "os.system", "a": [], "k": {}, "et": 1764450000000}', "unknown job function"),
    ],
)
def test_undecodable_jobs_still_reach_the_job_function(payload: bytes, reason: str) -> None:
    job = deserialize_job(payload)
    assert job["f"] == "generate"
    assert reason in job["k"][BAD_PAYLOAD_MARKER]


def test_events_reject_garbage() -> None:
    with pytest.raises(msgspec.DecodeError):
        decode_event(b'{"type": "chunk"}')


def test_producer_imports_without_vllm_or_torch() -> None:
    code = (
        "import sys; sys.modules['vllm'] = None; sys.modules['torch'] = None\n"
        "import producer, producer.cli, producer.client, streamq.protocol\n"
        "print('ok')"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


def test_enum_members_go_on_the_wire_as_plain_strings() -> None:
    final = FinalEvent(
        request_id="r", seq=3, finish_reasons=[FinishReason.CANCELLED, None], prompt_tokens=2, completion_tokens=0
    )
    error = ErrorEvent(request_id="r", seq=0, code=ErrorCode.WORKER_LOST, message="gone")
    assert json.loads(encode_event(final))["finish_reasons"] == ["cancelled", None]
    assert json.loads(encode_event(error))["code"] == "worker_lost"


def test_events_from_a_newer_version_with_extra_fields_still_decode() -> None:
    wire = b'{"type":"error","v":2,"request_id":"r","seq":1,"code":"internal","message":"m","hint":"new"}'
    event = decode_event(wire)
    assert isinstance(event, ErrorEvent)
    assert (event.seq, event.code, event.attempt) == (1, "internal", 1)


@pytest.mark.parametrize(
    "wire",
    [
        b'{"type":"progress","request_id":"r","seq":0}',
        b'{"type":"final","request_id":"r","seq":"0","finish_reasons":[],"prompt_tokens":0,"completion_tokens":0}',
        b'{"type":"error","request_id":"r","seq":0,"message":"no code"}',
        b"not json",
    ],
    ids=["unknown type", "seq as a string", "missing code", "not json"],
)
def test_malformed_events_are_rejected(wire: bytes) -> None:
    with pytest.raises((msgspec.DecodeError, msgspec.ValidationError)):
        decode_event(wire)


def test_registrations_round_trip_to_the_same_bytes() -> None:
    registration = WorkerRegistration(worker_id="h-1-ab", model="tiny", queue="streamq:queue", max_model_len=256)
    wire = encode_registration(registration)
    assert decode_registration(wire) == registration
    assert encode_registration(decode_registration(wire)) == wire


def test_registrations_ignore_fields_from_newer_versions() -> None:
    wire = b'{"worker_id":"w","model":"m","queue":"q","v":2,"gpu":"h200"}'
    assert decode_registration(wire) == WorkerRegistration(worker_id="w", model="m", queue="q", v=2)


def test_request_ids_are_bounded_at_128_characters() -> None:
    assert is_valid_request_id("a" * 128)
    assert not is_valid_request_id("a" * 129)


@pytest.mark.parametrize(
    ("extra", "reason"),
    [
        ({"deadline_s": 0}, "deadline_s must be positive"),
        ({"queue_timeout_s": -1.5}, "queue_timeout_s must be positive"),
        ({"model": ""}, "model must not be empty"),
    ],
)
def test_request_bounds_are_enforced(extra: dict[str, object], reason: str) -> None:
    with pytest.raises(InvalidRequest, match=reason):
        parse_request({"request_id": "r", "prompt": "x", **extra})


def test_empty_chat_is_rejected() -> None:
    with pytest.raises(InvalidRequest, match="messages must not be empty"):
        parse_request({"request_id": "r", "messages": []})


def test_a_request_encodes_only_what_was_set() -> None:
    request = parse_request({"request_id": "r", "prompt": "x", "sampling": {"max_tokens": 4}})
    assert msgspec.to_builtins(request) == {"request_id": "r", "prompt": "x", "sampling": {"max_tokens": 4}}
