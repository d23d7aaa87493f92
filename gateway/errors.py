"""Every failure the gateway reports, mapped to an HTTP status in one place.

OpenAI clients decide what to do from the status (the SDK retries 429 and 503, never
400 or 404) and show ``error.message`` to a person, so each error names what was wrong
and, where it is one parameter, which (``param``).
"""

from __future__ import annotations

from typing import Any

from fastapi.responses import JSONResponse
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from producer.client import DuplicateRequest, NoLiveWorker, QueueFull, RequestError, StreamqError, UnknownModel
from streamq.protocol import InvalidRequest


class ApiError(Exception):
    """An error response in OpenAI's shape: ``{"error": {message, type, param, code}}``."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        code: str | None = None,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.code, self.param = status, message, type, code, param
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def bad_request(message: str, *, param: str | None = None, code: str = "invalid_parameter") -> ApiError:
    return ApiError(400, message, param=param, code=code)


def api_error_for(exc: BaseException) -> ApiError:
    """The response for an exception from the producer library or Redis."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, InvalidRequest):
        return bad_request(str(exc))
    if isinstance(exc, UnknownModel):
        return ApiError(404, str(exc), type="not_found_error", code="model_not_found", param="model")
    if isinstance(exc, NoLiveWorker):
        return ApiError(503, str(exc), type="service_unavailable_error", code="no_live_worker", param="model")
    if isinstance(exc, QueueFull):
        return ApiError(429, str(exc), type="rate_limit_error", code="queue_full", headers={"Retry-After": "1"})
    if isinstance(exc, DuplicateRequest):
        return ApiError(409, str(exc), code="duplicate_request")
    if isinstance(exc, RequestError):
        if exc.code == "invalid_request":  # the worker (vLLM) refused the parameters
            return bad_request(exc.message)
        return ApiError(500, f"{exc.code}: {exc.message}", type="internal_error", code=exc.code)
    if isinstance(exc, (RedisConnectionError, RedisTimeoutError, ConnectionError, TimeoutError)):
        return ApiError(503, f"cannot reach Redis: {exc}", type="service_unavailable_error", code="redis_unavailable")
    if isinstance(exc, StreamqError):
        return ApiError(500, str(exc), type="internal_error", code="internal")
    return ApiError(500, f"{type(exc).__name__}: {exc}", type="internal_error", code="internal")
