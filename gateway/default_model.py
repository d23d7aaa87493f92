"""The model of a request that names none: the one model the live workers serve, as
``vllm serve`` answers such a request with the model it serves. Where live workers serve
several base models (or none), the request must name one: a 400 listing them."""

from __future__ import annotations

from typing import Any

from fastapi import Request

from gateway.state import services_of
from producer.openai_api.errors import bad_request


async def with_default_model(request: Request, body: Any) -> Any:
    """``body`` with its ``model`` filled in when it has none (absent, ``null`` or empty,
    as ``vllm serve`` takes them); the registry is read only then."""
    if not isinstance(body, dict) or body.get("model") not in (None, ""):
        return body
    routes = await services_of(request.app).client.routes()
    bases = {worker.model for worker in routes.workers}  # a worker's adapters are models beside its base
    if len(bases) != 1:
        served = ", ".join(sorted(routes.live_models())) or "none"
        raise bad_request(f"'model' is required: live workers serve {served}", param="model")
    return {**body, "model": bases.pop()}
