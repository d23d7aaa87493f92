"""One warning for a failure that repeats at every period of a loop (Redis away, or full
and refusing writes), instead of one a second: the first of an episode at WARNING, its
repeats at DEBUG, and a line once it passes."""

from __future__ import annotations

import logging
import time


class RepeatedFailure:
    """The log of one loop's failures (``what`` names the work: ``renewing leases``)."""

    def __init__(self, logger: logging.Logger, what: str) -> None:
        self._logger = logger
        self._what = what
        self._failures = 0
        self._since = 0.0

    def failed(self, message: str, *args: object) -> None:
        """The loop failed again: said at WARNING the first time of an episode."""
        if self._failures == 0:
            self._since = time.monotonic()
            self._logger.warning(message + " (said once until it passes)", *args)
        else:
            self._logger.debug(message, *args)
        self._failures += 1

    def passed(self) -> None:
        """The loop's work went through: the episode, if any, ends with a line."""
        if self._failures:
            self._logger.warning(
                "%s works again after %d failures in %.1fs", self._what, self._failures, time.monotonic() - self._since
            )
            self._failures = 0
