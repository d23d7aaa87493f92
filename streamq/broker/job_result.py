"""arq's stored result of a job (`arq:result:<id>`): the error code its requester sees
when the job failed (the worker ends such a request with it, `status` reports it), and
which model and queue the job served (the dashboard's recent ends)."""

from __future__ import annotations

from typing import Any

import msgspec

from streamq.protocol import ErrorCode


class _JobOutcome(msgspec.Struct):
    """The part of arq's stored result that says how a job ended."""

    s: bool = False
    r: Any = None


class _JobRecord(msgspec.Struct):
    """The part of arq's stored result that says what the job ran: its arguments (the
    request) and its queue."""

    a: list[Any] = []
    q: str | None = None


def request_model_and_queue(result_data: bytes | None) -> tuple[str | None, str | None]:
    """The ``model`` of the request a job ran and the job's queue, from its stored result;
    ``None`` for what it does not hold (or an unreadable result)."""
    if result_data is None:
        return None, None
    try:
        record = msgspec.json.decode(result_data, type=_JobRecord)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None, None
    request = record.a[0] if record.a and isinstance(record.a[0], dict) else {}
    model = request.get("model")
    return (model if isinstance(model, str) else None), record.q


def failure_of(result_data: bytes | None) -> tuple[ErrorCode | None, str]:
    """The error code and message for a job that arq finished, from its stored result;
    ``None`` for a job that succeeded (its request has its final event already)."""
    if result_data is None:
        return ErrorCode.INTERNAL, "the job ended without a result"
    try:
        outcome = msgspec.json.decode(result_data, type=_JobOutcome)
    except msgspec.DecodeError:
        return ErrorCode.INTERNAL, "the job ended with an unreadable result"
    if outcome.s:
        return None, ""
    error = outcome.r if isinstance(outcome.r, dict) else {}
    kind, message = str(error.get("error", "")), str(error.get("message", outcome.r))
    if kind == "TimeoutError":
        return ErrorCode.TIMEOUT, "the job ran past the worker's limit per job (job_timeout)"
    if kind == "JobExecutionFailed" and message == "job expired":
        return ErrorCode.EXPIRED, "the job's payload was gone from Redis when a worker took it"
    if kind == "JobExecutionFailed" and "retries exceeded" in message:
        return ErrorCode.RETRIES_EXHAUSTED, f"every try of the job ended without an answer ({message})"
    if kind in ("SerializationError", "DeserializationError"):
        return ErrorCode.INVALID_REQUEST, f"the job's payload cannot be decoded: {message}"
    if kind == "RequestFailed":  # the job reported it; this only runs if that event was lost
        code, _, detail = message.partition(": ")
        known = {c.value for c in ErrorCode}
        return (ErrorCode(code) if code in known else ErrorCode.INTERNAL), detail
    if kind == "PublishFailed":
        return ErrorCode.PUBLISH_FAILED, message
    return ErrorCode.INTERNAL, f"{kind or 'failure'}: {message}"
