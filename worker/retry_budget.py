"""How long a request's events may keep failing to reach Redis: one clock per request.

A request's events go to Redis through the flusher (its chunks) and, where its end waits
for replicas, the end confirmer (its end). Either may find Redis away (a restart, a
failover) or refusing for a moment (``OOM``, ``READONLY``); both send again. The clock
starts at the request's first failure, wherever it happened, and stops at its next
success: past ``retry_for_s`` of failing, its events are given up and its waiters fail
(``PublishFailed``: its job hands the request back, to be taken over from the log).
"""

from __future__ import annotations

import time
from collections.abc import Iterable


class RetryBudgets:
    """The failing clocks of the requests whose events did not reach Redis yet."""

    def __init__(self, retry_for_s: float) -> None:
        self.retry_for_s = retry_for_s
        self._since: dict[str, float] = {}
        """Request id -> when its events first failed (monotonic), since its last success."""

    def reached(self, request_ids: Iterable[str]) -> None:
        """These requests' events reached Redis: their clocks stop."""
        for request_id in request_ids:
            self._since.pop(request_id, None)

    def failed(self, request_ids: Iterable[str]) -> set[str]:
        """These requests' events failed again: the ones whose budget is now spent (their
        clocks are dropped: the caller gives their events up)."""
        now = time.monotonic()
        spent = set()
        for request_id in set(request_ids):
            since = self._since.setdefault(request_id, now)
            if now - since >= self.retry_for_s:
                spent.add(request_id)
                del self._since[request_id]
        return spent

    def spent(self) -> set[str]:
        """The requests whose budget is spent by now (their clocks are dropped)."""
        now = time.monotonic()
        gone = {request_id for request_id, since in self._since.items() if now - since >= self.retry_for_s}
        for request_id in gone:
            del self._since[request_id]
        return gone
