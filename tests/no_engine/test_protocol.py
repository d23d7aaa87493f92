"""The wire contract, without Redis or an engine."""

from __future__ import annotations

import json
import subprocess
import sys

import msgspec
import pytest

from streamq.protocol import (
    BAD_PAYLOAD_MARKER,
    ChunkEvent,
    ErrorEvent,
    FinalEvent,
    InvalidRequest,
    decode_event,
    deserialize_job,
    encode_event,
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
