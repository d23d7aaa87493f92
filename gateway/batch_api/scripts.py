"""The scripts that move a batch on, each one Redis call. Those that change where a batch
stands check the caller's lease first, so that a gateway that lost its lease (paused past
it) cannot write over the gateway that took the batch over. Recording a line's result needs
no lease: it removes the line from the in-flight hash and appends its output line in one
step, so a result is recorded once whoever records it."""

from __future__ import annotations

from typing import Any

from redis.asyncio import Redis

from gateway.batch_api import names

_LEASED = """
if redis.call('GET', KEYS[2]) ~= ARGV[1] then return -1 end
"""

RENEW = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return 1
"""

RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then redis.call('DEL', KEYS[1]) end
return 1
"""

# KEYS: batch, lease. ARGV: token, the states it may move from (comma-separated), then fields and values.
TRANSITION = (
    _LEASED
    + """
local status = redis.call('HGET', KEYS[1], 'status')
if not status or not string.find(',' .. ARGV[2] .. ',', ',' .. status .. ',', 1, true) then return 0 end
redis.call('HSET', KEYS[1], unpack(ARGV, 3))
return 1
"""
)

# KEYS: batch, lease, in-flight. ARGV: token, request id, its line (JSON), next offset, next line.
START_LINE = (
    _LEASED
    + """
redis.call('HSET', KEYS[3], ARGV[2], ARGV[3])
redis.call('HSET', KEYS[1], 'next_offset', ARGV[4], 'next_line', ARGV[5])
return 1
"""
)

# KEYS: batch, lease, error lines. ARGV: token, the output line, next offset, next line.
LINE_FAILED = (
    _LEASED
    + """
redis.call('RPUSH', KEYS[3], ARGV[2])
redis.call('HINCRBY', KEYS[1], 'failed', 1)
redis.call('HSET', KEYS[1], 'next_offset', ARGV[3], 'next_line', ARGV[4])
return 1
"""
)

# KEYS: in-flight, output or error lines, batch. ARGV: request id, the output line, the counter
# (completed or failed), input tokens, output tokens.
RECORD_RESULT = """
if redis.call('HDEL', KEYS[1], ARGV[1]) == 0 then return 0 end
redis.call('RPUSH', KEYS[2], ARGV[2])
redis.call('HINCRBY', KEYS[3], ARGV[3], 1)
redis.call('HINCRBY', KEYS[3], 'input_tokens', ARGV[4])
redis.call('HINCRBY', KEYS[3], 'output_tokens', ARGV[5])
return 1
"""

# KEYS: batch, lease, output or error lines, parts. ARGV: token, lines written, the part's name.
COMMIT_PART = (
    _LEASED
    + """
redis.call('LTRIM', KEYS[3], tonumber(ARGV[2]), -1)
redis.call('RPUSH', KEYS[4], ARGV[3])
return 1
"""
)


class LeaseLost(Exception):
    """Another gateway runs the batch now: this one stops moving it on."""


class BatchScripts:
    """The scripts, registered once per Redis client (redis-py reloads one Redis forgot)."""

    def __init__(self, redis: Redis) -> None:
        self._renew = redis.register_script(RENEW)
        self._release = redis.register_script(RELEASE)
        self._transition = redis.register_script(TRANSITION)
        self._start_line = redis.register_script(START_LINE)
        self._line_failed = redis.register_script(LINE_FAILED)
        self._record_result = redis.register_script(RECORD_RESULT)
        self._commit_part = redis.register_script(COMMIT_PART)

    async def renew(self, batch_id: str, token: str, lease_ms: int) -> bool:
        return bool(await self._renew(keys=[names.batch_lease_key(batch_id)], args=[token, lease_ms]))

    async def release(self, batch_id: str, token: str) -> None:
        await self._release(keys=[names.batch_lease_key(batch_id)], args=[token])

    async def transition(self, batch_id: str, token: str, from_states: str, fields: dict[str, Any]) -> bool:
        """Set ``fields`` if the batch is in one of ``from_states`` (comma-separated); whether it was."""
        args: list[Any] = [token, from_states]
        for name, value in fields.items():
            args += [name, "" if value is None else value]
        return _leased(await self._transition(keys=_leased_keys(batch_id), args=args)) == 1

    async def start_line(
        self, batch_id: str, token: str, request_id: str, line: bytes, next_offset: int, next_line: int
    ) -> None:
        keys = [*_leased_keys(batch_id), names.batch_inflight_key(batch_id)]
        _leased(await self._start_line(keys=keys, args=[token, request_id, line, next_offset, next_line]))

    async def line_failed(self, batch_id: str, token: str, output: bytes, next_offset: int, next_line: int) -> None:
        keys = [*_leased_keys(batch_id), names.batch_results_key(batch_id, "err")]
        _leased(await self._line_failed(keys=keys, args=[token, output, next_offset, next_line]))

    async def record_result(
        self, batch_id: str, request_id: str, output: bytes, *, ok: bool, input_tokens: int, output_tokens: int
    ) -> bool:
        """Record a line's result unless it was recorded already; whether this call did."""
        keys = [
            names.batch_inflight_key(batch_id),
            names.batch_results_key(batch_id, "out" if ok else "err"),
            names.batch_key(batch_id),
        ]
        counter = "completed" if ok else "failed"
        args: list[Any] = [request_id, output, counter, input_tokens, output_tokens]
        return bool(await self._record_result(keys=keys, args=args))

    async def commit_part(self, batch_id: str, token: str, kind: str, written: int, part: str) -> None:
        keys = [
            *_leased_keys(batch_id),
            names.batch_results_key(batch_id, kind),
            names.batch_parts_key(batch_id),
        ]
        _leased(await self._commit_part(keys=keys, args=[token, written, part]))


def _leased_keys(batch_id: str) -> list[str]:
    return [names.batch_key(batch_id), names.batch_lease_key(batch_id)]


def _leased(result: Any) -> int:
    if int(result) == -1:
        raise LeaseLost()
    return int(result)
