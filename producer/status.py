"""``status``: where a request is, read in one round trip (``request_status.lua``, by
``EVALSHA_RO``) and decoded into a ``RequestStatus``.

The script returns what Redis holds (the log's newest event, the lease, arq's result, the
queue entry, the callback hash); this module decides the state from it, in this order: a
terminal event in the log (``finished``/``failed``), arq's result, a lease (``running``),
a queue entry or a stored job (``queued``), else ``unknown``. The log and arq's result each
tell how a request ended, so the answer lasts as long as the longer-kept of the two.
Where the logs live on a Redis Cluster, the log is read on its shard first (its newest
event and the tokens its chunks carry), and the script reads the control plane only.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import msgspec
from redis.asyncio import Redis

from streamq.broker.data_plane import ONE_REDIS
from streamq.broker.job_result import failure_of
from streamq.broker.replay_log import ReplayLog
from streamq.protocol import (
    IN_PROGRESS_PREFIX,
    JOB_KEY_PREFIX,
    MODELS_KEY,
    RESULT_KEY_PREFIX,
    RETRY_KEY_PREFIX,
    TERMINAL_EVENTS,
    ChunkEvent,
    ErrorEvent,
    FinalEvent,
    callback_key,
    decode_event,
    script_calls,
)
from streamq.protocol.scripts import Script
from streamq.protocol.status import CallbackDelivery, RequestStatus


class _Found(msgspec.Struct):
    """``request_status.lua``'s reply."""

    now: int
    last: str | None = None
    lease: str | None = None
    tries: int | None = None
    result: dict[str, Any] | None = None
    callback: dict[str, str] | None = None
    queue: str | None = None
    score: float | None = None
    priority: int | None = None
    position: int | None = None
    tokens: int | None = None


class StatusReader:
    """Reads requests' status; one script call each."""

    def __init__(self, redis: Redis, log: ReplayLog | None = None) -> None:
        """``log``: the replay log, when it is not on ``redis`` (a Redis Cluster's data plane)."""
        self._script = Script(redis, script_calls.RequestStatus)
        self._log = log if log is not None and log.names.sharded else None

    async def read(self, request_id: str, *, queues: Sequence[str] = ()) -> RequestStatus:
        """The status of ``request_id``. Queued requests are looked for on ``queues``
        first, then on every queue a model was registered on."""
        call = script_calls.RequestStatus(
            job_key=JOB_KEY_PREFIX + request_id,
            in_progress_key=IN_PROGRESS_PREFIX + request_id,
            result_key=RESULT_KEY_PREFIX + request_id,
            log_key=(self._log.names if self._log is not None else ONE_REDIS).events(request_id),
            retry_key=RETRY_KEY_PREFIX + request_id,
            callback_key=callback_key(request_id),
            queues=list(dict.fromkeys(queues)),
            request_id=request_id,
            models_key=MODELS_KEY,
            in_progress_prefix=IN_PROGRESS_PREFIX,
        )
        if self._log is None:
            reply = await self._script(call)
            return status_from(request_id, msgspec.json.decode(reply, type=_Found))
        last, tokens = await _log_summary(self._log, request_id)
        ended = last is not None and isinstance(decode_event(last), TERMINAL_EVENTS)
        reply = await self._script(replace(call, ended="1" if ended else "0"))
        found = msgspec.json.decode(reply, type=_Found)
        found.last = None if last is None else last.decode()
        found.tokens = tokens
        return status_from(request_id, found)


async def _log_summary(log: ReplayLog, request_id: str) -> tuple[bytes | None, int | None]:
    """The log's newest event and, unless it ended, the tokens its chunks carry so far
    (``None`` for an empty log): what the status script reads itself on one Redis."""
    last = await log.last(request_id)
    if last is None or isinstance(decode_event(last), TERMINAL_EVENTS):
        return last, None
    tokens = 0
    for raw in await log.read(request_id):
        event = decode_event(raw)
        if isinstance(event, ChunkEvent):
            tokens += len(event.token_ids)
    return last, tokens


def status_from(request_id: str, found: _Found) -> RequestStatus:
    """Decide a request's state from what the status script found."""
    status = RequestStatus(request_id=request_id, state="unknown", callback=_delivery(found.callback))
    ended_ms = _int(found.callback.get("ended_ms")) if found.callback else None
    result = found.result
    if result is not None:
        status.started_ms, ended_ms = _int(result.get("st")), _int(result.get("ft")) or ended_ms
    last = decode_event(found.last.encode()) if found.last else None
    if isinstance(last, FinalEvent):
        status.state = "finished"
        status.finish_reasons = [str(reason) for reason in last.finish_reasons]
        status.prompt_tokens, status.completion_tokens = last.prompt_tokens, last.completion_tokens
        status.worker_id = last.worker
        status.ended_ms = ended_ms
    elif isinstance(last, ErrorEvent):
        status.state = "failed"
        status.error_code, status.error_message = last.code, last.message
        status.ended_ms = ended_ms
    elif result is not None:
        _from_result(status, result)
        status.ended_ms = ended_ms
    elif found.lease is not None:
        status.state = "running"
        status.worker_id, status.attempt = _holder(found.lease, found.tries)
        status.completion_tokens = found.tokens or 0
        status.queue = found.queue
        if found.score is not None:
            status.waited_s = max(0.0, (found.now - found.score) / 1000)
    elif found.queue is not None and found.score is not None:
        status.state = "queued"
        status.queue, status.priority = found.queue, found.priority
        if found.score > found.now:
            status.run_at_ms = int(found.score)
        else:
            status.position = found.position
            status.waited_s = (found.now - found.score) / 1000
    return status


def _from_result(status: RequestStatus, result: dict[str, Any]) -> None:
    """A request whose log is gone (or never had an end), from arq's result."""
    outcome = result.get("r")
    if result.get("s") and isinstance(outcome, dict):
        status.state = "finished"
        reasons = outcome.get("finish_reasons")
        status.finish_reasons = [str(r) for r in reasons] if isinstance(reasons, list) else None
        status.prompt_tokens = _int(outcome.get("prompt_tokens"))
        status.completion_tokens = _int(outcome.get("completion_tokens"))
        return
    code, message = failure_of(msgspec.json.encode({"s": bool(result.get("s")), "r": outcome}))
    status.state = "failed"
    status.error_code, status.error_message = (str(code) if code else "internal"), message


def _holder(lease: str, tries: int | None) -> tuple[str | None, int | None]:
    """The worker and attempt a lease names: ``<worker id>:<attempt>`` once renewed,
    ``<worker id>`` as claimed (the attempt is then arq's try count), ``1`` for plain arq."""
    worker, _, attempt = lease.rpartition(":")
    if worker and attempt.isdigit():
        return worker, int(attempt)
    return (None if lease == "1" else lease), tries


def _delivery(found: dict[str, str] | None) -> CallbackDelivery | None:
    if not found or "spec" not in found:
        return None
    try:
        url = str(msgspec.json.decode(found["spec"])["url"])
    except (msgspec.DecodeError, KeyError, TypeError):
        url = ""
    state = found.get("state", "pending")
    return CallbackDelivery(
        url=url,
        state=state if state in ("pending", "delivered", "failed") else "pending",  # type: ignore[arg-type]
        attempts=_int(found.get("attempts")) or 0,
        http_status=_int(found.get("http_status")),
        last_error=found.get("last_error"),
        delivered_ms=_int(found.get("delivered_ms")),
    )


def _int(value: object) -> int | None:
    try:
        return None if value is None else int(float(str(value)))
    except ValueError:
        return None
