"""A request's status as an HTTP response, and the OpenAI-shaped error response of any
failure: shared by ``GET /v1/requests/{id}`` and the dashboard's request routes."""

from __future__ import annotations

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from gateway.auth import TENANT_STATE, Tenant
from gateway.state import services_of
from producer.openai_api.errors import ApiError, ApiErrorCode, api_error_for, bad_request
from streamq.protocol import REQUEST_ID_PATTERN, is_valid_request_id
from streamq.protocol.status import encode_status


def check_request_id(request_id: str) -> None:
    """Raise a 400 ``ApiError`` for an id no request can have."""
    if not is_valid_request_id(request_id):
        raise bad_request(f"a request id must match {REQUEST_ID_PATTERN.pattern}", param="request_id")


def request_not_found(request_id: str) -> ApiError:
    return ApiError(404, f"no request {request_id!r} (unknown, or expired)", code=ApiErrorCode.REQUEST_NOT_FOUND)


async def status_response(request: Request, request_id: str) -> Response:
    """The request's ``RequestStatus`` JSON; 404 when unknown. A key stored in Redis sees
    only the requests it created. Raises ``ApiError`` (and Redis's errors)."""
    services = services_of(request.app)
    check_request_id(request_id)
    tenant: Tenant | None = getattr(request.state, TENANT_STATE, None)
    if tenant is not None and tenant.record is not None and not await services.limiter.created(request_id, tenant):
        raise request_not_found(request_id)  # another key's requests are as unknown as those never made
    status = await services.client.status(request_id)
    if status.state == "unknown":
        raise request_not_found(request_id)
    return Response(encode_status(status), media_type="application/json")


def error_response(exc: BaseException) -> JSONResponse:
    """OpenAI's error shape for ``exc`` (``producer.openai_api.errors``)."""
    error = api_error_for(exc)
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers)
