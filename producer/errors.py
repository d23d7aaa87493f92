"""The errors the client raises: every one is a ``StreamqError`` (``InvalidRequest`` is
a ``ValueError`` too), so a service can catch them all in one clause.

``StreamqError`` and ``InvalidRequest`` are the protocol's (a malformed request is refused
by the same parsing on every side); the rest are what a client meets.
"""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable
from typing import ParamSpec, TypeVar

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import OutOfMemoryError, RedisClusterException, RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from streamq.protocol import InvalidRequest, StreamqError

__all__ = [
    "ConnectionFailed",
    "DuplicateRequest",
    "InvalidParameter",
    "InvalidRequest",
    "MissingEvents",
    "NoLiveWorker",
    "QueueFull",
    "RedisFull",
    "RedisUnavailable",
    "RequestError",
    "RequestLost",
    "RequestTimeout",
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

    def __init__(self, message: str, *, request_id: str | None = None) -> None:
        super().__init__(message)
        self.request_id = request_id


class MissingEvents(StreamqError):
    """Events went missing and the replay log no longer holds them, or holds others in
    their place: Redis lost writes it had acknowledged (a crash without fsync, a failover
    to a replica that lagged, an evicting ``maxmemory-policy``) and the request went on from
    what it kept. The events this handle delivered can no longer be continued exactly."""


class QueueFull(StreamqError):
    """The queue already holds ``max_queue_depth`` jobs (waiting or running): the
    request was not enqueued. Retry later, or add workers."""

    def __init__(self, message: str, *, queue: str | None = None, limit: int | None = None) -> None:
        super().__init__(message)
        self.queue = queue
        """The queue that is full."""
        self.limit = limit
        """Its bound: the client's ``max_queue_depth``."""


class UnknownModel(StreamqError):
    """No worker has ever registered this model name (and none declared it)."""

    def __init__(self, message: str, *, model: str | None = None) -> None:
        super().__init__(message)
        self.model = model


class NoLiveWorker(StreamqError):
    """Workers served this model once, but none is live now, nor was one within the
    client's ``model_memory_s`` (within it, a request waits for the next worker)."""

    def __init__(self, message: str, *, model: str | None = None) -> None:
        super().__init__(message)
        self.model = model


class ConnectionFailed(StreamqError, ConnectionError):
    """``connect`` could not reach Redis within its ``connect_timeout_s``, or Redis refused
    it (a wrong password, a certificate refused): ``url`` says where, its password masked;
    the cause is chained."""

    def __init__(self, message: str, *, url: str) -> None:
        super().__init__(message)
        self.url = url


class RedisUnavailable(StreamqError, ConnectionError):
    """Redis could not be reached for a call, once the client's retries (20 s, what a
    restart or a failover takes) ran out; the redis-py error is chained."""


class RedisFull(StreamqError):
    """Redis refused a write because it is full: its memory reached ``maxmemory`` (an ``OOM``
    reply: under ``maxmemory-policy noeviction``, or a policy that found nothing to evict).
    Nothing was written: a request
    refused so was not enqueued. Retry once memory is freed (finished requests expire,
    ``maxmemory`` raised); the redis-py error is chained."""


class RequestTimeout(StreamqError, TimeoutError):
    """The caller's ``timeout`` passed before the request ended (``result``, ``generate``).
    A builtin ``TimeoutError`` too, so ``except TimeoutError`` catches it."""


P = ParamSpec("P")
R = TypeVar("R")


def redis_errors_as_streamq_errors(method: Callable[P, Awaitable[R]]) -> Callable[P, Awaitable[R]]:
    """The error family of the client: a Redis error that reaches a caller (the client's
    own retries spent) is a ``StreamqError``, its cause chained: ``RedisUnavailable``
    for Redis away, ``RedisFull`` for a write refused at its ``maxmemory``, ``StreamqError``
    for a command Redis refused otherwise (a permission, say)."""

    @functools.wraps(method)
    async def calling(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return await method(*args, **kwargs)
        except (RedisConnectionError, RedisTimeoutError, RedisClusterException) as exc:
            raise RedisUnavailable(f"cannot reach Redis: {exc}") from exc
        except OutOfMemoryError as exc:
            raise RedisFull(
                "Redis is full: its memory reached maxmemory and it refuses writes (under "
                "maxmemory-policy noeviction, or a policy that found nothing to evict); nothing was "
                "written. Retry once memory is freed (finished requests expire) or maxmemory is raised"
            ) from exc
        except RedisError as exc:
            raise StreamqError(f"Redis refused a command: {exc}") from exc

    return calling
