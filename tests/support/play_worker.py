"""A request's events written as a worker writes them, for tests that need no worker."""

from __future__ import annotations

import redis.asyncio as aioredis

from streamq.broker.replay_log import LogEvent, ReplayLog
from streamq.protocol import ChunkEvent, FinalEvent, encode_event, events_channel


async def play_worker(redis: aioredis.Redis, request_id: str, *texts: str, final: bool = True) -> None:
    """Log (and publish) chunks of ``texts``, then a final event: what a worker writes."""
    log = ReplayLog(redis)
    seq = len(await redis.xrange(events_channel(request_id)))
    events: list[LogEvent] = []
    for text in texts:
        chunk = ChunkEvent(request_id=request_id, seq=seq, attempt=1, text=text, token_ids=[seq])
        events.append(LogEvent(request_id, seq, 1, encode_event(chunk)))
        seq += 1
    if final:
        end = FinalEvent(
            request_id=request_id, seq=seq, attempt=1, finish_reasons=["stop"], prompt_tokens=2, completion_tokens=seq
        )
        events.append(LogEvent(request_id, seq, 1, encode_event(end), terminal=True))
    await log.append(events)
