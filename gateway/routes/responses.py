"""The Responses API route: ``POST /v1/responses`` in front of the queue, a face over chat
completions (``gateway.responses_face``) answered by the one request path of the completion
routes (``gateway.routes.completions.respond``): admission, keys, metrics, cancel on disconnect.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from gateway.responses_face import ResponsesFace
from gateway.routes.completions import respond

RESPONSES_PATH = "/v1/responses"

router = APIRouter()


@router.post(RESPONSES_PATH)
async def create_response(request: Request) -> Response:
    return await respond(request, ResponsesFace())
