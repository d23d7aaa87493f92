"""The arq job function: one request through the engine, every DELTA to Redis.

vLLM's ``async_llm_streaming.py`` pattern with Redis in place of ``print``. Around it: the
request is validated, the job holds a short lease, a cancel or a deadline ends it with a
final event, and a job that runs again after its worker died goes on from the replay log.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
from arq import Retry
from vllm import SamplingParams
from vllm.exceptions import VLLMValidationError
from vllm.inputs import TextPrompt, TokensPrompt
from vllm.lora.request import LoRARequest
from vllm.outputs import RequestOutput
from vllm.renderers.hf import resolve_chat_template_kwargs
from vllm.sampling_params import RepetitionDetectionParams, RequestOutputKind, StructuredOutputsParams
from vllm.v1.engine.async_llm import AsyncLLM
from vllm.v1.engine.exceptions import EngineDeadError

from streamq.protocol import (
    BAD_PAYLOAD_MARKER,
    ChatTemplateOptions,
    ErrorCode,
    FinishReason,
    GenerateRequest,
    InvalidRequest,
    is_valid_request_id,
    parse_request,
    task_refusal,
)
from worker import metrics
from worker.adapters import Adapters
from worker.chat_parsing import OutputParsing, RenderedChat
from worker.delivery import Delivery
from worker.engine import engine_priority
from worker.job_context import Generation, JobContext, JobOutcome, RequestSummary, Superseded
from worker.logprobs import LogprobsReader
from worker.pooling import encode_all
from worker.presence import Presence
from worker.progress import Progress, thread_tokenizer
from worker.prompt_options import engine_prompt, truncated
from worker.prompt_report import PromptReporter
from worker.publisher import PublishFailed, Refusal
from worker.regeneration import RegenerationDiffers, with_take_over_seed
from worker.request_events import RequestEvents
from worker.state import WorkerState
from worker.stats_report import RunningRequest

logger = logging.getLogger("streamq.worker")


class RequestFailed(Exception):
    """Ends a job as failed after its error event went out; arq records it and
    does not retry it (only ``arq.Retry`` is retried)."""


class OutOfStep(Exception):
    """The log lost events this attempt had written (a Redis that lost acknowledged
    writes): the job is handed back, and the next attempt goes on from what the log holds."""


async def generate(ctx: dict[str, Any], *args: Any, **kwargs: Any) -> JobOutcome:
    """arq job function (``arq worker.WorkerSettings`` runs it; ``python -m worker``'s job
    runner calls ``run_request`` itself)."""
    return await run_request(JobContext.of_arq(ctx), args, kwargs)


async def run_request(job: JobContext, args: Sequence[Any], kwargs: Mapping[str, Any]) -> JobOutcome:
    """One request, counted in the worker's metrics while it runs: validate the payload,
    run the generation, return its outcome. Raises ``RequestFailed`` once the request has
    its error event, ``arq.Retry`` to hand the job back.

    Takes any arguments so that a malformed job still reaches this function (arq
    would otherwise fail it with a ``TypeError`` the requester never sees).
    """
    metrics.QUEUE_WAIT.observe(max(0.0, job.state.clock.seconds_since(job.queued_at_ms)))
    with metrics.REQUESTS_IN_FLIGHT.track_inprogress():
        return await _run_request(job, args, kwargs)


async def _run_request(job: JobContext, args: Sequence[Any], kwargs: Mapping[str, Any]) -> JobOutcome:
    job_id = job.job_id
    # Errors go to the channel of the job id (which must equal the request id), or
    # to that of the claimed request id when the job id cannot name a channel.
    raw = args[0] if args else None
    claimed_id = raw.get("request_id") if isinstance(raw, dict) else None
    reply_to = next((i for i in (job_id, claimed_id) if is_valid_request_id(i)), None)
    state = job.state
    events = (
        RequestEvents(state.publisher, reply_to, attempt=job.attempt, worker_id=state.worker_id)
        if reply_to is not None
        else None
    )
    request: GenerateRequest | None = None
    try:
        request = _validate(job, args, kwargs)
        assert events is not None, "a valid request always has a channel"
        outcome = await _serve(job, request, events)
        if isinstance(outcome, RequestSummary):  # else the attempt that owns it ends it
            await _schedule_callback(state, reply_to, request)
        return outcome
    except (InvalidRequest, VLLMValidationError) as exc:
        code, message = ErrorCode.INVALID_REQUEST, str(exc)
    except (PublishFailed, OutOfStep) as exc:
        # Redis lost or refused this attempt's events: hand the job back; the next
        # attempt goes on from what the log holds (or ends it, when tries run out).
        logger.warning("request %s: %s; handing the job back", job_id, exc)
        raise Retry(defer=0) from None  # keeps its queue score: its enqueue time
    except EngineDeadError:
        # This worker is useless now: hand the job back (another worker takes it over
        # from the replay log) and let the worker exit non-zero.
        state.engine_died()
        raise Retry(defer=0) from None
    except RegenerationDiffers as exc:
        code, message = ErrorCode.WORKER_LOST, f"the worker running this request died, and {exc}"
    except Exception as exc:
        logger.exception("request %s: unexpected error", job_id)
        code, message = ErrorCode.INTERNAL, f"{type(exc).__name__}: {exc}"
    try:
        return await _fail_and_call_back(job, events, request, code, message)
    except OutOfStep as exc:
        logger.warning("request %s: %s; handing the job back", job_id, exc)
        raise Retry(defer=0) from None


async def _fail_and_call_back(
    job: JobContext, events: RequestEvents | None, request: GenerateRequest | None, code: str, message: str
) -> Superseded:
    """``_fail``, with the request's callback made due once its error event is out.
    Returns only when another attempt owns the request (its end is that attempt's)."""
    try:
        return await _fail(job, events, code, message)
    except RequestFailed:
        if events is not None:
            await _schedule_callback(job.state, events.request_id, request)
        raise


async def _schedule_callback(state: WorkerState, request_id: str | None, request: GenerateRequest | None) -> None:
    """Make the ended request's callback due: the one its job carries, else (a request
    refused before it could be read) one stored at enqueue. Never fails the job: a
    delivery that cannot be scheduled is logged."""
    callbacks = state.callbacks
    if callbacks is None or request_id is None or (request is not None and request.callback is None):
        return
    try:
        await callbacks.schedule(request_id, request.callback if request is not None else None)
    except Exception as exc:
        logger.error("request %s: cannot schedule its callback: %s", request_id, exc)


def _validate(job: JobContext, args: Sequence[Any], kwargs: Mapping[str, Any]) -> GenerateRequest:
    job_id = job.job_id
    if BAD_PAYLOAD_MARKER in kwargs:
        raise InvalidRequest(kwargs[BAD_PAYLOAD_MARKER])
    if len(args) != 1 or kwargs:
        raise InvalidRequest("a job takes exactly one positional argument, the request object, and no keywords")
    request = parse_request(args[0])
    if request.request_id != job_id:
        raise InvalidRequest(f"request_id {request.request_id!r} must equal the arq job id {job_id!r}")
    _check_model(request, job.state.presence, job.state.adapters)
    return request


def _check_model(request: GenerateRequest, presence: Presence, adapters: Adapters | None) -> None:
    """Refuse a request the engine cannot run (``task_refusal``: vLLM's messages), and one
    meant for another model: workers of two models sharing a queue would otherwise answer
    each other's requests with the wrong model. On a worker with LoRA adapters any other
    name is an adapter's, found (or refused by name) as it runs."""
    registration = presence.registration
    if (refusal := task_refusal(registration.engine_tasks, request.pooling)) is not None:
        raise InvalidRequest(refusal)
    served = registration.model
    if request.model is not None and request.model != served and adapters is None:
        raise InvalidRequest(
            f"request for model {request.model!r} reached a worker serving model {served!r} "
            f"(workers of different models must not share a queue)"
        )


def sampling_params_for(
    request: GenerateRequest, delivery: Delivery | None = None, rendered: RenderedChat | None = None
) -> SamplingParams:
    """``SamplingParams`` for ``request``, always DELTAs: every step's, or (``delivery``
    not streamed) a checkpoint's worth at a time; a request with tools takes what vLLM's
    renderer set (``rendered``): the tools' grammar, the parser's special tokens kept.

    vLLM validates the values here and raises ``VLLMValidationError``, a client error.
    """
    fields = request.sampling.to_dict()
    structured = fields.pop("structured_outputs", None)
    if structured is not None:
        fields["structured_outputs"] = StructuredOutputsParams(**msgspec.structs.asdict(structured))
    if rendered is not None:
        if rendered.structured_outputs is not None:
            fields["structured_outputs"] = rendered.structured_outputs
        fields["skip_special_tokens"] = fields.get("skip_special_tokens", True) and rendered.skip_special_tokens
    if (repetition := fields.get("repetition_detection")) is not None:
        fields["repetition_detection"] = RepetitionDetectionParams(**repetition)
    if (bias := fields.get("logit_bias")) is not None:  # clamped as ``SamplingParams.from_optional`` does
        fields["logit_bias"] = {int(token): min(100.0, max(-100.0, value)) for token, value in bias.items()}
    if delivery is not None:
        fields["stream_interval"] = delivery.stream_interval(fields.get("stream_interval"))
    return SamplingParams(**fields, output_kind=RequestOutputKind.DELTA)


@dataclass(frozen=True)
class _Prompt:
    """What the engine is given: token ids (``None``: a plain prompt, which vLLM tokenizes
    itself, in a thread of its own), and for a chat request with tools vLLM's rendering."""

    token_ids: list[int] | None
    rendered: RenderedChat | None = None


async def _prompt(state: WorkerState, request: GenerateRequest) -> _Prompt:
    """The request's prompt: a chat request with tools rendered by vLLM's renderer (as
    ``vllm serve`` renders it, tools in the template), any other as ``_prompt_token_ids``."""
    if request.tools is None:
        return _Prompt(_truncated(state.engine, request, await _prompt_token_ids(state.engine, request)))
    if state.chat_parsing is None:
        raise InvalidRequest("this worker's engine cannot serve tools (it has no vLLM renderer)")
    rendered = await state.chat_parsing.render(request)
    return _Prompt(_truncated(state.engine, request, rendered.prompt_token_ids), rendered)


def _truncated(engine: AsyncLLM, request: GenerateRequest, token_ids: list[int] | None) -> list[int] | None:
    """The prompt's token ids cut to ``truncate_prompt_tokens`` (a request that sets it has
    its text prompt tokenized here)."""
    if token_ids is None or request.truncate_prompt_tokens is None:
        return token_ids
    return truncated(token_ids, request, engine.model_config.max_model_len, engine.get_tokenizer())


async def _prompt_token_ids(engine: AsyncLLM, request: GenerateRequest) -> list[int] | None:
    """Token ids of a chat prompt (rendered with the chat template), of a token-id
    prompt (as given) or of a text prompt without special tokens; ``None`` for a plain
    prompt, which vLLM tokenizes itself (in a thread of its own).

    Rendering and tokenizing a long conversation takes long enough to stall the
    event loop (and with it lease renewal and every other request), so it runs in a
    thread, on a tokenizer copy of its own."""
    if request.prompt_token_ids is not None:
        return request.prompt_token_ids
    if request.prompt is not None:
        special = request.add_special_tokens is not False
        if special and request.truncate_prompt_tokens is None:
            return None
        return await asyncio.to_thread(_tokenize, engine.get_tokenizer(), request.prompt, special)
    assert request.messages is not None, "validated: a request has a prompt, token ids or messages"
    messages: list[Any] = [m.template_fields() for m in request.messages]
    options = request.chat_options or ChatTemplateOptions()
    special = bool(request.add_special_tokens)
    return await asyncio.to_thread(_render_chat, engine.get_tokenizer(), messages, options, special)


def _tokenize(engine_tokenizer: Any, prompt: str, add_special_tokens: bool) -> list[int]:
    """A text prompt's tokens, with or without the tokenizer's special tokens."""
    return list(thread_tokenizer(engine_tokenizer).encode(prompt, add_special_tokens=add_special_tokens))


def _render_chat(
    engine_tokenizer: Any, messages: list[Any], options: ChatTemplateOptions, add_special_tokens: bool
) -> list[int]:
    tokenizer = thread_tokenizer(engine_tokenizer)
    try:
        kwargs = {}
        if options.kwargs:  # only the variables the template uses, as vLLM passes them
            kwargs = resolve_chat_template_kwargs(tokenizer, tokenizer.get_chat_template(), options.kwargs)
        text = str(
            tokenizer.apply_chat_template(
                messages,
                tokenize=False,
                add_generation_prompt=options.add_generation_prompt,
                continue_final_message=options.continue_final_message,
                documents=options.documents,
                **kwargs,
            )
        )
    except Exception as exc:  # jinja errors, a model without a chat template, ...
        raise InvalidRequest(f"cannot render messages with the model's chat template: {exc}") from exc
    # The template holds the special tokens: more only where asked (as vLLM's add_special_tokens).
    return list(tokenizer.encode(text, add_special_tokens=add_special_tokens))


async def _serve(job: JobContext, request: GenerateRequest, events: RequestEvents) -> JobOutcome:
    """Run the request with its lease held, until its end is settled (an end that waits for
    its replicas may wait long), listed among the worker's running requests (its stats
    report) meanwhile."""
    state = job.state
    events.model = request.model or state.presence.registration.model
    try:
        with (
            state.leases.held(request.request_id, job.attempt, renew_now=not job.lease_set),
            state.running.track(request, events.attempt) as running,
        ):
            return await _run(job, request, events, running)
    finally:
        state.ended_jobs.add(job.job_id)


async def _run(job: JobContext, request: GenerateRequest, events: RequestEvents, running: RunningRequest) -> JobOutcome:
    """One request's flow, the same steps streamed or not (``worker/delivery.py`` holds the
    difference): take over what an earlier attempt logged, keep the deadlines, run the
    engine while each output is emitted, settle."""
    state = job.state
    if request.pooling is not None:
        return await _run_pooling(job, request, events)
    delivery = Delivery.of(request, state.checkpoint_tokens)
    events.checkpoint_tokens = delivery.checkpoint_tokens
    prompt = await _prompt(state, request)
    prompt_ids = prompt.token_ids
    lora = await _lora_request(state, request)
    # The seed a take-over would need to generate the request again is fixed now.
    params = with_take_over_seed(sampling_params_for(request, delivery, prompt.rendered), request.request_id)
    progress = await _take_over(state, request, events, params.n)
    cleared = await _clear_to_start(job, request, events, progress)
    if not isinstance(cleared, _Cleared):
        return cleared
    running.progress = progress
    time_left = cleared.time_left
    generation = await _generation(state.engine, request, progress, prompt_ids, params, delivery)
    if generation is None:  # finished (or out of budget) before the final event went out
        return await _end(job, events, request, progress, FinishReason.LENGTH)
    # The prompt's logprobs go out with the request's first chunk: an attempt that goes on
    # from tokens already sent does not send them again.
    first_run = isinstance(generation, _FirstRun)
    reporter = PromptReporter.for_request(request, params.prompt_logprobs, state.engine, with_prompt=first_run)
    reader = LogprobsReader.for_request(params, state.engine)
    parsing = _output_parsing(state, request, prompt, params.n, delivery, progress)
    readers = _Readers(reader, reporter, parsing)
    return await _run_engine(job, request, events, progress, generation, readers, time_left, lora)


@dataclass(frozen=True)
class _Cleared:
    """An attempt free to start its engine, for ``time_left`` seconds (``None``: no deadline)."""

    time_left: float | None


async def _clear_to_start(
    job: JobContext, request: GenerateRequest, events: RequestEvents, progress: Progress
) -> JobOutcome | _Cleared:
    """What ends an attempt before its engine starts, a generation's or a pooling
    request's alike: an earlier attempt's end (only arq's bookkeeping was lost), a newer
    attempt that took the request over first, a cancel heard before it started (a take-over
    of a cancelled request), a deadline passed; else how long it may run."""
    state = job.state
    if progress.ended:
        await _confirm_logged_end(state, events, progress)
        return progress.summary(request.request_id)
    if progress.superseded:
        return _yield_to_owner(request.request_id, events.attempt)
    if state.cancels.was_cancelled(request.request_id):
        return await _end(job, events, request, progress, FinishReason.CANCELLED)
    time_left = _time_left(state, job.queued_at_ms, request, events.attempt)
    if isinstance(time_left, FinishReason):
        return await _end(job, events, request, progress, time_left)
    return _Cleared(time_left)


async def _lora_request(state: WorkerState, request: GenerateRequest) -> LoRARequest | None:
    """The LoRA adapter the request names (``None``: the base model), loaded if need be."""
    if state.adapters is None or request.model is None or request.model == state.presence.registration.model:
        return None
    return await state.adapters.request_for(request.model)


def _output_parsing(
    state: WorkerState, request: GenerateRequest, prompt: _Prompt, n: int, delivery: Delivery, progress: Progress
) -> OutputParsing | None:
    """The parsers of a chat request's output on a worker that has them, fed what earlier
    attempts sent."""
    if state.chat_parsing is None or prompt.token_ids is None:
        return None
    parsing = state.chat_parsing.for_request(
        request, prompt.rendered, n, streamed=delivery.streamed, prompt_token_ids=prompt.token_ids
    )
    if parsing is not None:
        for index in range(n):
            parsing.replay(index, progress.texts[index], progress.chunk_token_ids[index])
    return parsing


async def _take_over(state: WorkerState, request: GenerateRequest, events: RequestEvents, n: int) -> Progress:
    """The request's progress: none for a first attempt; for a later one, what the earlier
    attempts logged (earlier attempts fenced off), its events numbered on from there."""
    if events.attempt == 1:
        return Progress(n)
    progress = await Progress.take_over(state.replay_log, request.request_id, events.attempt, n)
    if not (progress.ended or progress.superseded):
        events.go_on_from(progress.next_seq)
        logger.info(
            "request %s: attempt %d takes over after %d tokens",
            request.request_id,
            events.attempt,
            progress.completion_tokens,
        )
    return progress


async def _confirm_logged_end(state: WorkerState, events: RequestEvents, progress: Progress) -> None:
    """A take-over that finds its request ended: the earlier attempt's worker may have died
    after logging the end and before its replicas had it (or before publishing it), so the
    logged end goes through the publisher's end confirmer again (a duplicate for the log:
    waited for, published again) before arq's acknowledgement. Nothing to wait for: nothing
    to do. A failure raises ``PublishFailed`` (the job is handed back)."""
    durability = state.replay_log.durability
    if progress.logged_end is None or durability is None or not durability.waits:
        return
    seq, raw = progress.logged_end
    state.publisher.publish(events.request_id, seq, events.attempt, raw, terminal=True)
    await state.publisher.flushed(events.request_id)


def _time_left(
    state: WorkerState, queued_at_ms: int, request: GenerateRequest, attempt: int
) -> float | None | FinishReason:
    """Seconds left before the request's deadline (``None``: it has none), or the finish
    reason that ends it at once: it waited past its ``queue_timeout_s``, or its
    ``deadline_s`` passed, both counted from its enqueue on Redis's clock."""
    waited = state.clock.seconds_since(queued_at_ms)
    if request.queue_timeout_s is not None and attempt == 1 and waited > request.queue_timeout_s:
        return FinishReason.QUEUE_TIMEOUT
    if request.deadline_s is None:
        return None
    time_left = request.deadline_s - waited
    return time_left if time_left > 0 else FinishReason.TIMEOUT


class _FirstRun:
    """A request's generation from its prompt: the engine's own outputs."""

    def __init__(self, prompt: str | TextPrompt | TokensPrompt, params: SamplingParams) -> None:
        self._prompt = prompt
        self._params = params

    def generate(
        self, engine: AsyncLLM, request_id: str, priority: int = 0, **engine_kwargs: Any
    ) -> AsyncIterator[RequestOutput]:
        return engine.generate(
            request_id=request_id,
            prompt=self._prompt,
            sampling_params=self._params,
            priority=priority,
            **engine_kwargs,
        )


async def _generation(
    engine: AsyncLLM,
    request: GenerateRequest,
    progress: Progress,
    prompt_ids: list[int] | None,
    params: SamplingParams,
    delivery: Delivery,
) -> Generation | None:
    """What generates the request's outputs: from its prompt (its end only, where it fits in
    a checkpoint: ``Delivery.whole``), or after a take-over the rest of the answer
    (``Progress.continuation``); ``None`` when nothing is left to generate."""
    if progress.completion_tokens:
        return await progress.continuation(engine, request, prompt_ids, params)
    if delivery.whole(params.max_tokens):
        params = params.clone()
        params.output_kind = RequestOutputKind.FINAL_ONLY
    prompt = request.prompt if prompt_ids is None else prompt_ids
    assert prompt is not None, "validated: a request has a prompt or messages"
    return _FirstRun(engine_prompt(prompt, request.cache_salt), params)


async def _run_engine(
    job: JobContext,
    request: GenerateRequest,
    events: RequestEvents,
    progress: Progress,
    generation: Generation,
    readers: _Readers,
    time_left: float | None,
    lora: LoRARequest | None = None,
) -> JobOutcome:
    """Run the generation with the request's cancel heard, emitting each output; then
    settle. A cancel or the deadline ends it with a final event; the worker's shutdown hands
    it back (the ``CancelledError`` goes on to the job runner)."""
    state = job.state
    engine: AsyncLLM = state.engine
    cancels = state.cancels
    if getattr(engine, "errored", False):
        raise EngineDeadError("the engine is dead")
    started = time.monotonic()
    this_run = (request.request_id, events.attempt)
    # One line per request at INFO (its end); a take-over's start is worth one more.
    logger.log(logging.INFO if events.attempt > 1 else logging.DEBUG, "request %s started (attempt %d)", *this_run)
    try:
        with cancels.registered(*this_run):
            async with asyncio.timeout(time_left):
                priority = engine_priority(engine, request.priority, taken_over=events.attempt > 1)
                # A reasoning parser's state, as vllm serve hands it to the engine (none otherwise).
                extra = readers.parsing.engine_kwargs() if readers.parsing is not None else {}
                if lora is not None:
                    extra["lora_request"] = lora
                await job.admission.wait()  # behind the take-overs started before it
                outputs = generation.generate(engine, request.request_id, priority, **extra)
                async for output in outputs:  # its first output: in the engine, the jobs behind may follow
                    job.admission.entered()
                    _emit(events, progress, output, readers)
                    break
                async for output in outputs:  # the rest, off the admission's books
                    _emit(events, progress, output, readers)
    except asyncio.CancelledError:
        stop = cancels.take_stop(request.request_id, events.attempt)
        if stop is None and not cancels.was_cancelled(request.request_id):
            raise  # worker shutdown: arq hands the job back, another worker takes it over
        asyncio.current_task().uncancel()  # type: ignore[union-attr]
        if stop is None:
            return await _end(job, events, request, progress, FinishReason.CANCELLED)
        if await _settle(state, events, stop) is not None:
            return _yield_to_owner(request.request_id, events.attempt)
    except TimeoutError:
        return await _end(job, events, request, progress, FinishReason.TIMEOUT)
    else:
        if await _settle(state, events) is not None:
            return _yield_to_owner(request.request_id, events.attempt)
    logger.info(
        "request %s finished: %s, %d prompt + %d completion tokens in %.2fs",
        request.request_id,
        ",".join(str(r) for r in progress.finish_reasons),
        progress.prompt_tokens,
        progress.completion_tokens,
        time.monotonic() - started,
    )
    return progress.summary(request.request_id)


async def _run_pooling(job: JobContext, request: GenerateRequest, events: RequestEvents) -> JobOutcome:
    """A pooling request's flow (``worker/pooling.py``): as a generation's, with no tokens
    to go on from, so a take-over runs its inputs again."""
    state = job.state
    engine: AsyncLLM = state.engine
    progress = await _take_over(state, request, events, 1)
    cleared = await _clear_to_start(job, request, events, progress)
    if not isinstance(cleared, _Cleared):
        return cleared
    time_left = cleared.time_left
    if getattr(engine, "errored", False):
        raise EngineDeadError("the engine is dead")
    this_run = (request.request_id, events.attempt)
    started = time.monotonic()
    try:
        with state.cancels.registered(*this_run):
            async with asyncio.timeout(time_left):
                priority = engine_priority(engine, request.priority, taken_over=events.attempt > 1)
                await job.admission.wait()
                results = await encode_all(engine, request, priority, job.admission.entered)
    except asyncio.CancelledError:
        stop = state.cancels.take_stop(request.request_id, events.attempt)
        if stop is None and not state.cancels.was_cancelled(request.request_id):
            raise  # worker shutdown: arq hands the job back
        asyncio.current_task().uncancel()  # type: ignore[union-attr]
        if stop is None:
            return await _end(job, events, request, progress, FinishReason.CANCELLED)
        if await _settle(state, events, stop) is not None:
            return _yield_to_owner(request.request_id, events.attempt)
        return progress.summary(request.request_id)
    except TimeoutError:
        return await _end(job, events, request, progress, FinishReason.TIMEOUT)
    progress.finish_reasons = [FinishReason.STOP.value]
    progress.set_prompt_tokens(sum(results.prompt_tokens))
    events.pooled(results.shapes, results.prompt_tokens, results.data)
    events.final(progress.finish_reasons, progress.prompt_tokens, 0)
    if await _settle(state, events) is not None:
        return _yield_to_owner(request.request_id, events.attempt)
    logger.info(
        "request %s finished: %d inputs, %d prompt tokens in %.2fs",
        request.request_id,
        len(results.shapes),
        progress.prompt_tokens,
        time.monotonic() - started,
    )
    return progress.summary(request.request_id)


@dataclass(frozen=True)
class _Readers:
    """What an attempt takes from the engine's outputs beyond text and tokens, when the
    request asked for it: each token's logprobs, and the prompt's report (first chunk)."""

    logprobs: LogprobsReader | None
    prompt: PromptReporter | None
    parsing: OutputParsing | None = None
    """A chat request's tool and reasoning parsers."""


def _emit(events: RequestEvents, progress: Progress, output: RequestOutput, readers: _Readers) -> None:
    """Hand one engine output to the request's events (its DELTAs, with the logprobs,
    prompt report and parsed message the request asked for; the final event once it
    finished) and tally its tokens."""
    prompt = readers.prompt.report(output) if readers.prompt is not None else None
    reader = readers.logprobs
    parsing = readers.parsing
    for completion in output.outputs:
        logprobs = reader.sample(completion) if reader is not None else None
        parsed = None
        # A prefill step with nothing in it is not parsed (nor sent), as in ``vllm serve``.
        if parsing is not None and (completion.text or completion.token_ids or progress.token_ids[completion.index]):
            parsed = parsing.chunk(completion.index, completion.text, completion.token_ids, completion.finish_reason)
        events.chunk(
            completion.index, completion.text, completion.token_ids, completion.finish_reason, logprobs, prompt, parsed
        )
        prompt = None
        progress.add(completion.index, completion.token_ids, completion.finish_reason)
    if output.finished:
        progress.set_prompt_tokens(len(output.prompt_token_ids or ()))
        events.final(progress.finish_reasons, progress.prompt_tokens, progress.completion_tokens)


async def _settle(state: WorkerState, events: RequestEvents, stop: Refusal | None = None) -> Refusal | None:
    """Wait until every event of this attempt has reached Redis, then say whether it still
    owns the request: ``None`` if its events were logged (its end too, if it wrote one),
    ``SUPERSEDED`` if another attempt owns the request or ended it. An attempt ``stop``ped
    before it wrote its end leaves that end to the owner. Raises ``OutOfStep`` when the log
    lost events it had written."""
    await events.delivered()
    refusal = state.publisher.take_refusal(events.request_id, events.attempt)
    if refusal is None and not events.closed:
        refusal = stop
    if refusal is Refusal.OUT_OF_STEP:
        raise OutOfStep(f"the log lost events attempt {events.attempt} had written")
    return refusal


def _yield_to_owner(request_id: str, attempt: int) -> Superseded:
    """The outcome of an attempt that stopped because another attempt owns its request
    (or ended it): the end, arq's bookkeeping and the callback are that attempt's."""
    logger.info("request %s: attempt %d stopped; the attempt that owns the request ends it", request_id, attempt)
    return Superseded(request_id=request_id)


async def _end(
    job: JobContext, events: RequestEvents, request: GenerateRequest, progress: Progress, reason: FinishReason
) -> JobOutcome:
    """End the request early: unfinished completions get ``reason``."""
    progress.end_unfinished(reason)
    events.final(progress.finish_reasons, progress.prompt_tokens, progress.completion_tokens)
    if await _settle(job.state, events) is not None:
        return _yield_to_owner(request.request_id, events.attempt)
    logger.info("request %s ended: %s after %d tokens", request.request_id, reason, progress.completion_tokens)
    return progress.summary(request.request_id)


async def _fail(job: JobContext, events: RequestEvents | None, code: str, message: str) -> Superseded:
    """Tell the requester why their request failed, then fail the job; unless another
    attempt owns the request, whose end it is (then this attempt's outcome says so)."""
    logger.warning("request %s failed (%s): %s", job.job_id, code, message)
    metrics.REQUEST_ERRORS.labels(code=code).inc()
    if events is not None and not events.closed:
        events.error(code, message)
        if await _settle(job.state, events) is not None:
            return _yield_to_owner(events.request_id, events.attempt)
    raise RequestFailed(f"{code}: {message}")
