"""The engine's request slots, shared by the front ends that feed one engine core.

Several front-end processes (``python -m worker --front-ends N``) claim jobs for one
engine; together they must never hold more running requests than it schedules at once,
yet an idle front end must take work while a busy one is full. So no front end has a
fixed share: each takes slots from one counter in shared memory as it claims, and gives
them back as its requests end.

The counter is a POSIX semaphore (``multiprocessing.BoundedSemaphore``): taking and giving
are atomic across processes without a lock a killed process could leave held. Beside it
each front end writes how many slots it holds, so that the process that started them can
give back the slots of one that died.
"""

from __future__ import annotations

import math
import multiprocessing
from typing import Any


class SharedSlots:
    """``limit`` slots shared by ``front_ends`` processes; picklable into spawned children."""

    def __init__(self, limit: int, front_ends: int) -> None:
        if limit < 1:
            raise ValueError(f"the engine must run at least one request at once, not {limit}")
        context = multiprocessing.get_context("spawn")
        self.limit = limit
        self._free: Any = context.BoundedSemaphore(limit)
        self._held: list[Any] = [context.RawValue("q", 0) for _ in range(front_ends)]
        self._live: list[Any] = [context.RawValue("b", 1) for _ in range(front_ends)]
        self._short: Any = context.RawValue("b", 0)
        """Set when a front end got fewer slots than it had room for: jobs may be waiting."""

    def fair_batch(self, front_end: int) -> int:
        """How many jobs ``front_end`` should claim now to stay level with its live siblings:
        one more than it lags behind their average, at least one."""
        siblings: list[int] = [
            held.value for i, held in enumerate(self._held) if i != front_end and self._live[i].value
        ]
        if not siblings:
            return self.limit
        return max(1, math.ceil(sum(siblings) / len(siblings)) + 1 - int(self._held[front_end].value))

    def take(self, front_end: int, wanted: int) -> int:
        """Take up to ``wanted`` free slots for ``front_end`` without waiting; how many it got."""
        got = 0
        while got < wanted and self._free.acquire(block=False):
            got += 1
        self._held[front_end].value += got
        if got < wanted:
            self._short.value = 1
        return got

    def give(self, front_end: int, count: int = 1) -> bool:
        """Give back ``count`` slots ``front_end`` took. True when some front end went short
        of slots since the last give: the caller should claim again (jobs may be waiting)."""
        count = min(count, self._held[front_end].value)
        self._held[front_end].value -= count
        for _ in range(count):
            self._free.release()
        went_short = bool(self._short.value)
        if went_short and count:
            self._short.value = 0
        return went_short and count > 0

    def free(self) -> int:
        """The slots no front end holds now (a snapshot: siblings take and give meanwhile)."""
        return max(0, self.limit - sum(int(held.value) for held in self._held))

    def held(self, front_end: int) -> int:
        """The slots ``front_end`` holds (its running requests and its claim in flight)."""
        return int(self._held[front_end].value)

    def give_back_all_of(self, front_end: int) -> int:
        """Give back every slot a dead ``front_end`` held, and leave it out of the balance;
        how many. Only its parent, once it is gone, may call this: the count is written by
        the front end alone."""
        self._live[front_end].value = 0
        count = self.held(front_end)
        self.give(front_end, count)
        return count
