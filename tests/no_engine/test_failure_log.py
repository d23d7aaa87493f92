"""A loop's failure that repeats every period is said once an episode (``worker/failure_log.py``)."""

from __future__ import annotations

import logging

import pytest

from worker.failure_log import RepeatedFailure


def test_a_failure_repeating_each_period_is_warned_of_once_and_its_end_said(caplog: pytest.LogCaptureFixture) -> None:
    logger = logging.getLogger("test.failure_log")
    failures = RepeatedFailure(logger, "renewing leases")
    with caplog.at_level(logging.INFO, logger="test.failure_log"):
        for _ in range(5):
            failures.failed("could not renew %d leases: %s", 3, "OOM")
        failures.passed()
        failures.passed()
        failures.failed("could not renew %d leases: %s", 1, "OOM")
    warnings = [record.getMessage() for record in caplog.records if record.levelno == logging.WARNING]
    assert warnings[0] == "could not renew 3 leases: OOM (said once until it passes)"
    assert warnings[1].startswith("renewing leases works again after 5 failures in ")
    assert warnings[2] == "could not renew 1 leases: OOM (said once until it passes)"
    assert len(warnings) == 3
