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

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from redis.asyncio import Redis

from streamq.protocol import (
    EVENTS_CHANNEL_PREFIX,
    LOG_MAXLEN,
    LOG_MAXLEN_ENV,
    LOG_TTL_ENV,
    LOG_TTL_MS,
    OWNER_KEY_PREFIX,
    ErrorEvent,
    FinalEvent,
    encode_event,
    events_channel,
)


def log_limits_from_env(environ: Mapping[str, str] = os.environ) -> tuple[int, int]:
    """``(maxlen, ttl_ms)`` from ``$STREAMQ_LOG_MAXLEN`` and ``$STREAMQ_LOG_TTL_S`` (seconds),
    else the protocol's defaults: the one place they are read, by workers and producers alike
    (a producer ends queued requests it cancels in the same log)."""
    maxlen = int(environ.get(LOG_MAXLEN_ENV) or LOG_MAXLEN)
    ttl_ms = round(float(environ.get(LOG_TTL_ENV) or LOG_TTL_MS / 1000) * 1000)
    if maxlen < 1 or ttl_ms < 1000:
        raise ValueError(f"${LOG_MAXLEN_ENV} must be >= 1 and ${LOG_TTL_ENV} >= 1, got {maxlen} and {ttl_ms / 1000:g}")
    return maxlen, ttl_ms


_APPEND_AND_PUBLISH = """
-- KEYS: per event, its log/channel name and its owner key. ARGV: maxlen, ttl_ms, then
-- per event its entry id, attempt (0: not fenced), 1 if it is terminal (final/error) else
-- 0, and payload. An event is skipped when its sequence number is already logged, when a
-- newer attempt owns the request (a worker that lost its lease but still runs must not
-- write over the one that took over), or when the request already ended. A terminal event
-- ends the request for everyone. Returns how many were skipped, then the request ids (their
-- log keys) whose events were refused because another attempt owns or ended it, each once.
-- Any error other than a duplicate id fails the whole call: the caller retries or fails
-- loudly, nothing is dropped in silence (events already written are skipped on retry).
local maxlen, ttl = ARGV[1], ARGV[2]
local skipped, touched, owners, superseded, last_seqs = 0, {}, {}, {}, {}
for i = 1, #KEYS, 2 do
  local key, owner_key = KEYS[i], KEYS[i + 1]
  local base = 4 * (i - 1) / 2 + 2
  local id, attempt, terminal, payload = ARGV[base + 1], tonumber(ARGV[base + 2]), ARGV[base + 3], ARGV[base + 4]
  if owners[owner_key] == nil then
    owners[owner_key] = redis.call('GET', owner_key) or '0'
  end
  local owner = owners[owner_key]
  if owner == 'ended' or (attempt > 0 and attempt < tonumber(owner)) then
    skipped = skipped + 1
    if last_seqs[key] == nil then
      local last = redis.call('XREVRANGE', key, '+', '-', 'COUNT', 1)
      last_seqs[key] = #last > 0 and tonumber(string.match(last[1][1], '%-(%d+)$')) or 0
    end
    if tonumber(string.match(id, '%-(%d+)$')) > last_seqs[key] then
      superseded[key] = true  -- a new event, not a retried one: its attempt must stop
    end
  else
    local added = redis.pcall('XADD', key, 'MAXLEN', '~', maxlen, id, 'event', payload)
    if type(added) == 'table' and added.err then
      if not string.find(added.err, 'equal or smaller', 1, true) then
        return redis.error_reply(added.err)
      end
      skipped = skipped + 1
    else
      redis.call('PUBLISH', key, payload)
      touched[key] = owner_key
      if terminal == '1' then
        owners[owner_key] = 'ended'
      elseif attempt > tonumber(owner) then
        owners[owner_key] = tostring(attempt)
      end
    end
  end
end
for key, owner_key in pairs(touched) do
  redis.call('PEXPIRE', key, ttl)
  redis.call('SET', owner_key, owners[owner_key], 'PX', ttl)
end
local reply = {skipped}
for key in pairs(superseded) do
  reply[#reply + 1] = key
end
return reply
"""

_TAKE_OVER = """
-- KEYS: the log, the owner key. ARGV: attempt, ttl_ms. Makes ``attempt`` the owner
-- (fencing off older ones) unless the request already ended, and returns the log as it
-- is at that moment.
local owner = redis.call('GET', KEYS[2]) or '0'
if owner ~= 'ended' and tonumber(ARGV[1]) > tonumber(owner) then
  redis.call('SET', KEYS[2], ARGV[1], 'PX', ARGV[2])
end
return redis.call('XRANGE', KEYS[1], '-', '+')
"""

_END = """
-- KEYS: the log, the owner key. ARGV: the terminal event as JSON without its seq,
-- maxlen, ttl_ms. Logs and publishes the event with the next sequence number (and, for
-- a final event, the completion tokens the log holds), unless the request already ended.
-- Returns the seq given, or -1 when it had already ended.
if redis.call('GET', KEYS[2]) == 'ended' then
  return -1
end
local last = redis.call('XREVRANGE', KEYS[1], '+', '-', 'COUNT', 1)
local seq = 0
if #last > 0 then
  seq = tonumber(string.match(last[1][1], '%-(%d+)$'))
end
local event = cjson.decode(ARGV[1])
event['seq'] = seq
if event['type'] == 'final' then
  -- Ended from outside the attempt that ran it: count the tokens its chunks carried.
  local tokens = 0
  for _, entry in ipairs(redis.call('XRANGE', KEYS[1], '-', '+')) do
    local ok, logged = pcall(cjson.decode, entry[2][2])
    if ok and type(logged) == 'table' and logged['type'] == 'chunk' and type(logged['token_ids']) == 'table' then
      tokens = tokens + #logged['token_ids']
    end
  end
  event['completion_tokens'] = tokens
end
local payload = cjson.encode(event)
redis.call('XADD', KEYS[1], 'MAXLEN', '~', ARGV[2], '0-' .. (seq + 1), 'event', payload)
redis.call('PUBLISH', KEYS[1], payload)
redis.call('PEXPIRE', KEYS[1], ARGV[3])
redis.call('SET', KEYS[2], 'ended', 'PX', ARGV[3])
return seq
"""


class LogEvent(NamedTuple):
    """One event for ``ReplayLog.append``: its request, number, writer and JSON."""

    request_id: str
    seq: int
    attempt: int
    """The attempt that produced it; 0 is never fenced off (a producer's own event)."""
    payload: bytes
    terminal: bool = False
    """A final or error event: once logged, the request accepts no more events."""


@dataclass(frozen=True)
class Appended:
    """What became of a batch given to ``ReplayLog.append``."""

    skipped: int
    """Events not logged: already there, from a superseded attempt, or after the end."""
    superseded: frozenset[str]
    """Requests whose new events were refused because another attempt owns the request,
    or because it already ended: the attempt that sent them should stop."""


def entry_id(seq: int) -> str:
    """Stream entry id of the event with sequence number ``seq`` (ids must be > 0-0)."""
    return f"0-{seq + 1}"


class ReplayLog:
    """Appends events to request logs (publishing them too) and reads them back."""

    def __init__(self, redis: Redis, *, maxlen: int | None = None, ttl_ms: int | None = None) -> None:
        """``maxlen`` and ``ttl_ms`` default to ``log_limits_from_env()``."""
        env_maxlen, env_ttl_ms = log_limits_from_env() if maxlen is None or ttl_ms is None else (0, 0)
        self._redis = redis
        self._maxlen = maxlen if maxlen is not None else env_maxlen
        self._ttl_ms = ttl_ms if ttl_ms is not None else env_ttl_ms
        self._append_script = redis.register_script(_APPEND_AND_PUBLISH)
        self._take_over_script = redis.register_script(_TAKE_OVER)
        self._end_script = redis.register_script(_END)

    async def append(self, events: Sequence[LogEvent]) -> Appended:
        """Log and publish ``events``, in order, in one command."""
        keys: list[str] = []
        args: list[str | int | bytes] = [self._maxlen, self._ttl_ms]
        for event in events:
            keys += [events_channel(event.request_id), OWNER_KEY_PREFIX + event.request_id]
            args += [entry_id(event.seq), event.attempt, int(event.terminal), event.payload]
        skipped, *superseded = await self._append_script(keys=keys, args=args)
        prefix = len(EVENTS_CHANNEL_PREFIX)
        keys_out = (key.decode() if isinstance(key, bytes) else key for key in superseded)
        return Appended(int(skipped), frozenset(key[prefix:] for key in keys_out))

    async def end(self, request_id: str, event: FinalEvent | ErrorEvent) -> int | None:
        """Log and publish ``event`` as ``request_id``'s last, numbered after whatever the
        log holds (computed in Redis), unless the request already ended. For the paths
        that end a request outside the attempt running it (a cancel while queued, a job
        arq gave up on). Returns the seq given, or ``None`` if it had already ended."""
        keys = [events_channel(request_id), OWNER_KEY_PREFIX + request_id]
        seq = int(await self._end_script(keys=keys, args=[encode_event(event), self._maxlen, self._ttl_ms]))
        return None if seq < 0 else seq

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
