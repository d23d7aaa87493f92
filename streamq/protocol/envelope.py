"""The arq job envelope: how a job is stored in ``arq:job:<id>`` (JSON, never pickle:
a pickled job in Redis would be code execution on every worker), and the checks that
keep a malformed one from killing arq's poll loop."""

from __future__ import annotations

import time
from typing import Any, Final

import msgspec

from streamq.protocol.names import JOB_FUNCTION, MAX_JOB_BYTES

_json_encoder = msgspec.json.Encoder(enc_hook=lambda obj: _encode_fallback(obj))


def _encode_fallback(obj: Any) -> Any:
    """arq stores exceptions as failed-job results; JSON gets their type and message."""
    if isinstance(obj, BaseException):
        return {"error": type(obj).__name__, "message": str(obj)}
    if isinstance(obj, (set, frozenset, tuple)):
        return list(obj)
    raise TypeError(f"cannot encode {type(obj).__name__} as JSON")


def serialize_job(data: Any) -> bytes:
    """arq ``job_serializer``: JSON instead of arq's default pickle."""
    return _json_encoder.encode(data)


BAD_PAYLOAD_MARKER: Final = "__streamq_bad_payload__"
"""Keyword argument of the synthetic job that ``deserialize_job`` makes from a
payload that is not a valid arq job, so the job function can report it."""
MAX_ENQUEUE_TRY: Final = 1000
"""Largest try number (``t``) a job payload may carry; a fresh job carries 1."""
EARLIEST_ENQUEUE_MS: Final = 946_684_800_000
"""2000-01-01T00:00:00Z in Unix ms: an earlier ``et`` is seconds, or garbage."""
MAX_ENQUEUE_AHEAD_MS: Final = 86_400_000
"""How far past the worker's clock ``et`` may lie (clock skew, with room to spare)."""
MAX_ARGS_DEPTH: Final = 32
"""Nesting levels allowed in a job's arguments; a request needs 3. Deeper JSON makes
``repr`` (arq logs every job's arguments) hit Python's recursion limit."""
_RESULT_FIELDS: Final = ("s", "r", "st", "ft", "q", "id")
"""Fields arq adds to a job's own when it stores the result; arq reads results
through the job deserializer too."""


class _JobEnvelope(msgspec.Struct):
    """The arq fields of a job payload, each of a type and range arq's ``run_job`` can
    use outside its error handling: any other value there would kill the worker's poll
    loop. Other fields are ignored."""

    t: int | None
    """``None`` is arq's own ``enqueue_job``'s way of saying 1."""
    f: str
    a: list[Any]
    k: dict[str, Any]
    et: int

    def __post_init__(self) -> None:
        if self.t is not None and not 1 <= self.t <= MAX_ENQUEUE_TRY:
            raise ValueError(f"`t` (the try number) must be 1 to {MAX_ENQUEUE_TRY}, got {_shorten(self.t)}")
        latest = int(time.time() * 1000) + MAX_ENQUEUE_AHEAD_MS
        if not EARLIEST_ENQUEUE_MS <= self.et <= latest:
            raise ValueError(
                f"`et` (the enqueue time) must be Unix milliseconds from 2000-01-01 to a day "
                f"from now, got {_shorten(self.et)}"
            )
        if self.f != JOB_FUNCTION:
            raise ValueError(f"unknown job function {_shorten(self.f)}; use {JOB_FUNCTION!r}")
        if self.k and not (self.k.keys() == {BAD_PAYLOAD_MARKER} and isinstance(self.k[BAD_PAYLOAD_MARKER], str)):
            raise ValueError("`k` must be {}: a job takes exactly one positional argument and no keywords")
        if _nests_deeper(self.a, MAX_ARGS_DEPTH):
            raise ValueError(f"`a` nests deeper than {MAX_ARGS_DEPTH} levels")


def deserialize_job(data: bytes) -> Any:
    """arq ``job_deserializer``: a JSON object whose arq fields arq can use, always.

    arq only logs a job it cannot decode (the requester would wait forever), and
    fields of the wrong type or range raise outside its error handling, killing the
    worker (and then each worker that claims the job next). So a payload that is not
    a valid job (``_JobEnvelope``) becomes a call of the job function carrying the
    reason, which publishes an ``invalid_request`` error on the channel of the job id
    (the request id), and arq records the job as failed. The upper bound of ``et`` is
    read from the reading host's clock when the job is read; nothing else here depends on
    time. Never raises.
    """
    if len(data) > MAX_JOB_BYTES:
        return _bad_payload_job(f"job payload is {len(data)} bytes; the limit is {MAX_JOB_BYTES}")
    try:
        decoded = msgspec.json.decode(data)
    except msgspec.DecodeError as exc:
        return _bad_payload_job(f"job payload is not valid JSON: {exc}")
    except RecursionError:
        return _bad_payload_job("job payload is not valid JSON: it nests too deeply")
    if not isinstance(decoded, dict):
        return _bad_payload_job("job payload must be a JSON object")
    try:
        msgspec.convert(decoded, _JobEnvelope)
    except msgspec.ValidationError as exc:
        result_fields = {name: decoded[name] for name in _RESULT_FIELDS if name in decoded}
        return {**result_fields, **_bad_payload_job(f"job payload is not a valid arq job: {exc}")}
    return decoded


def _bad_payload_job(reason: str) -> dict[str, Any]:
    """A job that passes ``_JobEnvelope`` and makes the job function report ``reason``."""
    return {
        "t": 1,
        "f": JOB_FUNCTION,
        "a": [],
        "k": {BAD_PAYLOAD_MARKER: reason[:2000]},
        "et": int(time.time() * 1000),
    }


def _nests_deeper(value: object, limit: int) -> bool:
    """Whether ``value`` has lists or dicts nested more than ``limit`` levels (iterative:
    the point is to stay clear of the recursion limit)."""
    level: list[Any] = [value]
    for _ in range(limit):
        level = [
            child
            for container in level
            for child in (container if type(container) is list else container.values())
            if type(child) in (list, dict)
        ]
        if not level:
            return False
    return True


def _shorten(value: object) -> str:
    """``repr(value)``, cut short: job payloads are up to 8 MB."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
