"""The replay log: each request's events kept in a Redis Stream beside its channel.

Pub/sub keeps nothing, so a subscriber that arrives late or reconnects would miss
events, and a worker that takes over a crashed request would not know what was
already sent. Every event therefore also goes to a Stream with the same name as the
channel (``streamq:events:<request_id>``), bounded in length and with a TTL. Entry
ids are ``0-<seq + 1>``, so any client can read from any sequence number with
``XRANGE streamq:events:<id> 0-<seq + 1> +``.

Appending and publishing happen in one Lua script per batch of events, for three
reasons: one command carries a whole batch (one round trip, little Python per
event); the log is written before the channel, so anything a subscriber saw can
be replayed; and an event whose sequence number is already logged (a retried batch,
or a second worker on the same request) is neither logged nor published twice.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

from redis.asyncio import Redis

from producer.protocol import events_channel

LOG_MAXLEN: Final = 100_000
"""Entries kept per request (approximately: trimming is lazy). A request has one
entry per DELTA chunk plus its final event."""
LOG_TTL_MS: Final = 3_600_000
"""How long a request's log outlives its last event."""

_APPEND_AND_PUBLISH = """
-- KEYS: the log/channel name of each event; ARGV: maxlen, ttl_ms, then entry id and
-- payload of each event, in the order of KEYS. Returns how many were already logged.
local maxlen, ttl = ARGV[1], ARGV[2]
local duplicates, touched = 0, {}
for i, key in ipairs(KEYS) do
  local id, payload = ARGV[2 * i + 1], ARGV[2 * i + 2]
  local added = redis.pcall('XADD', key, 'MAXLEN', '~', maxlen, id, 'event', payload)
  if type(added) == 'table' and added.err then
    duplicates = duplicates + 1
  else
    redis.call('PUBLISH', key, payload)
    touched[key] = true
  end
end
for key in pairs(touched) do
  redis.call('PEXPIRE', key, ttl)
end
return duplicates
"""


def entry_id(seq: int) -> str:
    """Stream entry id of the event with sequence number ``seq`` (ids must be > 0-0)."""
    return f"0-{seq + 1}"


class ReplayLog:
    """Appends events to request logs (publishing them too) and reads them back."""

    def __init__(self, redis: Redis, *, maxlen: int = LOG_MAXLEN, ttl_ms: int = LOG_TTL_MS) -> None:
        self._redis = redis
        self._maxlen = maxlen
        self._ttl_ms = ttl_ms
        self._append_script = redis.register_script(_APPEND_AND_PUBLISH)

    async def append(self, events: Sequence[tuple[str, int, bytes]]) -> int:
        """Log and publish ``(request_id, seq, payload)`` events, in order, in one
        command. Returns how many were skipped as already logged."""
        keys: list[str] = []
        args: list[str | int | bytes] = [self._maxlen, self._ttl_ms]
        for request_id, seq, payload in events:
            keys.append(events_channel(request_id))
            args += [entry_id(seq), payload]
        return int(await self._append_script(keys=keys, args=args))

    async def read(self, request_id: str, from_seq: int = 0) -> list[bytes]:
        """The logged events of ``request_id`` with ``seq >= from_seq``, in order."""
        entries = await self._redis.xrange(events_channel(request_id), min=entry_id(from_seq), max="+")
        return [fields[b"event"] for _, fields in entries]
