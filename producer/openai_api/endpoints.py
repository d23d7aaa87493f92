"""The OpenAI endpoints streamq serves, and what each maps a request and a response through."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final, Protocol

from producer.client import Completion
from producer.openai_api.limits import DEFAULT_LIMITS, RequestLimits
from producer.openai_api.pooling import EMBEDDINGS, RERANK, SCORE, PoolingCall, parse_pooling_body, pooling_response
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
        shape: Any = ...,
        response_id: str | None = None,
    ) -> dict[str, Any]: ...


class ShapeReader(Protocol):
    def __call__(self, body: Mapping[str, Any]) -> ResponseShape | PoolingCall: ...


@dataclass(frozen=True)
class Endpoint:
    path: str
    chat: bool
    to_submit_kwargs: SubmitKwargsBuilder
    """A body with one prompt to ``StreamqClient.submit`` keyword arguments, within the given limits."""
    shape: ShapeReader
    """What a (valid) body asks of its response beyond the completions (a pooling body: the
    whole parsed call)."""
    to_response: ResponseBuilder
    """Finished requests (a body's prompts, in order) to the non-streaming response body."""


COMPLETIONS: Final = Endpoint(
    "/v1/completions", False, completion_request_to_submit_kwargs, completion_shape, completion_response
)
CHAT_COMPLETIONS: Final = Endpoint(
    "/v1/chat/completions", True, chat_request_to_submit_kwargs, chat_shape, chat_completion_response
)


def _pooling_endpoint(path: str) -> Endpoint:
    """A pooling API's path as a batch line's ``url`` (``vllm run-batch`` reads these too):
    its body one pooling request, its response ``vllm serve``'s."""

    def to_submit_kwargs(body: Mapping[str, Any], *, limits: RequestLimits = DEFAULT_LIMITS) -> dict[str, Any]:
        return parse_pooling_body(path, dict(body)).submit_kwargs()

    def shape(body: Mapping[str, Any]) -> PoolingCall:
        return parse_pooling_body(path, dict(body))

    def to_response(
        completions: Sequence[Completion],
        *,
        model: str,
        created: int | None = None,
        shape: Any = None,
        response_id: str | None = None,
    ) -> dict[str, Any]:
        (completion,) = completions
        if completion.pooled is None:
            raise ValueError(f"request {completion.request_id} ended without results")
        return pooling_response(shape, completion.pooled, model=model, created=created, response_id=response_id)

    return Endpoint(path, False, to_submit_kwargs, shape, to_response)


POOLING_BATCH_PATHS: Final = (*EMBEDDINGS.paths, *SCORE.paths, *RERANK.paths[:2])
"""The pooling APIs a batch line may name: those ``vllm run-batch`` reads."""
ENDPOINTS: Final = {
    endpoint.path: endpoint
    for endpoint in (COMPLETIONS, CHAT_COMPLETIONS, *(_pooling_endpoint(path) for path in POOLING_BATCH_PATHS))
}
