"""Anthropic's Messages API, as ``vllm serve`` answers it: ``/v1/messages`` (through the one
request path of ``gateway.routes.completions``, with the Messages face) and
``/v1/messages/count_tokens`` (the prompt's tokens as the model's chat template renders
them, counted by a worker as the tokenizer routes count them: a prefill of one token).
"""

from __future__ import annotations

from anthropic.types import MessageTokensCount
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from gateway.faces_messages import MESSAGES_FACE, MESSAGES_PATH
from gateway.messages_request import count_tokens_to_chat
from gateway.routes.completions import json_body, respond
from gateway.routes.tokenizer import echo_prompt, resolve_model
from producer.openai_api.requests import chat_request_to_submit_kwargs

router = APIRouter()

_PROMPT_KWARGS = ("messages", "chat_options", "add_special_tokens", "tools")
"""What of a chat request's ``submit`` arguments renders its prompt."""


@router.post(MESSAGES_PATH)
async def messages(request: Request) -> Response:
    return await respond(request, MESSAGES_FACE)


@router.post(MESSAGES_PATH + "/count_tokens")
async def count_tokens(request: Request) -> Response:
    try:
        body = await json_body(request)
        chat = count_tokens_to_chat(body)
        model = await resolve_model(request, chat["model"])
        kwargs = chat_request_to_submit_kwargs(chat)
        completion = await echo_prompt(request, model, {k: kwargs[k] for k in _PROMPT_KWARGS if k in kwargs})
        assert completion.prompt_token_ids is not None, "echo brings the prompt's token ids back"
        tokens = len(completion.prompt_token_ids)
        counted = MessageTokensCount(input_tokens=tokens).model_dump(mode="json")
        # vllm serve adds the count before any context management (none here: the same)
        return JSONResponse({**counted, "context_management": {"original_input_tokens": tokens}})
    except Exception as exc:
        return MESSAGES_FACE.error_response(exc)
