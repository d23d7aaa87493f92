"""The OpenAI endpoints streamq serves, and what each maps a request and a response through."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final, Protocol

from producer.client import Completion
from producer.openai_api.limits import RequestLimits
from producer.openai_api.requests import (
    ResponseShape,
    chat_request_to_submit_kwargs,
    chat_shape,
    completion_request_to_submit_kwargs,
    completion_shape,
)
from producer.openai_api.responses import chat_completion_response, completion_response


class SubmitKwargsBuilder(Protocol):
    def __call__(self, body: Mapping[str, Any], *, limits: RequestLimits = ...) -> dict[str, Any]: ...


class ResponseBuilder(Protocol):
    def __call__(
        self,
        completions: Sequence[Completion],
        *,
        model: str,
        created: int | None = None,
        shape: ResponseShape = ...,
        response_id: str | None = None,
    ) -> dict[str, Any]: ...


class ShapeReader(Protocol):
    def __call__(self, body: Mapping[str, Any]) -> ResponseShape: ...


@dataclass(frozen=True)
class Endpoint:
    path: str
    chat: bool
    to_submit_kwargs: SubmitKwargsBuilder
    """A body with one prompt to ``StreamqClient.submit`` keyword arguments, within the given limits."""
    shape: ShapeReader
    """What a (valid) body asks of its response beyond the completions."""
    to_response: ResponseBuilder
    """Finished requests (a body's prompts, in order) to the non-streaming response body."""


COMPLETIONS: Final = Endpoint(
    "/v1/completions", False, completion_request_to_submit_kwargs, completion_shape, completion_response
)
CHAT_COMPLETIONS: Final = Endpoint(
    "/v1/chat/completions", True, chat_request_to_submit_kwargs, chat_shape, chat_completion_response
)
ENDPOINTS: Final = {endpoint.path: endpoint for endpoint in (COMPLETIONS, CHAT_COMPLETIONS)}
