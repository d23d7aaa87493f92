"""Every way arq can end a job without the job function maps to the error code its request ends with."""

from __future__ import annotations

import pytest

from streamq.protocol import ErrorCode, serialize_job
from worker.failures import failure_of


def _failed(error: str, message: str) -> bytes:
    return serialize_job({"s": False, "r": {"error": error, "message": message}, "t": 1})


@pytest.mark.parametrize(
    ("result", "code"),
    [
        (_failed("TimeoutError", ""), ErrorCode.TIMEOUT),
        (_failed("JobExecutionFailed", "job expired"), ErrorCode.EXPIRED),
        (_failed("JobExecutionFailed", "max 5 retries exceeded"), ErrorCode.RETRIES_EXHAUSTED),
        (_failed("DeserializationError", "unable to deserialize job"), ErrorCode.INVALID_REQUEST),
        (_failed("PublishFailed", "Redis refused 3 events"), ErrorCode.PUBLISH_FAILED),
        (_failed("RequestFailed", "worker_lost: the worker died"), ErrorCode.WORKER_LOST),
        (_failed("KeyError", "'x'"), ErrorCode.INTERNAL),
        (None, ErrorCode.INTERNAL),
        (b"not json", ErrorCode.INTERNAL),
    ],
)
def test_a_failed_job_maps_to_its_error_code(result: bytes | None, code: ErrorCode) -> None:
    assert failure_of(result)[0] == code


def test_a_successful_job_needs_no_error_event() -> None:
    assert failure_of(serialize_job({"s": True, "r": {"request_id": "x"}})) == (None, "")
