"""The arq envelope of a job (``t``, ``f``, ``a``, ``k``, ``et``): whatever bytes sit in
``arq:job:<id>``, what the job deserializer hands arq is a job arq can run without
raising, and a malformed one becomes the job that reports it."""

from __future__ import annotations

import json
import random
import time
from collections.abc import Iterator
from typing import Any

import pytest
from arq.jobs import deserialize_job_raw, deserialize_result, serialize_result
from arq.jobs import serialize_job as arq_serialize_job
from arq.utils import args_to_string, ms_to_datetime

from streamq.protocol import (
    BAD_PAYLOAD_MARKER,
    EARLIEST_ENQUEUE_MS,
    JOB_FUNCTION,
    MAX_ARGS_DEPTH,
    MAX_ENQUEUE_AHEAD_MS,
    MAX_ENQUEUE_TRY,
    deserialize_job,
    serialize_job,
)

NOW_MS = int(time.time() * 1000)
REQUEST = {"request_id": "req-1", "prompt": "Hello", "sampling": {"max_tokens": 4, "stop": ["\n"]}}


def job(**overrides: Any) -> dict[str, Any]:
    """A valid job as the producer library writes it, with ``overrides`` (``...`` deletes a field)."""
    fields = {"t": 1, "f": JOB_FUNCTION, "a": [REQUEST], "k": {}, "et": NOW_MS, **overrides}
    return {name: value for name, value in fields.items() if value is not ...}


def nested(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


def with_args(raw_args: bytes) -> bytes:
    return b'{"t":1,"f":"generate","a":' + raw_args + b',"k":{},"et":' + str(NOW_MS).encode() + b"}"


def _generate(ctx: dict[str, Any], *args: Any, **kwargs: Any) -> None:
    """The job function's signature (``worker.job.generate``), without importing vLLM."""


def failed_result(function: str, args: Any, kwargs: dict[str, Any], job_try: int, enqueue_ms: int) -> bytes:
    """The result arq stores for a failed job (run_job's ``job_failed``), with streamq's serializer."""
    fields = (function, args, kwargs, job_try, enqueue_ms, False, ValueError("bad"), NOW_MS, NOW_MS + 5, "ref", "q")
    stored = serialize_result(*fields, job_id="req-1", serializer=serialize_job)
    assert stored is not None
    return stored


def run_like_arq(data: bytes) -> tuple[Any, ...]:
    """What ``arq.worker.Worker.run_job`` does with a payload outside its error handling,
    plus what it does inside it before the job function runs (a failure there fails the
    job without the job function, so without an event)."""
    function, args, kwargs, enqueue_try, enqueue_ms = deserialize_job_raw(data, deserializer=deserialize_job)
    job_try = 1
    if enqueue_try and enqueue_try > job_try:
        job_try = enqueue_try
    str(job_try)  # arq stores it in Redis as a string
    assert function == JOB_FUNCTION
    assert job_try <= MAX_ENQUEUE_TRY
    ms_to_datetime(enqueue_ms)
    args_to_string(args, kwargs)
    _generate({}, *args, **kwargs)
    failed_result(function, args, kwargs, job_try, enqueue_ms)
    return function, args, kwargs, enqueue_try, enqueue_ms


def test_a_valid_job_passes_unchanged() -> None:
    wire = serialize_job(job())
    assert deserialize_job(wire) == job()
    assert run_like_arq(wire) == (JOB_FUNCTION, [REQUEST], {}, 1, NOW_MS)


def test_arqs_own_enqueue_format_is_accepted() -> None:
    # arq's ArqRedis.enqueue_job writes "t": null for a first try.
    wire = arq_serialize_job(JOB_FUNCTION, (REQUEST,), {}, None, NOW_MS, serializer=serialize_job)
    assert BAD_PAYLOAD_MARKER not in deserialize_job(wire)["k"]
    run_like_arq(wire)


@pytest.mark.parametrize(
    "et",
    [EARLIEST_ENQUEUE_MS, NOW_MS - 86_400_000 * 365 * 5, NOW_MS + MAX_ENQUEUE_AHEAD_MS - 60_000],
    ids=["2000-01-01", "five years ago", "a day ahead, less a minute"],
)
def test_enqueue_times_within_the_window_are_accepted(et: int) -> None:
    assert deserialize_job(serialize_job(job(et=et)))["et"] == et


@pytest.mark.parametrize("t", [1, 2, MAX_ENQUEUE_TRY])
def test_try_numbers_within_bounds_are_accepted(t: int) -> None:
    assert deserialize_job(serialize_job(job(t=t)))["t"] == t


# (case, job payload, text the reason must contain)
BAD_ENVELOPES: list[tuple[str, bytes, str]] = [
    ("try number as a string", serialize_job(job(t="1")), "at `$.t`"),
    ("try number missing", serialize_job(job(t=...)), "missing required field `t`"),
    ("try number zero", serialize_job(job(t=0)), "`t` (the try number) must be 1"),
    ("try number negative", serialize_job(job(t=-1)), "`t` (the try number) must be 1"),
    ("try number 10**30", serialize_job(job(t=10**30)), "`t` (the try number) must be 1"),
    ("try number above the bound", serialize_job(job(t=MAX_ENQUEUE_TRY + 1)), "`t` (the try number) must be 1"),
    ("try number a bool", serialize_job(job(t=True)), "got `bool` - at `$.t`"),
    ("try number a float", serialize_job(job(t=1.0)), "got `float` - at `$.t`"),
    ("try number an object", serialize_job(job(t={"n": 1})), "at `$.t`"),
    ("enqueue time in microseconds", serialize_job(job(et=NOW_MS * 1000)), "`et` (the enqueue time)"),
    ("enqueue time in seconds", serialize_job(job(et=NOW_MS // 1000)), "`et` (the enqueue time)"),
    ("enqueue time a string", serialize_job(job(et=str(NOW_MS))), "got `str` - at `$.et`"),
    ("enqueue time negative", serialize_job(job(et=-NOW_MS)), "`et` (the enqueue time)"),
    ("enqueue time 10**30", serialize_job(job(et=10**30)), "`et` (the enqueue time)"),
    ("enqueue time a float", serialize_job(job(et=float(NOW_MS))), "got `float` - at `$.et`"),
    ("enqueue time null", serialize_job(job(et=None)), "got `null` - at `$.et`"),
    ("enqueue time missing", serialize_job(job(et=...)), "missing required field `et`"),
    ("enqueue time before 2000", serialize_job(job(et=EARLIEST_ENQUEUE_MS - 1)), "`et` (the enqueue time)"),
    ("enqueue time a week ahead", serialize_job(job(et=NOW_MS + 7 * MAX_ENQUEUE_AHEAD_MS)), "`et`"),
    ("enqueue time NaN", json.dumps(job(et=float("nan"))).encode(), "not valid JSON"),
    ("enqueue time infinite", json.dumps(job(et=float("inf"))).encode(), "not valid JSON"),
    ("enqueue time 1e400", serialize_job(job()).replace(str(NOW_MS).encode(), b"1e400"), "out of range"),
    ("keywords a list", serialize_job(job(k=[])), "got `array` - at `$.k`"),
    ("keywords null", serialize_job(job(k=None)), "at `$.k`"),
    ("keyword named ctx", serialize_job(job(k={"ctx": 1})), "no keywords"),
    ("keyword of any name", serialize_job(job(k={"extra": 1})), "no keywords"),
    ("bad-payload marker not a string", serialize_job(job(k={BAD_PAYLOAD_MARKER: 1})), "no keywords"),
    ("bad-payload marker with a keyword", serialize_job(job(k={BAD_PAYLOAD_MARKER: "x", "y": 1})), "no keywords"),
    ("arguments an object", serialize_job(job(a={"x": 1})), "at `$.a`"),
    ("arguments null", serialize_job(job(a=None)), "at `$.a`"),
    ("arguments missing", serialize_job(job(a=...)), "missing required field `a`"),
    ("arguments nested too deep", with_args(nested(MAX_ARGS_DEPTH + 2)), "nests deeper"),
    ("arguments nested past the recursion limit", with_args(nested(5000)), "nests too deeply"),
    ("function not a string", serialize_job(job(f=["generate"])), "at `$.f`"),
    ("function missing", serialize_job(job(f=...)), "missing required field `f`"),
    ("function unknown", serialize_job(job(f="os.system")), "unknown job function 'os.system'"),
    ("function name 8 MB", serialize_job(job(f="x" * 7_000_000)), "unknown job function"),
    ("JSON null", b"null", "JSON object"),
    ("JSON string", b'"generate"', "JSON object"),
    ("JSON number", b"1", "JSON object"),
    ("empty", b"", "not valid JSON"),
    ("truncated", serialize_job(job())[:-1], "not valid JSON"),
    ("trailing garbage", serialize_job(job()) + b"x", "not valid JSON"),
    ("lone surrogate", serialize_job(job(f="\\ud800")).replace(b"\\\\ud800", b"\\ud800"), "not valid JSON"),
    ("invalid UTF-8", serialize_job(job(f="gen\xe9rate")).replace("\xe9".encode(), b"\xe9"), "not valid JSON"),
    ("pickle", b"\x80\x04\x95\x00", "not valid JSON"),
    ("over the size limit", b'"' + b"x" * 8_000_001 + b'"', "bytes; the limit"),
]


@pytest.mark.parametrize(("case", "payload", "reason"), BAD_ENVELOPES, ids=[c[0] for c in BAD_ENVELOPES])
def test_malformed_envelopes_become_the_job_that_reports_them(case: str, payload: bytes, reason: str) -> None:
    synthetic = deserialize_job(payload)
    assert reason in synthetic["k"][BAD_PAYLOAD_MARKER]
    assert synthetic["f"] == JOB_FUNCTION and synthetic["a"] == [] and synthetic["t"] == 1
    assert len(synthetic["k"][BAD_PAYLOAD_MARKER]) <= 2000
    run_like_arq(payload)


def test_the_reporting_job_is_itself_a_valid_job() -> None:
    synthetic = deserialize_job(b"not json")
    assert deserialize_job(serialize_job(synthetic)) == synthetic


def test_arq_results_stay_readable() -> None:
    # arq reads a finished job's result through the same deserializer.
    for job_fields in (job(), job(f="<unknown>", a=[], et=0)):  # the second: arq's result of an expired job
        stored = failed_result(job_fields["f"], job_fields["a"], {}, 2, job_fields["et"])
        result = deserialize_result(stored, deserializer=deserialize_job)
        assert result.success is False and result.result == {"error": "ValueError", "message": "bad"}
        assert result.finish_time == ms_to_datetime(NOW_MS + 5)


def fuzz_payloads(seed: int, count: int) -> Iterator[bytes]:
    """Random bytes, random edits of a valid job, and jobs whose fields take awkward values."""
    rng = random.Random(seed)
    valid = serialize_job(job())
    awkward: list[Any] = [None, True, False, 0, 1, -1, 2, MAX_ENQUEUE_TRY + 1, 2**63, 2**64, 10**30, -(10**30)]
    awkward += [1.5, 1e308, -0.0, float("nan"), float("inf"), "", "1", JOB_FUNCTION, "ctx", [], {}, [1]]
    awkward += [[REQUEST, REQUEST], {"ctx": 1}, {BAD_PAYLOAD_MARKER: 1}, {BAD_PAYLOAD_MARKER: "x"}]
    awkward += [NOW_MS, NOW_MS * 1000, NOW_MS // 1000, EARLIEST_ENQUEUE_MS - 1]
    for _ in range(count):
        kind = rng.randrange(4)
        if kind == 0:
            yield rng.randbytes(rng.randrange(40))
        elif kind == 1:
            data = bytearray(valid)
            for _ in range(rng.randint(1, 4)):
                at = rng.randrange(len(data))
                edit = rng.randrange(3)
                if edit == 0:
                    data[at] = rng.randrange(256)
                elif edit == 1:
                    data.insert(at, rng.choice(b'{}[]",:0123456789-.eE \\nult'))
                else:
                    del data[at : at + rng.randint(1, 8)]
            yield bytes(data)
        elif kind == 2:
            fields: dict[str, Any] = job()
            for name in rng.sample(["t", "f", "a", "k", "et", "s", "x"], rng.randint(1, 3)):
                if rng.random() < 0.2:
                    fields.pop(name, None)
                else:
                    fields[name] = rng.choice(awkward)
            yield json.dumps(fields).encode()
        else:
            yield with_args(nested(rng.choice([MAX_ARGS_DEPTH - 2, MAX_ARGS_DEPTH + 2, 900, 990, 1010, 3000])))


def test_arq_can_run_whatever_bytes_a_job_key_holds() -> None:
    for payload in fuzz_payloads(seed=20261130, count=4000):
        try:
            run_like_arq(payload)
        except Exception as exc:
            raise AssertionError(f"arq cannot run {payload[:200]!r}") from exc
