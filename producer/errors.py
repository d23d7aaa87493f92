"""The errors the client raises: every one is a ``StreamqError`` (``InvalidRequest`` is
a ``ValueError`` too), so a service can catch them all in one clause.

``StreamqError`` and ``InvalidRequest`` are the protocol's (a malformed request is refused
by the same parsing on every side); the rest are what a client meets.
"""

from __future__ import annotations

from streamq.protocol import InvalidRequest, StreamqError

__all__ = [
    "DuplicateRequest",
    "InvalidParameter",
    "InvalidRequest",
    "MissingEvents",
    "NoLiveWorker",
    "QueueFull",
    "RequestError",
    "RequestLost",
    "StreamqError",
    "UnknownModel",
]


class InvalidParameter(InvalidRequest):
    """A request refused for one parameter, which ``param`` names (OpenAI's ``error.param``)."""

    def __init__(self, message: str, *, param: str) -> None:
        super().__init__(message)
        self.param = param


class RequestError(StreamqError):
    """The request ended with an error event (``code`` and ``message`` are the event's)."""

    def __init__(self, request_id: str, code: str, message: str) -> None:
        super().__init__(f"request {request_id} failed ({code}): {message}")
        self.request_id, self.code, self.message = request_id, code, message


class RequestLost(RequestError):
    """Found by the handle's watchdog: the request is neither queued nor running, and
    no final or error event was ever logged for it (code ``lost``)."""


class DuplicateRequest(StreamqError):
    """A job with this request id is queued, running, has a stored result, or its
    replay log is still kept."""


class MissingEvents(StreamqError):
    """Events went missing and the replay log no longer holds them, or holds others in
    their place: Redis lost writes it had acknowledged (a crash without fsync, a failover
    to a replica that lagged) and the request went on from what it kept. The events this
    handle delivered can no longer be continued exactly."""


class QueueFull(StreamqError):
    """The queue already holds ``max_queue_depth`` jobs (waiting or running): the
    request was not enqueued. Retry later, or add workers."""


class UnknownModel(StreamqError):
    """No worker has ever registered this model name."""


class NoLiveWorker(StreamqError):
    """Workers served this model once, but none is live now."""
