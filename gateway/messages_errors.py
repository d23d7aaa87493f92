"""Anthropic's error shape: ``{"type": "error", "error": {"type": ..., "message": ...}}``,
its ``error.type`` by HTTP status as Anthropic's API names them, built as the anthropic
package's own ``ErrorResponse``. The anthropic SDK raises by status; a person reads the
message, which names the field at fault.
"""

from __future__ import annotations

from typing import Any, Final

from anthropic.types import ErrorResponse

from producer.openai_api.errors import ApiError, ApiErrorType

ERROR_TYPES: Final[dict[int, str]] = {
    400: "invalid_request_error",
    401: "authentication_error",
    402: "billing_error",
    403: "permission_error",
    404: "not_found_error",
    409: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    503: "overloaded_error",
    504: "timeout_error",
    529: "overloaded_error",
}
"""Anthropic's ``error.type`` per status; any other is ``api_error``."""
STATUS_OF_OPENAI_TYPE: Final[dict[str, int]] = {
    ApiErrorType.INVALID_REQUEST: 400,
    ApiErrorType.NOT_FOUND: 404,
    ApiErrorType.RATE_LIMIT: 429,
    ApiErrorType.SERVICE_UNAVAILABLE: 503,
}
"""The status of an OpenAI error body's type (a failure inside a stream has only its body)."""


def anthropic_error_body(error: ApiError) -> dict[str, Any]:
    """Anthropic's error body of ``error``."""
    kind = ERROR_TYPES.get(error.status, "api_error")
    body = ErrorResponse.model_validate({"type": "error", "error": {"type": kind, "message": error.message}})
    return body.model_dump(mode="json", exclude_none=True)


def error_of_openai_body(body: dict[str, Any]) -> ApiError:
    """The ``ApiError`` of an OpenAI error body (``{"error": {message, type, ...}}``)."""
    error = body.get("error") or {}
    status = STATUS_OF_OPENAI_TYPE.get(error.get("type", ""), 500)
    return ApiError(status, str(error.get("message", "")))
