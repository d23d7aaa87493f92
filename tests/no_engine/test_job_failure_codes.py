"""How a job arq finished as failed maps to the error code its requester sees."""

from __future__ import annotations

import pytest

from streamq.broker.job_result import failure_of
from streamq.protocol import ErrorCode, serialize_job


def _failed(error: str, message: str) -> bytes:
    return serialize_job({"s": False, "r": {"error": error, "message": message}, "t": 1})


@pytest.mark.parametrize(
    ("result", "code"),
    [
        (_failed("TimeoutError", ""), ErrorCode.TIMEOUT),
        (_failed("JobExecutionFailed", "job expired"), ErrorCode.EXPIRED),
        (_failed("JobExecutionFailed", "max 5 retries exceeded"), ErrorCode.RETRIES_EXHAUSTED),
        (_failed("DeserializationError", "unable to deserialize job"), ErrorCode.INVALID_REQUEST),
        (_failed("SerializationError", "unable to serialize result"), ErrorCode.INVALID_REQUEST),
        (_failed("PublishFailed", "Redis refused 3 events"), ErrorCode.PUBLISH_FAILED),
        (_failed("RequestFailed", "worker_lost: the worker died"), ErrorCode.WORKER_LOST),
        (_failed("RequestFailed", "no_such_code: what"), ErrorCode.INTERNAL),
        (_failed("KeyError", "'x'"), ErrorCode.INTERNAL),
        (None, ErrorCode.INTERNAL),
        (b"not json", ErrorCode.INTERNAL),
    ],
)
def test_a_failed_job_maps_to_its_error_code(result: bytes | None, code: ErrorCode) -> None:
    assert failure_of(result)[0] == code


def test_a_successful_job_needs_no_error_event() -> None:
    assert failure_of(serialize_job({"s": True, "r": {"request_id": "x"}})) == (None, "")


def test_a_failure_the_job_reported_keeps_its_own_message() -> None:
    assert failure_of(_failed("RequestFailed", "invalid_request: prompt too long")) == (
        ErrorCode.INVALID_REQUEST,
        "prompt too long",
    )


def test_an_unexpected_failure_names_the_exception() -> None:
    code, message = failure_of(_failed("KeyError", "'x'"))
    assert code == ErrorCode.INTERNAL and "KeyError" in message and "'x'" in message
