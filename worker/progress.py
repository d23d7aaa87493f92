"""How far a request has got, and how a request taken over from a dead worker goes on.

As in NVIDIA Dynamo's request migration, the prompt plus the tokens already sent become
the new prompt and only the remaining budget is generated (``Continuation``), where that
gives what an undisturbed run would have: one completion, no structured outputs, no
penalties that count generated tokens, greedy or unseeded sampling. Every other request
is generated again from the start with the same seed and what was already sent is
suppressed (``worker/regeneration.py``). The subscriber sees the text an undisturbed run
would have sent, or, where the engine does not reproduce it, a ``worker_lost`` error.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import logging
import weakref
from collections.abc import AsyncIterator, Sequence
from types import SimpleNamespace
from typing import Any

import msgspec
from vllm import SamplingParams
from vllm.outputs import RequestOutput
from vllm.v1.engine.async_llm import AsyncLLM
from vllm.v1.engine.detokenizer import IncrementalDetokenizer

from streamq.broker.replay_log import ReplayLog
from streamq.protocol import ChunkEvent, ErrorEvent, FinalEvent, FinishReason, GenerateRequest, decode_event
from worker.job_context import RequestSummary
from worker.prompt_options import engine_prompt
from worker.regeneration import Regeneration, regeneration_reason

logger = logging.getLogger("streamq.worker")

_thread_tokenizers: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()


def thread_tokenizer(tokenizer: Any) -> Any:
    """A private copy of the engine's ``tokenizer`` for streamq's own work in threads
    (call it in the thread: the first call copies).

    vLLM tokenizes in a thread of its own with truncation settings, which a fast
    tokenizer keeps as mutable state; sharing one across threads can fail with
    "Already borrowed". The copy is made once per engine tokenizer.
    """
    try:
        return _thread_tokenizers[tokenizer]
    except KeyError:
        private = _thread_tokenizers[tokenizer] = copy.deepcopy(tokenizer)
        return private


class Progress:
    """Tokens generated and finish reasons so far, per completion index."""

    def __init__(self, n: int) -> None:
        self.token_ids: list[list[int]] = [[] for _ in range(n)]
        self.texts: list[list[str]] = [[] for _ in range(n)]
        """Text already sent, per completion; filled only by ``take_over`` (the hot path tallies tokens only)."""
        self.chunk_token_ids: list[list[list[int]]] = [[] for _ in range(n)]
        """The tokens of each chunk of ``texts`` (a parser is fed them chunk by chunk)."""
        self.finish_reasons: list[str | None] = [None] * n
        self.prompt_tokens = 0
        self.next_seq = 0
        self.ended = False
        self.logged_end: tuple[int, bytes] | None = None
        """The terminal event an earlier attempt logged (its seq and its bytes), if it ended."""
        self.superseded = False
        """A newer attempt owned the request when this one took it over."""

    @property
    def completion_tokens(self) -> int:
        return sum(map(len, self.token_ids))

    def add(self, index: int, token_ids: Sequence[int], finish_reason: str | None) -> None:
        self.token_ids[index].extend(token_ids)
        if finish_reason is not None:
            self.finish_reasons[index] = finish_reason

    def set_prompt_tokens(self, count: int) -> None:
        """Record the prompt's length, unless a continuation already recorded the original's."""
        if not self.prompt_tokens:
            self.prompt_tokens = count

    def end_unfinished(self, reason: str) -> None:
        self.finish_reasons = [r if r is not None else reason for r in self.finish_reasons]

    def summary(self, request_id: str) -> RequestSummary:
        """The job's result as arq stores it."""
        return RequestSummary(
            request_id=request_id,
            finish_reasons=list(self.finish_reasons),
            prompt_tokens=self.prompt_tokens,
            completion_tokens=self.completion_tokens,
        )

    @classmethod
    async def take_over(cls, log: ReplayLog, request_id: str, attempt: int, n: int) -> Progress:
        """Fence off earlier attempts of ``request_id`` and rebuild what they published."""
        progress = cls(n)
        taken = await log.take_over(request_id, attempt)
        for raw in taken.entries:
            try:
                event = decode_event(raw)
            except msgspec.DecodeError:
                continue
            progress.next_seq = event.seq + 1
            if isinstance(event, ChunkEvent) and event.index < n:
                progress.add(event.index, event.token_ids, event.finish_reason)
                progress.texts[event.index].append(event.text)
                progress.chunk_token_ids[event.index].append(event.token_ids)
            elif isinstance(event, FinalEvent):
                progress.ended = True
                progress.logged_end = (event.seq, raw)
                progress.finish_reasons = list(event.finish_reasons)
                progress.prompt_tokens = event.prompt_tokens
            elif isinstance(event, ErrorEvent):
                progress.ended = True
                progress.logged_end = (event.seq, raw)
        progress.superseded = not taken.owns and not progress.ended
        return progress

    async def continuation(
        self, engine: AsyncLLM, request: GenerateRequest, prompt_ids: list[int] | None, params: SamplingParams
    ) -> Continuation | Regeneration | None:
        """What generates the rest of the answer; ``None`` when nothing is left to
        generate (every completion finished, or spent its budget, but the final event
        was lost)."""
        if all(
            finish is not None or (params.max_tokens is not None and params.max_tokens <= len(generated))
            for generated, finish in zip(self.token_ids, self.finish_reasons, strict=True)
        ):
            return None
        prompt: str | list[int] | None = request.prompt if prompt_ids is None else prompt_ids
        assert prompt is not None, "validated: a request has a prompt or messages"
        reason = regeneration_reason(params)
        if reason is not None:
            return Regeneration(
                engine_prompt(prompt, request.cache_salt),
                params,
                self.token_ids,
                ["".join(texts) for texts in self.texts],
                self.finish_reasons,
                reason=reason,
            )
        generated = self.token_ids[0]
        tokenizer = engine.get_tokenizer()
        sent_text = "".join(self.texts[0])
        tokenized, detokenizer = await asyncio.to_thread(
            _replayed_detokenizer,
            request.request_id,
            tokenizer,
            prompt,
            generated,
            sent_text,
            params,
        )
        self.prompt_tokens = len(tokenized)
        return Continuation(tokenized, params, generated, detokenizer, request.cache_salt)


def _replayed_detokenizer(
    request_id: str,
    tokenizer: Any,
    prompt: str | list[int],
    generated: list[int],
    sent_text: str,
    params: SamplingParams,
) -> tuple[list[int], IncrementalDetokenizer]:
    """The prompt's token ids, and vLLM's incremental detokenizer for the original
    request in the state it was in once the tokens already sent had been generated
    (blocking work: run it in a thread).

    The text it has released is checked against what the subscriber got."""
    tokenizer = thread_tokenizer(tokenizer)
    # A plain prompt is tokenized as vLLM's renderer does (with special tokens).
    prompt_ids = list(tokenizer.encode(prompt)) if isinstance(prompt, str) else prompt
    request = SimpleNamespace(
        request_id=request_id, prompt_token_ids=prompt_ids, prompt_embeds=None, sampling_params=params
    )
    detokenizer = IncrementalDetokenizer.from_new_request(tokenizer, request)  # type: ignore[arg-type]
    stop = getattr(detokenizer, "stop", [])
    # No stop string ended the earlier attempt within these tokens (the completion
    # would have finished): skip the checks while replaying them.
    detokenizer.stop = []  # type: ignore[attr-defined]
    for token_id in generated:
        detokenizer.update([token_id], False)
    detokenizer.stop = stop  # type: ignore[attr-defined]
    released = detokenizer.get_next_output_text(finished=False, delta=True)
    if released != sent_text:
        logger.warning(
            "request %s: the text sent (%d characters) differs from its tokens' text (%d characters)",
            request_id,
            len(sent_text),
            len(released),
        )
    return prompt_ids, detokenizer


class Continuation:
    """Generates the rest of a taken-over completion as ``RequestOutput`` DELTAs that
    carry exactly what the undisturbed run would have sent from here on, from the
    prompt plus the tokens already sent (for requests whose engine state is all in
    those tokens: see ``regeneration_reason``).

    This attempt detokenizes the whole answer itself (vLLM's incremental detokenizer,
    primed with the prompt and fed the tokens already sent), so text held back for a
    possible stop string is released, and stop strings are found across the point where the
    earlier attempt stopped.
    """

    def __init__(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        generated: list[int],
        detokenizer: IncrementalDetokenizer,
        cache_salt: str | None = None,
    ) -> None:
        self._prompt_ids = prompt_ids
        self._cache_salt = cache_salt
        self._params = params
        self._generated = generated
        self._detokenizer = detokenizer

    async def generate(
        self, engine: AsyncLLM, request_id: str, priority: int = 0, **engine_kwargs: Any
    ) -> AsyncIterator[RequestOutput]:
        """The engine's outputs for the rest of the answer, ending with a finished one;
        detokenized, and stop strings checked, here."""
        params = self._params.clone()
        generated = len(self._generated)
        if params.max_tokens is not None:
            params.max_tokens -= generated
        params.min_tokens = max(0, params.min_tokens - generated)
        # The text is this attempt's detokenizer's, so the engine need not make any.
        params.stop = []
        params.output_text_buffer_length = 0
        params.detokenize = False
        params.prompt_logprobs = None  # they went out with the first chunk already
        prompt = engine_prompt(self._prompt_ids + self._generated, self._cache_salt)
        detokenizer = self._detokenizer
        async with contextlib.aclosing(
            engine.generate(
                request_id=request_id, prompt=prompt, sampling_params=params, priority=priority, **engine_kwargs
            )
        ) as outputs:
            async for output in outputs:
                completion = output.outputs[0]
                token_ids = list(completion.token_ids)
                before = detokenizer.num_output_tokens()
                stop_string = detokenizer.update(token_ids, completion.finish_reason == FinishReason.STOP)
                if stop_string is not None:
                    del token_ids[detokenizer.num_output_tokens() - before :]
                    if completion.logprobs is not None:  # one entry per token: cut alike
                        completion.logprobs = completion.logprobs[: len(token_ids)]
                    completion.finish_reason, completion.stop_reason = FinishReason.STOP, stop_string
                    output.finished = True
                completion.token_ids = token_ids
                completion.text = detokenizer.get_next_output_text(output.finished, delta=True)
                yield output
                if output.finished:
                    return  # closing the engine's generator aborts a request a stop string ended
