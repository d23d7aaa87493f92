"""``vllm serve``'s pooling routes: ``/v1/embeddings``, ``/pooling``, ``/classify``,
``/score`` (and ``/v1/score``), ``/rerank`` (and ``/v1/rerank``, ``/v2/rerank``), in front
of the queue, routed by model.

A body becomes one pooling request (``producer.openai_api.pooling``): every input of it,
and for score and rerank the query and the documents, run on one worker, and the response
is built from their vectors as ``vllm serve`` builds it. A model whose live workers do not
run the API's task gets ``vllm serve``'s refusal (a 404, as it registers no such route,
with its handler's words); a request waits for a worker, is admitted and charged against
its API key, and is cancelled when its client leaves, as a completion is.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from gateway import http_metrics
from gateway.auth import TENANT_STATE
from gateway.default_model import with_default_model
from gateway.disconnect import ClientGone, until_disconnected
from gateway.request_status import error_response
from gateway.routes.completions import (
    REQUEST_ID_HEADER,
    Account,
    affinity_of,
    json_body,
    queue_tenant_of,
)
from gateway.state import config_of, services_of
from producer.errors import StreamqError
from producer.openai_api.errors import bad_request, waited_too_long
from producer.openai_api.pooling import POOLING_PATHS, check_model_tasks, parse_pooling_body, pooling_response
from streamq.protocol import REQUEST_ID_PATTERN, FinishReason, is_valid_request_id

router = APIRouter()


async def _route(request: Request) -> Response:
    return await respond(request)


for _path in POOLING_PATHS:
    router.add_api_route(_path, _route, methods=["POST"], name=f"pooling{_path.replace('/', '_')}")


async def respond(request: Request) -> Response:
    """One pooling request, every failure an OpenAI error body, counted in the gateway's metrics."""
    account = Account(services_of(request.app).limiter, getattr(request.state, TENANT_STATE, None))
    response: Response | None = None
    try:
        response = await _pool(request, account)
    except ClientGone:
        response = Response(status_code=499)  # nobody is listening any more
    except Exception as exc:
        response = error_response(exc)
    finally:
        await account.close(succeeded=response is not None and response.status_code == 200)
    http_metrics.REQUESTS.labels(endpoint=request.url.path, status=str(response.status_code)).inc()
    return response


async def _pool(request: Request, account: Account) -> Response:
    path = request.url.path
    body = await with_default_model(request, await json_body(request))
    client = services_of(request.app).client
    model = body.get("model") if isinstance(body, dict) else None
    tasks: set[str] = set()
    if isinstance(model, str) and model:
        tasks = (await client.routes_serving(model)).tasks(model)
    default_task: Literal["embed", "classify"] = "classify" if "classify" in tasks and "embed" not in tasks else "embed"
    call = parse_pooling_body(path, body, default_task=default_task)
    assert call.model is not None, "with_default_model names the model"
    check_model_tasks(call.api, tasks, call.model)
    affinity = affinity_of(request)
    named = _named(request) or call.request_id
    if account.tenant is not None:
        account.admission = await account.limiter.admit(account.tenant, call.model)
    created = int(time.time())
    kwargs: dict[str, Any] = {
        **call.submit_kwargs(),
        **affinity,
        "tenant": queue_tenant_of(request, account.tenant),
        "queue_timeout_s": config_of(request.app).queue_timeout_s,
    }
    if named is not None:
        kwargs["request_id"] = named
    handle = await client.submit(None, cancel_on_close=True, stream=False, **kwargs)
    async with handle:
        completion = await until_disconnected(request.receive, handle.result())
    if completion.pooled is None:
        if all(reason == FinishReason.QUEUE_TIMEOUT for reason in completion.finish_reasons):
            raise waited_too_long(call.model, config_of(request.app).queue_timeout_s)
        raise StreamqError(f"request {completion.request_id} ended without results ({completion.finish_reason})")
    account.charge(completion.pooled.total_prompt_tokens, 0)
    body_out: dict[str, Any] = pooling_response(
        call, completion.pooled, model=call.model, created=created, response_id=call.response_id(completion.request_id)
    )
    return JSONResponse(body_out, headers={"x-request-id": completion.request_id})


def _named(request: Request) -> str | None:
    """The request's id from ``x-streamq-request-id``, else ``X-Request-Id`` (``vllm
    serve``'s header: the response's id ends with it), checked."""
    for header in (REQUEST_ID_HEADER, "x-request-id"):
        value = request.headers.get(header)
        if value is not None:
            if not is_valid_request_id(value):
                raise bad_request(f"{header} must match {REQUEST_ID_PATTERN.pattern}", param=header)
            return value
    return None
