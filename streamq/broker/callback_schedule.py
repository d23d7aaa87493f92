"""Making a request's callback due once it ended (``schedule_callback.lua``), from any end
path: the worker that ended it, one ending a job arq failed, a producer cancelling a queued
request. The callback keys are the control plane's; the owner key that says the request
ended is read in the same script on one Redis, and just before it on a Redis Cluster."""

from __future__ import annotations

from redis.asyncio import Redis

from streamq.broker.data_plane import OwnerRead
from streamq.protocol import CALLBACKS_KEY, callback_key
from streamq.protocol.script_calls import ScheduleCallback
from streamq.protocol.scripts import Script


class CallbackSchedule:
    """``schedule_callback`` for requests whose owner keys ``owners`` reads."""

    def __init__(self, control: Redis, owners: OwnerRead, ttl_ms: int) -> None:
        """``ttl_ms``: how long the delivery's record is kept (the replay log's TTL)."""
        self._script = Script(control, ScheduleCallback)
        self._owners = owners
        self._ttl_ms = ttl_ms

    async def __call__(self, request_id: str, spec: bytes = b"") -> bool:
        """Make ``request_id``'s callback due now, once, if it ended: ``spec`` (its callback
        as JSON), else the one stored at enqueue. True when this call scheduled it."""
        ahead = self._owners.ahead
        call = ScheduleCallback(
            callbacks_key=CALLBACKS_KEY,
            callback_key=callback_key(request_id),
            owner_key=None if ahead else self._owners.names.owner(request_id),
            request_id=request_id,
            callback=spec,
            ttl_ms=self._ttl_ms,
            owner=(await self._owners.values([request_id]))[0] if ahead else None,
        )
        return bool(await self._script(call))
