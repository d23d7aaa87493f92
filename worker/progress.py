"""How far a request has got, and how a request taken over from a dead worker goes on.

As in NVIDIA Dynamo's request migration, the prompt plus the tokens already sent become
the new prompt and only the remaining budget is generated; where the engine's state cannot
be carried over (penalties, a seed) the request is generated again and what was already
sent is suppressed. The subscriber sees the text an undisturbed run would have sent.
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
from vllm.inputs import TokensPrompt
from vllm.outputs import RequestOutput
from vllm.sampling_params import SamplingType
from vllm.v1.engine.async_llm import AsyncLLM
from vllm.v1.engine.detokenizer import IncrementalDetokenizer

from streamq.broker.replay_log import ReplayLog
from streamq.protocol import ChunkEvent, ErrorEvent, FinalEvent, FinishReason, GenerateRequest, decode_event

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


class NotResumable(Exception):
    """The request's earlier output cannot be continued (``n > 1``)."""


class Progress:
    """Tokens generated and finish reasons so far, per completion index."""

    def __init__(self, n: int) -> None:
        self.token_ids: list[list[int]] = [[] for _ in range(n)]
        self.texts: list[list[str]] = [[] for _ in range(n)]
        """Text already sent, per completion; filled only by ``take_over`` (the hot path tallies tokens only)."""
        self.finish_reasons: list[str | None] = [None] * n
        self.prompt_tokens = 0
        self.next_seq = 0
        self.ended = False

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

    def summary(self, request_id: str) -> dict[str, object]:
        """The job's result as arq stores it."""
        return {
            "request_id": request_id,
            "finish_reasons": self.finish_reasons,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
        }

    @classmethod
    async def take_over(cls, log: ReplayLog, request_id: str, attempt: int, n: int) -> Progress:
        """Fence off earlier attempts of ``request_id`` and rebuild what they published."""
        progress = cls(n)
        for raw in await log.take_over(request_id, attempt):
            try:
                event = decode_event(raw)
            except msgspec.DecodeError:
                continue
            progress.next_seq = event.seq + 1
            if isinstance(event, ChunkEvent) and event.index < n:
                progress.add(event.index, event.token_ids, event.finish_reason)
                progress.texts[event.index].append(event.text)
            elif isinstance(event, FinalEvent):
                progress.ended = True
                progress.finish_reasons = list(event.finish_reasons)
                progress.prompt_tokens = event.prompt_tokens
            elif isinstance(event, ErrorEvent):
                progress.ended = True
        return progress

    async def continuation(
        self, engine: AsyncLLM, request: GenerateRequest, chat_ids: list[int] | None, params: SamplingParams
    ) -> Continuation | None:
        """What generates the rest of the answer; ``None`` when nothing is left to
        generate (the completion finished, or its budget is spent, but the final
        event was lost).

        Raises ``NotResumable`` for ``n > 1``: the completions share one engine
        request, which cannot be restarted from several different prefixes.
        """
        if len(self.token_ids) > 1:
            raise NotResumable("a request with n > 1 cannot continue on another worker")
        generated = self.token_ids[0]
        if self.finish_reasons[0] is not None or (
            params.max_tokens is not None and params.max_tokens <= len(generated)
        ):
            return None
        tokenizer = engine.get_tokenizer()
        sent_text = "".join(self.texts[0])
        prompt: str | list[int] | None = request.prompt if chat_ids is None else chat_ids
        assert prompt is not None, "validated: a request has a prompt or messages"
        prompt_ids, detokenizer = await asyncio.to_thread(
            _replayed_detokenizer,
            request.request_id,
            tokenizer,
            prompt,
            generated,
            sent_text,
            params,
        )
        self.prompt_tokens = len(prompt_ids)
        regenerate = _needs_regeneration(params)
        return Continuation(prompt_ids, params, generated, sent_text, detokenizer, regenerate=regenerate)


def _counts_output(params: SamplingParams) -> bool:
    """Penalties that count generated tokens only: after a continuation those tokens are
    part of the prompt, so the engine would no longer count them."""
    return bool(params.presence_penalty) or bool(params.frequency_penalty)


def _needs_regeneration(params: SamplingParams) -> bool:
    """Whether continuing from a longer prompt would change what the engine samples,
    yet generating again from the start reproduces it (greedy, or seeded)."""
    if params.sampling_type == SamplingType.GREEDY:
        return _counts_output(params)
    return params.sampling_type == SamplingType.RANDOM_SEED


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
    carry exactly what the undisturbed run would have sent from here on.

    This attempt detokenizes the whole answer itself (vLLM's incremental detokenizer,
    primed with the prompt and fed the tokens already sent), so text held back for a
    possible stop string is released, and stop strings are found across the resume point.
    """

    def __init__(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        generated: list[int],
        sent_text: str,
        detokenizer: IncrementalDetokenizer,
        *,
        regenerate: bool,
    ) -> None:
        self._prompt_ids = prompt_ids
        self._params = params
        self._generated = generated
        self._sent_text = sent_text
        self._detokenizer = detokenizer
        self.regenerate = regenerate
        self.exact = regenerate or not _counts_output(params) or params.sampling_type == SamplingType.GREEDY
        """False once the rest may differ from an undisturbed run (see ``FinalEvent.approximate``)."""

    async def generate(self, engine: AsyncLLM, request_id: str) -> AsyncIterator[RequestOutput]:
        """The engine's outputs for the rest of the answer, ending with a finished one."""
        if self.regenerate:
            logger.info(
                "request %s: penalties or a seed carry state: generating again from the start, sending only the rest",
                request_id,
            )
            async for output in self._regenerate(engine, request_id):
                yield output
                if output.finished:
                    return
            self.exact = False
            logger.warning(
                "request %s: the generation from the start differs from the tokens sent; "
                "continuing from them instead (the rest may differ from an undisturbed run)",
                request_id,
            )
        async for output in self._extend(engine, request_id):
            yield output

    async def _extend(self, engine: AsyncLLM, request_id: str) -> AsyncIterator[RequestOutput]:
        """Generate from prompt + tokens sent; detokenize and check stop strings here."""
        params = self._params.clone()
        generated = len(self._generated)
        if params.max_tokens is not None:
            params.max_tokens -= generated
        params.min_tokens = max(0, params.min_tokens - generated)
        # The text is this attempt's detokenizer's, so the engine need not make any.
        params.stop = []
        params.output_text_buffer_length = 0
        params.detokenize = False
        prompt = TokensPrompt(prompt_token_ids=self._prompt_ids + self._generated)
        detokenizer = self._detokenizer
        async with contextlib.aclosing(
            engine.generate(request_id=request_id, prompt=prompt, sampling_params=params)
        ) as outputs:
            async for output in outputs:
                completion = output.outputs[0]
                token_ids = list(completion.token_ids)
                before = detokenizer.num_output_tokens()
                stop_string = detokenizer.update(token_ids, completion.finish_reason == FinishReason.STOP)
                if stop_string is not None:
                    del token_ids[detokenizer.num_output_tokens() - before :]
                    completion.finish_reason, completion.stop_reason = FinishReason.STOP, stop_string
                    output.finished = True
                completion.token_ids = token_ids
                completion.text = detokenizer.get_next_output_text(output.finished, delta=True)
                yield output
                if output.finished:
                    return  # closing the engine's generator aborts a request a stop string ended

    async def _regenerate(self, engine: AsyncLLM, request_id: str) -> AsyncIterator[RequestOutput]:
        """Generate the whole answer again and pass on only what follows the part
        already sent; stop (without a finished output) if the tokens differ from it."""
        skip_tokens, skip_chars = list(self._generated), len(self._sent_text)
        async with contextlib.aclosing(
            engine.generate(
                request_id=request_id,
                prompt=TokensPrompt(prompt_token_ids=self._prompt_ids),
                sampling_params=self._params,
            )
        ) as outputs:
            async for output in outputs:
                completion = output.outputs[0]
                token_ids = list(completion.token_ids)
                if skip_tokens:
                    overlap = min(len(skip_tokens), len(token_ids))
                    if token_ids[:overlap] != skip_tokens[:overlap]:
                        return
                    del skip_tokens[:overlap], token_ids[:overlap]
                    if skip_tokens and output.finished:
                        return
                text = completion.text
                if skip_chars:
                    dropped = min(skip_chars, len(text))
                    skip_chars -= dropped
                    text = text[dropped:]
                if skip_tokens or (not token_ids and not text and not output.finished):
                    continue
                completion.token_ids, completion.text = token_ids, text
                yield output
