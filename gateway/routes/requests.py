"""``GET /v1/requests/{request_id}``: where a request is (``StreamqClient.status``)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from gateway.request_status import error_response, status_response

router = APIRouter()


@router.get("/v1/requests/{request_id}")
async def request_status(request: Request, request_id: str) -> Response:
    """Where a request is; 404 when unknown. A key stored in Redis sees only the requests
    it created."""
    try:
        return await status_response(request, request_id)
    except Exception as exc:
        return error_response(exc)
