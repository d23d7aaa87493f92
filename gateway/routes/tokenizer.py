"""``vllm serve``'s tokenizer routes: ``/tokenize``, ``/detokenize`` and ``/tokenizer_info``
(what lm-evaluation-harness's remote tokenizer reads), for a model with a live worker.

The gateway holds no tokenizer: ``/tokenize`` and ``/detokenize`` go through the queue as
a request of one token with ``echo``, which brings the prompt back as the worker gave it
to the engine (its token ids, its text), so they cost a prefill each; ``/tokenizer_info``
reads what the model's workers wrote at start-up. A request without ``model`` names the
gateway's ``--tokenizer-model``, else the one model live workers serve (with several, it
must name one).
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from gateway.auth import TENANT_STATE, Tenant
from gateway.disconnect import until_disconnected
from gateway.request_status import error_response
from gateway.routes.completions import json_body
from gateway.state import config_of, services_of
from producer.errors import InvalidParameter, UnknownModel
from producer.openai_api.errors import ApiError, ApiErrorCode, bad_request
from producer.openai_api.requests import chat_request_to_submit_kwargs
from streamq.protocol import TOKENIZER_INFO_PREFIX

_TOKENIZE_FIELDS = frozenset(
    {
        "model",
        "prompt",
        "messages",
        "add_special_tokens",
        "return_token_strs",
        "add_generation_prompt",
        "continue_final_message",
        "chat_template_kwargs",
    }
)


router = APIRouter()


@router.post("/tokenize")
async def tokenize(request: Request) -> Response:
    try:
        body = await _body(request, _TOKENIZE_FIELDS)
        model = await resolve_model(request, body.get("model"))
        kwargs = _tokenize_kwargs(body)
        completion = await echo_prompt(request, model, kwargs)
        assert completion.prompt_token_ids is not None, "echo brings the prompt's token ids back"
        context = (await services_of(request.app).client.routes()).context_length(model)
        tokens = completion.prompt_token_ids
        return JSONResponse({"count": len(tokens), "max_model_len": context, "tokens": tokens, "token_strs": None})
    except Exception as exc:
        return error_response(exc)


@router.post("/detokenize")
async def detokenize(request: Request) -> Response:
    try:
        body = await _body(request, frozenset({"model", "tokens"}))
        model = await resolve_model(request, body.get("model"))
        tokens = body.get("tokens")
        if not isinstance(tokens, list) or not all(isinstance(t, int) and t >= 0 for t in tokens) or not tokens:
            raise InvalidParameter("tokens must be a non-empty list of token ids", param="tokens")
        completion = await echo_prompt(request, model, {"prompt": tokens})
        assert completion.prompt_echo is not None, "echo brings the prompt's text back"
        return JSONResponse({"prompt": completion.prompt_echo.text})
    except Exception as exc:
        return error_response(exc)


@router.get("/tokenizer_info")
async def tokenizer_info(request: Request, model: str | None = None) -> Response:
    try:
        name = await resolve_model(request, model)
        info = await services_of(request.app).client.redis.get(TOKENIZER_INFO_PREFIX + name)
        if info is None:
            raise ApiError(
                404, f"no worker of model {name!r} has described its tokenizer", code=ApiErrorCode.MODEL_NOT_FOUND
            )
        return Response(info, media_type="application/json")
    except Exception as exc:
        return error_response(exc)


async def _body(request: Request, known: frozenset[str]) -> dict[str, Any]:
    body = await json_body(request)
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    if unknown := sorted(set(body) - known):
        raise bad_request(f"unsupported field(s) for {request.url.path}: {', '.join(unknown)}")
    return body


async def resolve_model(request: Request, model: object) -> str:
    """The model the request names, else the gateway's default, else the one live model;
    one the key may use."""
    client = services_of(request.app).client
    if model is None:
        model = config_of(request.app).tokenizer_model
    if model is None:
        live = sorted((await client.routes()).live_models())
        if len(live) != 1:
            raise bad_request(f"name the model: live workers serve {', '.join(live) or 'none'}", param="model")
        model = live[0]
    if not isinstance(model, str) or not model:
        raise bad_request("model must be a model name", param="model")
    tenant: Tenant | None = getattr(request.state, TENANT_STATE, None)
    if tenant is not None and tenant.record is not None and not tenant.record.allows(model):
        raise UnknownModel(f"model {model!r} is not one this key may use")
    return model


def _tokenize_kwargs(body: dict[str, Any]) -> dict[str, Any]:
    """``submit``'s prompt arguments for a ``/tokenize`` body: a text ``prompt`` or chat
    ``messages`` (with the chat template's fields), as ``vllm serve`` takes them."""
    if body.get("return_token_strs"):
        raise InvalidParameter("return_token_strs is not supported by streamq", param="return_token_strs")
    special = body.get("add_special_tokens")
    if special is not None and not isinstance(special, bool):
        raise InvalidParameter("add_special_tokens must be true or false", param="add_special_tokens")
    if "messages" in body:
        chat = {k: v for k, v in body.items() if k not in ("model", "return_token_strs")}
        kwargs = chat_request_to_submit_kwargs(chat)
        return {
            "messages": kwargs["messages"],
            **{k: kwargs[k] for k in ("chat_options", "add_special_tokens") if k in kwargs},
        }
    prompt = body.get("prompt")
    if not isinstance(prompt, str) or not prompt:
        raise InvalidParameter("prompt must be a non-empty string (or give messages)", param="prompt")
    return {"prompt": prompt, **({"add_special_tokens": False} if special is False else {})}


async def echo_prompt(request: Request, model: str, kwargs: dict[str, Any]) -> Any:
    """Run ``kwargs``' prompt through one of ``model``'s workers for one token, echoed."""
    client = services_of(request.app).client
    tenant: Tenant | None = getattr(request.state, TENANT_STATE, None)
    name = tenant.name if tenant is not None and tenant.record is not None else None
    work = client.generate(model=model, tenant=name, echo=True, max_tokens=1, affinity=False, **kwargs)
    return await until_disconnected(request.receive, work)
