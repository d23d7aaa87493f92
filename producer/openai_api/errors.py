"""Every failure of an OpenAI request, mapped to an HTTP status and OpenAI's error body.

OpenAI clients decide from the status (the SDK retries 429 and 503, never 400 or 404)
and show ``error.message`` to a person, so each error names what was wrong and, where
it is one parameter, which (``param``).
"""

from __future__ import annotations

import enum
from typing import Any

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from producer.errors import (
    DuplicateRequest,
    NoLiveWorker,
    QueueFull,
    RedisFull,
    RequestError,
    StreamqError,
    UnknownModel,
)
from streamq.protocol import ErrorCode, InvalidRequest


class ApiErrorType(enum.StrEnum):
    """OpenAI's ``error.type``: the kind of failure."""

    INVALID_REQUEST = "invalid_request_error"
    NOT_FOUND = "not_found_error"
    RATE_LIMIT = "rate_limit_error"
    SERVICE_UNAVAILABLE = "service_unavailable_error"
    INTERNAL = "internal_error"


class ApiErrorCode(enum.StrEnum):
    """``error.code`` of failures that are not a request's own ``ErrorCode``."""

    INVALID_PARAMETER = "invalid_parameter"
    REQUEST_TOO_LARGE = "request_too_large"
    MODEL_NOT_FOUND = "model_not_found"
    REQUEST_NOT_FOUND = "request_not_found"
    DUPLICATE_REQUEST = "duplicate_request"
    MISSING_EVENTS = "missing_events"
    QUEUE_FULL = "queue_full"
    REDIS_FULL = "redis_full"
    INVALID_API_KEY = "invalid_api_key"
    DASHBOARD_FORBIDDEN = "dashboard_forbidden"
    RATE_LIMIT_EXCEEDED = "rate_limit_exceeded"
    NO_LIVE_WORKER = "no_live_worker"
    QUEUE_TIMEOUT = "queue_timeout"
    REDIS_UNAVAILABLE = "redis_unavailable"
    INTERNAL = "internal"


class ApiError(Exception):
    """An error response: its HTTP status, headers, and body ``{"error": {message, type, param, code}}``."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = ApiErrorType.INVALID_REQUEST,
        code: str | None = None,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.code, self.param = status, message, type, code, param
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, *, param: str | None = None, code: str = ApiErrorCode.INVALID_PARAMETER) -> ApiError:
    return ApiError(400, message, param=param, code=code)


def request_failed(code: str, message: str) -> ApiError:
    """A request that failed on the worker (its ``error`` event): a 500, its code kept."""
    return ApiError(500, f"{code}: {message}", type=ApiErrorType.INTERNAL, code=code)


NO_WORKER_RETRY_AFTER_S = 10
"""``Retry-After`` when no worker is there to take a request: about what a worker that is
starting needs before it takes requests (a first token after a cold start is longer)."""


def waited_too_long(model: str | None, bound_s: float | None) -> ApiError:
    """A request that waited in the queue past its bound without a worker starting it (its
    final event's finish reason ``queue_timeout``, with no token): a 503 the SDKs retry."""
    within = f" within {bound_s:g} s" if bound_s is not None else ""
    of = f" of model {model!r}" if model is not None else ""
    message = (
        f"no worker{of} started the request{within}: every worker may be busy, or none is running "
        "yet (scaled to zero and starting); try again later"
    )
    retry = {"Retry-After": str(NO_WORKER_RETRY_AFTER_S)}
    return ApiError(503, message, type=ApiErrorType.SERVICE_UNAVAILABLE, code=ApiErrorCode.QUEUE_TIMEOUT, headers=retry)


REDIS_FULL_RETRY_AFTER_S = 5
"""``Retry-After`` when Redis is full: finished requests expire and running ones end
within seconds, freeing memory, if the deployment is sized for its load at all."""


def api_error_for(exc: BaseException) -> ApiError:
    """The error response for an exception from the producer library or Redis."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, InvalidRequest):
        return bad_request(str(exc), param=getattr(exc, "param", None))
    if isinstance(exc, UnknownModel):
        return ApiError(404, str(exc), type=ApiErrorType.NOT_FOUND, code=ApiErrorCode.MODEL_NOT_FOUND, param="model")
    if isinstance(exc, NoLiveWorker):
        unavailable = ApiErrorType.SERVICE_UNAVAILABLE
        retry = {"Retry-After": str(NO_WORKER_RETRY_AFTER_S)}
        code = ApiErrorCode.NO_LIVE_WORKER
        return ApiError(503, str(exc), type=unavailable, code=code, param="model", headers=retry)
    if isinstance(exc, QueueFull):
        retry = {"Retry-After": "1"}
        return ApiError(429, str(exc), type=ApiErrorType.RATE_LIMIT, code=ApiErrorCode.QUEUE_FULL, headers=retry)
    if isinstance(exc, RedisFull):
        retry = {"Retry-After": str(REDIS_FULL_RETRY_AFTER_S)}
        unavailable = ApiErrorType.SERVICE_UNAVAILABLE
        return ApiError(503, str(exc), type=unavailable, code=ApiErrorCode.REDIS_FULL, headers=retry)
    if isinstance(exc, DuplicateRequest):
        return ApiError(409, str(exc), code=ApiErrorCode.DUPLICATE_REQUEST)
    if isinstance(exc, RequestError):
        if exc.code == ErrorCode.INVALID_REQUEST:  # the worker (vLLM) refused the parameters
            return bad_request(exc.message)
        return request_failed(exc.code, exc.message)
    if isinstance(exc, (RedisConnectionError, RedisTimeoutError, ConnectionError, TimeoutError)):
        message = f"cannot reach Redis: {exc}"
        return ApiError(503, message, type=ApiErrorType.SERVICE_UNAVAILABLE, code=ApiErrorCode.REDIS_UNAVAILABLE)
    if isinstance(exc, StreamqError):
        return ApiError(500, str(exc), type=ApiErrorType.INTERNAL, code=ApiErrorCode.INTERNAL)
    return ApiError(500, f"{type(exc).__name__}: {exc}", type=ApiErrorType.INTERNAL, code=ApiErrorCode.INTERNAL)
