"""The text APIs the gateway answers, each a face over one request mapping.

Every API becomes the same queued request: OpenAI's completions or chat completions
(``producer.openai_api``), with one admission, one key's tally, one resume, one cancel on
disconnect and one set of metrics (``gateway.routes.completions``). A face maps its body
into an OpenAI body, and the OpenAI response (whole, or streamed chunk by chunk) out into
its own shapes, and nothing else, as ``vllm serve`` answers Anthropic's Messages API over
its chat completions.
"""

from __future__ import annotations

from typing import Any

from fastapi.responses import JSONResponse

from gateway.sse import Framing, OpenAIFraming
from producer.openai_api.endpoints import CHAT_COMPLETIONS, COMPLETIONS, Endpoint
from producer.openai_api.errors import ApiError, api_error_for
from producer.openai_api.responses import ResponseMeta


class Face:
    """An API answered through ``endpoint``'s mapping; as it is, OpenAI's own (every
    mapping the identity). Another API overrides what it maps."""

    resumes: str | None = None
    """``None`` where ``Last-Event-ID`` resumes a named stream (the OpenAI streams, whose
    events are one chunk each); else why it does not, and what to do instead (a face whose
    stream opens and numbers its own events would start them again)."""

    def __init__(self, endpoint: Endpoint) -> None:
        self.endpoint = endpoint

    def openai_body(self, body: Any) -> Any:
        """The OpenAI body that asks what ``body`` (as its client sent it, parsed JSON) asks.
        Raises ``ApiError`` or ``InvalidRequest`` for a body this API refuses."""
        return body

    def whole(self, response: dict[str, Any], body: Any) -> dict[str, Any]:
        """This API's whole response from the OpenAI ``response`` to ``openai_body(body)``."""
        return response

    def framing(self, meta: ResponseMeta, body: Any) -> Framing:
        """How a stream of this API frames the OpenAI chunks (a new one per response)."""
        return OpenAIFraming()

    def error_response(self, exc: BaseException) -> JSONResponse:
        """This API's error response for ``exc`` (OpenAI's error shape here)."""
        error = api_error_for(exc)
        return JSONResponse(self.error_body(error), status_code=error.status, headers=error.headers)

    def error_body(self, error: ApiError) -> dict[str, Any]:
        return error.body()


COMPLETIONS_FACE = Face(COMPLETIONS)
CHAT_COMPLETIONS_FACE = Face(CHAT_COMPLETIONS)
