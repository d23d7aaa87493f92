"""Request, event and registration bodies: what tests/test_protocol.py leaves out
(forward compatibility, enum members on the wire, registration, request bounds)."""

from __future__ import annotations

import json

import msgspec
import pytest

from streamq.protocol import (
    ErrorCode,
    ErrorEvent,
    FinalEvent,
    FinishReason,
    InvalidRequest,
    WorkerRegistration,
    decode_event,
    decode_registration,
    encode_event,
    encode_registration,
    is_valid_request_id,
    parse_request,
)


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
        ({"timeout_s": 0}, "timeout_s must be positive"),
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
