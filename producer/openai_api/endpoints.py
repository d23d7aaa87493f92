"""The OpenAI endpoints streamq serves, and what each maps a request and a response through."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final, Protocol

from producer.client import Completion
from producer.openai_api.limits import RequestLimits
from producer.openai_api.requests import chat_request_to_submit_kwargs, completion_request_to_submit_kwargs
from producer.openai_api.responses import chat_completion_response, completion_response


class SubmitKwargsBuilder(Protocol):
    def __call__(self, body: Mapping[str, Any], *, limits: RequestLimits = ...) -> dict[str, Any]: ...


class ResponseBuilder(Protocol):
    def __call__(self, completion: Completion, *, model: str, created: int | None = None) -> dict[str, Any]: ...


@dataclass(frozen=True)
class Endpoint:
    path: str
    chat: bool
    to_submit_kwargs: SubmitKwargsBuilder
    """The body to ``StreamqClient.submit`` keyword arguments, within the given limits."""
    to_response: ResponseBuilder
    """A finished request to its non-streaming response body."""


COMPLETIONS: Final = Endpoint("/v1/completions", False, completion_request_to_submit_kwargs, completion_response)
CHAT_COMPLETIONS: Final = Endpoint(
    "/v1/chat/completions", True, chat_request_to_submit_kwargs, chat_completion_response
)
ENDPOINTS: Final = {endpoint.path: endpoint for endpoint in (COMPLETIONS, CHAT_COMPLETIONS)}
