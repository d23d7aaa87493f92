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
from dataclasses import dataclass
from typing import Final

from redis.asyncio import Redis

from producer.protocol import EVENTS_CHANNEL_PREFIX, events_channel

LOG_MAXLEN: Final = 100_000
"""Entries kept per request (approximately: trimming is lazy). A request has one
entry per DELTA chunk plus its final event."""
LOG_TTL_MS: Final = 3_600_000
"""How long a request's log outlives its last event."""

OWNER_KEY_PREFIX: Final = "streamq:owner:"
"""``streamq:owner:<request_id>``: the newest attempt that wrote to (or took over) the log."""

_APPEND_AND_PUBLISH = """
-- KEYS: per event, its log/channel name and its owner key. ARGV: maxlen, ttl_ms, then
-- per event its entry id, attempt (0: not fenced) and payload. An event is skipped when
-- its sequence number is already logged, or when a newer attempt owns the request (a
-- worker that lost its lease but still runs must not write over the one that took
-- over). Returns how many were skipped, then the request ids (their log keys) whose
-- events were dropped because a newer attempt owns them, each once.
local maxlen, ttl = ARGV[1], ARGV[2]
local skipped, touched, owners, superseded = 0, {}, {}, {}
for i = 1, #KEYS, 2 do
  local key, owner_key = KEYS[i], KEYS[i + 1]
  local base = 3 * (i - 1) / 2 + 2
  local id, attempt, payload = ARGV[base + 1], tonumber(ARGV[base + 2]), ARGV[base + 3]
  if attempt > 0 and owners[owner_key] == nil then
    owners[owner_key] = tonumber(redis.call('GET', owner_key) or '0')
  end
  if attempt > 0 and attempt < owners[owner_key] then
    skipped = skipped + 1
    superseded[key] = true
  else
    local added = redis.pcall('XADD', key, 'MAXLEN', '~', maxlen, id, 'event', payload)
    if type(added) == 'table' and added.err then
      skipped = skipped + 1
    else
      redis.call('PUBLISH', key, payload)
      touched[key] = true
      if attempt > 0 and attempt > owners[owner_key] then
        owners[owner_key] = attempt
        redis.call('SET', owner_key, attempt, 'PX', ttl)
      end
    end
  end
end
for key in pairs(touched) do
  redis.call('PEXPIRE', key, ttl)
end
local reply = {skipped}
for key in pairs(superseded) do
  reply[#reply + 1] = key
end
return reply
"""

_TAKE_OVER = """
-- KEYS: the log, the owner key. ARGV: attempt, ttl_ms. Makes ``attempt`` the owner
-- (fencing off older ones) and returns the log as it is at that moment.
local owner = tonumber(redis.call('GET', KEYS[2]) or '0')
if tonumber(ARGV[1]) > owner then
  redis.call('SET', KEYS[2], ARGV[1], 'PX', ARGV[2])
end
return redis.call('XRANGE', KEYS[1], '-', '+')
"""


@dataclass(frozen=True)
class Appended:
    """What became of a batch given to ``ReplayLog.append``."""

    skipped: int
    """Events not logged: already there, or from a superseded attempt."""
    superseded: frozenset[str]
    """Requests whose events were dropped because a newer attempt owns them: the
    attempt that sent them should stop (another worker has taken the request over)."""


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
        self._take_over_script = redis.register_script(_TAKE_OVER)

    async def append(self, events: Sequence[tuple[str, int, int, bytes]]) -> Appended:
        """Log and publish ``(request_id, seq, attempt, payload)`` events, in order, in
        one command. ``attempt`` 0 is never fenced off (a producer's own event)."""
        keys: list[str] = []
        args: list[str | int | bytes] = [self._maxlen, self._ttl_ms]
        for request_id, seq, attempt, payload in events:
            keys += [events_channel(request_id), OWNER_KEY_PREFIX + request_id]
            args += [entry_id(seq), attempt, payload]
        skipped, *superseded = await self._append_script(keys=keys, args=args)
        prefix = len(EVENTS_CHANNEL_PREFIX)
        keys_out = (key.decode() if isinstance(key, bytes) else key for key in superseded)
        return Appended(int(skipped), frozenset(key[prefix:] for key in keys_out))

    async def take_over(self, request_id: str, attempt: int) -> list[bytes]:
        """Make ``attempt`` the request's owner, so that older attempts still running
        can no longer write, and return everything logged so far."""
        keys = [events_channel(request_id), OWNER_KEY_PREFIX + request_id]
        entries = await self._take_over_script(keys=keys, args=[attempt, self._ttl_ms])
        return [_field(fields, b"event") for _, fields in entries]

    async def read(self, request_id: str, from_seq: int = 0) -> list[bytes]:
        """The logged events of ``request_id`` with ``seq >= from_seq``, in order."""
        entries = await self._redis.xrange(events_channel(request_id), min=entry_id(from_seq), max="+")
        return [fields[b"event"] for _, fields in entries]

    async def last(self, request_id: str) -> bytes | None:
        """The newest logged event of ``request_id``, or ``None`` when nothing is logged."""
        entries = await self._redis.xrevrange(events_channel(request_id), count=1)
        return entries[0][1][b"event"] if entries else None


def _field(flat: list[bytes], name: bytes) -> bytes:
    """A field of a stream entry as a Lua script returns it: [name, value, ...]."""
    return flat[flat.index(name) + 1]
