"""The ``arq:`` names of the contract are arq's own: an arq release that renames them
must fail here, not in production."""

from __future__ import annotations

from arq import constants

from streamq.protocol import (
    ABORT_KEY,
    HEALTH_CHECK_SUFFIX,
    IN_PROGRESS_PREFIX,
    JOB_EXPIRY_MS,
    JOB_KEY_PREFIX,
    RESULT_KEY_PREFIX,
    RETRY_KEY_PREFIX,
)


def test_arq_key_names_match_the_installed_arq() -> None:
    assert constants.job_key_prefix == JOB_KEY_PREFIX
    assert constants.result_key_prefix == RESULT_KEY_PREFIX
    assert constants.in_progress_key_prefix == IN_PROGRESS_PREFIX
    assert constants.retry_key_prefix == RETRY_KEY_PREFIX
    assert constants.health_check_key_suffix == HEALTH_CHECK_SUFFIX
    assert constants.abort_jobs_ss == ABORT_KEY


def test_jobs_expire_after_arqs_default() -> None:
    assert constants.expires_extra_ms == JOB_EXPIRY_MS
