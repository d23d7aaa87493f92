"""A replay log that holds each batch in flight until the test lets it through."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import redis.asyncio as aioredis

from streamq.broker.replay_log import Appended, LogEvent, ReplayLog


class GatedLog(ReplayLog):
    """A replay log whose appends wait until ``gate`` is set (a Redis that is slow to answer)."""

    def __init__(self, redis: aioredis.Redis) -> None:
        super().__init__(redis)
        self.gate = asyncio.Event()
        self.entered = asyncio.Event()
        self.batches: list[list[LogEvent]] = []

    async def append(self, events: Sequence[LogEvent]) -> Appended:
        self.batches.append(list(events))
        self.entered.set()
        await self.gate.wait()
        return await super().append(events)

    async def in_flight(self) -> None:
        """Wait until a batch is on its way (and held at the gate)."""
        await self.entered.wait()
        self.entered.clear()
