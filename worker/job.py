"""The arq job function: one request through the engine, every DELTA to pub/sub.

This is vLLM's ``async_llm_streaming.py`` pattern with Redis in place of ``print``:
``SamplingParams(output_kind=DELTA)``, ``async for output in engine.generate(...)``,
publish each completion's delta, stop at ``output.finished``.
"""

from __future__ import annotations

import logging
import time
from typing import Any, NoReturn

from vllm import SamplingParams
from vllm.exceptions import VLLMValidationError
from vllm.inputs import TokensPrompt
from vllm.sampling_params import RequestOutputKind
from vllm.v1.engine.async_llm import AsyncLLM
from vllm.v1.engine.exceptions import EngineDeadError

from producer.protocol import (
    BAD_PAYLOAD_MARKER,
    GenerateRequest,
    InvalidRequest,
    is_valid_request_id,
    parse_request,
)
from worker.publisher import EventPublisher
from worker.stream import RequestStream

logger = logging.getLogger("streamq.worker")


class RequestFailed(Exception):
    """Ends a job as failed after its error event went out; arq records it and
    does not retry it (only ``arq.Retry`` is retried)."""


async def generate(ctx: dict[str, Any], *args: Any, **kwargs: Any) -> dict[str, Any]:
    """arq job: validate the payload, stream the generation, return a summary.

    Takes any arguments so that a malformed job still reaches this function (arq
    would otherwise fail it with a ``TypeError`` the requester never sees).
    """
    job_id: str = ctx["job_id"]
    publisher: EventPublisher = ctx["publisher"]
    # Errors go to the channel of the job id (which must equal the request id), or
    # to that of the claimed request id when the job id cannot name a channel.
    raw = args[0] if args else None
    claimed_id = raw.get("request_id") if isinstance(raw, dict) else None
    reply_to = next((i for i in (job_id, claimed_id) if is_valid_request_id(i)), None)
    stream = RequestStream(publisher, reply_to) if reply_to is not None else None

    try:
        request = _validate(job_id, args, kwargs)
        assert stream is not None, "a valid request always has a channel"
        return await _run(ctx["engine"], request, stream)
    except (InvalidRequest, VLLMValidationError) as exc:
        code, message = "invalid_request", str(exc)
    except EngineDeadError as exc:
        code, message = "engine_dead", f"the engine of this worker died: {exc}"
    except Exception as exc:
        logger.exception("request %s: unexpected error", job_id)
        code, message = "internal", f"{type(exc).__name__}: {exc}"
    await _fail(stream, job_id, code, message)


def _validate(job_id: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> GenerateRequest:
    if BAD_PAYLOAD_MARKER in kwargs:
        raise InvalidRequest(kwargs[BAD_PAYLOAD_MARKER])
    if len(args) != 1 or kwargs:
        raise InvalidRequest("a job takes exactly one positional argument, the request object, and no keywords")
    request = parse_request(args[0])
    if request.request_id != job_id:
        raise InvalidRequest(f"request_id {request.request_id!r} must equal the arq job id {job_id!r}")
    return request


def sampling_params_for(request: GenerateRequest) -> SamplingParams:
    """``SamplingParams`` for ``request``, always streaming DELTAs.

    vLLM validates the values here and raises ``VLLMValidationError``, a client error.
    """
    return SamplingParams(**request.sampling.to_dict(), output_kind=RequestOutputKind.DELTA)


def _prompt_for(engine: AsyncLLM, request: GenerateRequest) -> str | TokensPrompt:
    if request.prompt is not None:
        return request.prompt
    assert request.messages is not None
    tokenizer = engine.get_tokenizer()
    messages = [{"role": m.role, "content": m.content} for m in request.messages]
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    except Exception as exc:  # jinja errors, a model without a chat template, ...
        raise InvalidRequest(f"cannot render messages with the model's chat template: {exc}") from exc
    # The template already holds any special tokens, so tokenize without adding more.
    return TokensPrompt(prompt_token_ids=tokenizer.encode(text, add_special_tokens=False))


async def _run(engine: AsyncLLM, request: GenerateRequest, stream: RequestStream) -> dict[str, Any]:
    params = sampling_params_for(request)
    prompt = _prompt_for(engine, request)
    started = time.monotonic()
    logger.info("request %s started", request.request_id)
    completion_tokens = 0
    finish_reasons: list[str | None] = [None] * params.n
    prompt_tokens = 0
    async for output in engine.generate(request_id=request.request_id, prompt=prompt, sampling_params=params):
        for completion in output.outputs:
            stream.chunk(completion.index, completion.text, completion.token_ids, completion.finish_reason)
            completion_tokens += len(completion.token_ids)
            if completion.finish_reason is not None:
                finish_reasons[completion.index] = completion.finish_reason
        if output.finished:
            prompt_tokens = len(output.prompt_token_ids or ())
            stream.final(finish_reasons, prompt_tokens, completion_tokens)
    await stream.delivered()
    logger.info(
        "request %s finished: %s, %d prompt + %d completion tokens in %.2fs",
        request.request_id,
        ",".join(str(r) for r in finish_reasons),
        prompt_tokens,
        completion_tokens,
        time.monotonic() - started,
    )
    return {
        "request_id": request.request_id,
        "finish_reasons": finish_reasons,
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
    }


async def _fail(stream: RequestStream | None, job_id: str, code: str, message: str) -> NoReturn:
    """Tell the requester why their request failed, then fail the job."""
    logger.warning("request %s failed (%s): %s", job_id, code, message)
    if stream is not None and not stream.closed:
        stream.error(code, message)
        await stream.delivered()
    raise RequestFailed(f"{code}: {message}")
