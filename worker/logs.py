"""The worker's log filters, installed by the start-up hook (never at import)."""

from __future__ import annotations

import logging

from worker.job import RequestFailed


class QuietRequestFailures(logging.Filter):
    """A request that failed for a known reason is logged in one line by the job
    (and its error event tells the requester); arq's traceback would only add noise."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and isinstance(record.exc_info[1], RequestFailed):
            record.exc_info = None
        return True


def quiet_request_failures() -> None:
    """Drop the traceback arq logs for a ``RequestFailed`` job (once per process)."""
    arq_logger = logging.getLogger("arq.worker")
    if not any(isinstance(f, QuietRequestFailures) for f in arq_logger.filters):
        arq_logger.addFilter(QuietRequestFailures())
