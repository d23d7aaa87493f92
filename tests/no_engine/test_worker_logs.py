"""arq's log of a failed job drops the traceback of a failure the job reported itself."""

from __future__ import annotations

import logging
import warnings

import pytest

with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)  # torch's own, raised while vLLM imports
    from worker.job import RequestFailed
    from worker.logs import QuietRequestFailures, quiet_request_failures


def _failure_logged(caplog: pytest.LogCaptureFixture, exc: Exception) -> logging.LogRecord:
    try:
        raise exc
    except Exception:
        logging.getLogger("arq.worker").exception("job failed")
    return caplog.records[-1]


def test_only_reported_failures_lose_their_traceback(caplog: pytest.LogCaptureFixture) -> None:
    quiet_request_failures()
    assert _failure_logged(caplog, RequestFailed("invalid_request: bad")).exc_info is None
    assert _failure_logged(caplog, KeyError("x")).exc_info is not None


def test_the_filter_is_installed_once() -> None:
    quiet_request_failures()
    quiet_request_failures()
    filters = logging.getLogger("arq.worker").filters
    assert sum(isinstance(f, QuietRequestFailures) for f in filters) == 1
