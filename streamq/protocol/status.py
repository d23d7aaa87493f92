"""What ``status`` answers about a request: one typed, JSON-encodable value, the same from
the library, the command line and the gateway (``GET /v1/requests/{id}``)."""

from __future__ import annotations

from typing import Literal

import msgspec

RequestState = Literal["queued", "running", "finished", "failed", "unknown"]
DeliveryState = Literal["pending", "delivered", "failed"]


class CallbackDelivery(msgspec.Struct, omit_defaults=True):
    """Where a request's completion callback stands."""

    url: str
    state: DeliveryState
    """``pending`` until the request ends and while tries remain; then ``delivered`` (a 2xx
    answer) or ``failed`` (tries spent, or an answer that is not worth repeating)."""
    attempts: int = 0
    http_status: int | None = None
    """The status of the last answer, if any."""
    last_error: str | None = None
    delivered_ms: int | None = None


class RequestStatus(msgspec.Struct, omit_defaults=True):
    """Where a request is. Fields beside ``state`` are present only where they apply."""

    request_id: str
    state: RequestState
    """``queued`` (waiting for a worker, or deferred), ``running`` (a worker holds its
    lease), ``finished`` (a final event: cancelled and timed-out requests too), ``failed``
    (an error event), ``unknown`` (never submitted, or everything about it expired)."""
    queue: str | None = None
    priority: int | None = None
    position: int | None = None
    """Queued and due: 1 for the next request of its priority to start."""
    waited_s: float | None = None
    """Queued or running: seconds since it was enqueued (its queue score, Redis's clock)."""
    run_at_ms: int | None = None
    """Queued and deferred: the Unix ms from which a worker may take it."""
    worker_id: str | None = None
    """Running: the worker holding its lease; finished: the worker that ran it to its end
    (its final event's ``worker``)."""
    attempt: int | None = None
    """Running: which try of the job this is (1 for the first)."""
    finish_reasons: list[str] | None = None
    """Finished: each completion's finish reason (``cancelled`` included)."""
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    """Finished: tokens generated; running: tokens sent so far (all completions)."""
    started_ms: int | None = None
    ended_ms: int | None = None
    """Finished or failed: Unix ms when it ended, when known (arq's result, or the callback)."""
    error_code: str | None = None
    error_message: str | None = None
    callback: CallbackDelivery | None = None


def encode_status(status: RequestStatus) -> bytes:
    return msgspec.json.encode(status)
