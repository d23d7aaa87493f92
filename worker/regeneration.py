"""Taking over a request by generating it again from the start with the same seed.

A request taken over from a dead worker goes on from the prompt plus the tokens already
sent where the engine's state is all in those tokens (``worker/progress.py``). Where it
is not, continuing from a longer prompt would change what the engine samples:

- ``n > 1``: the completions share one engine request, which cannot start again from
  several different prefixes;
- structured outputs: the grammar's state is not carried over to a continued prompt
  (it would start matching the schema again inside the answer);
- ``presence_penalty`` and ``frequency_penalty`` count only generated tokens, and the
  tokens sent would have become prompt;
- a seeded sampler (temperature > 0) draws its random numbers from the start.

Such a request is generated again from the start, with the same sampling parameters and
the same seed, and what each completion already delivered is checked token by token and
suppressed: the subscriber gets the rest of exactly the answer an undisturbed run would
have sent. If the engine does not reproduce it (an engine that is not deterministic, e.g.
batch-dependent GPU kernels), the request ends with ``worker_lost`` saying which
completion differed where (``RegenerationDiffers``); nothing that might differ is ever sent.

Seeds. Such a request sampled at temperature > 0 without a seed gets one from the worker
at its first attempt (``with_take_over_seed``): derived from the request id (BLAKE2b), so
every attempt on every worker finds the same seed with nothing stored and no round trip.
A request id names one request while the queue knows it (a producer cannot enqueue an
id that is queued, running, or has a result or a replay log), and a take-over runs under
the same id. A seed kept in Redis instead would cost a write before every such request,
an ACL grant and a key to expire, and could be lost with Redis while the job survives. The consequence: a
request submitted again later under the same id draws the same sample (give another id,
or a ``seed``, to draw another). Requests that go on from their tokens get no seed and
keep vLLM's unseeded sampling (seeded requests are sampled with a generator of their own).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
from collections.abc import AsyncIterator, Sequence
from typing import Any

import msgspec
from vllm import SamplingParams
from vllm.inputs import TextPrompt, TokensPrompt
from vllm.outputs import CompletionOutput, RequestOutput
from vllm.sampling_params import SamplingType
from vllm.v1.engine.async_llm import AsyncLLM

logger = logging.getLogger("streamq.worker")

SEED_BITS = 62
"""Bits of an assigned seed: vLLM gives completion ``i`` of ``n`` the seed ``seed + i``,
which must stay a signed 64-bit integer for the sampler's generator."""


class RegenerationDiffers(Exception):
    """A take-over that generates the request again did not reproduce what it had already
    delivered: the request cannot go on exactly."""


def regeneration_reason(params: SamplingParams) -> str | None:
    """Why a take-over of a request with ``params`` generates it again from the start
    rather than continuing from its tokens; ``None`` when it can continue."""
    if params.n > 1:
        return "n > 1"
    if params.structured_outputs is not None:
        return "structured outputs"
    if params.presence_penalty or params.frequency_penalty:
        return "penalties that count generated tokens"
    if params.sampling_type == SamplingType.RANDOM_SEED:
        return "a seed"
    return None


def assigned_seed(request_id: str) -> int:
    """The seed a worker assigns to ``request_id`` (the same on every worker)."""
    digest = hashlib.blake2b(request_id.encode(), digest_size=8, person=b"streamq-seed").digest()
    return int.from_bytes(digest, "big") >> (64 - SEED_BITS)


def with_take_over_seed(params: SamplingParams, request_id: str) -> SamplingParams:
    """``params``, with the request's assigned seed when a take-over would generate it
    again at temperature > 0 and it has no seed; otherwise ``params`` itself."""
    if params.seed is not None or params.sampling_type == SamplingType.GREEDY or regeneration_reason(params) is None:
        return params
    return msgspec.structs.replace(params, seed=assigned_seed(request_id))


class _Delivered:
    """What one completion delivered before the take-over: passes on only what follows
    it in the regenerated completion, after checking that it is the same."""

    def __init__(self, index: int, token_ids: list[int], text: str, finish_reason: str | None) -> None:
        self.index = index
        self.token_ids = token_ids
        self.text = text
        self.finish_reason = finish_reason
        self.tokens_matched = 0
        self.chars_matched = 0

    @property
    def caught_up(self) -> bool:
        return self.tokens_matched == len(self.token_ids)

    def rest(self, completion: CompletionOutput) -> bool:
        """Cut ``completion``, one regenerated DELTA of this completion, to what was not
        delivered yet (token ids, logprobs and text alike); whether anything is left to
        send. Raises ``RegenerationDiffers`` where it differs from what was delivered."""
        if self.caught_up and self.finish_reason is None:
            return True  # the common case once the delivered part is behind
        token_ids = list(completion.token_ids)
        overlap = min(len(self.token_ids) - self.tokens_matched, len(token_ids))
        for offset in range(overlap):
            position = self.tokens_matched + offset
            if token_ids[offset] != self.token_ids[position]:
                raise self.differs(
                    f"token {position + 1} of the {len(self.token_ids)} sent differs "
                    f"(regenerated {token_ids[offset]}, sent {self.token_ids[position]})"
                )
        self.tokens_matched += overlap
        if self.finish_reason is not None:  # delivered in full: nothing of it is sent again
            if len(token_ids) > overlap:
                raise self.differs(f"it had finished after {len(self.token_ids)} tokens, but the regeneration goes on")
            if completion.finish_reason is not None and (
                not self.caught_up or completion.finish_reason != self.finish_reason
            ):
                raise self.differs(
                    f"it had finished ({self.finish_reason}) after {len(self.token_ids)} tokens, the regeneration "
                    f"finished ({completion.finish_reason}) after {self.tokens_matched}"
                )
            return False
        if completion.finish_reason is not None and not self.caught_up:
            raise self.differs(
                f"the regeneration finished after {self.tokens_matched} tokens, but {len(self.token_ids)} had been sent"
            )
        text = completion.text
        dropped = min(len(self.text) - self.chars_matched, len(text))
        if text[:dropped] != self.text[self.chars_matched : self.chars_matched + dropped] or (
            self.caught_up and self.chars_matched + dropped < len(self.text)
        ):
            raise self.differs(f"its text differs after character {self.chars_matched} of the {len(self.text)} sent")
        self.chars_matched += dropped
        completion.token_ids = token_ids[overlap:]
        if completion.logprobs is not None:  # one entry per token: cut alike
            completion.logprobs = completion.logprobs[overlap:]
        completion.text = text[dropped:]
        return bool(completion.token_ids or completion.text or completion.finish_reason is not None)

    def differs(self, what: str) -> RegenerationDiffers:
        """The error saying how this completion's regeneration differs."""
        return RegenerationDiffers(
            f"generating the request again from the start did not reproduce what completion {self.index} "
            f"had sent: {what}"
        )


class Regeneration:
    """Generates a taken-over request again from the start and passes on, per
    completion, only what follows the part already delivered: ``RequestOutput`` DELTAs
    exactly as an undisturbed run would have sent them from here on. A completion that
    had finished sends nothing again."""

    def __init__(
        self,
        prompt: str | TextPrompt | TokensPrompt,
        params: SamplingParams,
        token_ids: Sequence[list[int]],
        texts: Sequence[str],
        finish_reasons: Sequence[str | None],
        *,
        reason: str,
    ) -> None:
        self._prompt = prompt
        # The prompt's logprobs went out with the first chunk already.
        self._params = msgspec.structs.replace(params, prompt_logprobs=None)
        self._delivered = [
            _Delivered(i, list(ids), text, finish)
            for i, (ids, text, finish) in enumerate(zip(token_ids, texts, finish_reasons, strict=True))
        ]
        self.reason = reason

    async def generate(
        self, engine: AsyncLLM, request_id: str, priority: int = 0, **engine_kwargs: Any
    ) -> AsyncIterator[RequestOutput]:
        """The engine's outputs for the rest of the answer, ending with a finished one;
        raises ``RegenerationDiffers`` as soon as a completion differs from what it delivered."""
        logger.info(
            "request %s: %s: generating it again from the start, sending only what follows the %d tokens sent",
            request_id,
            self.reason,
            sum(len(d.token_ids) for d in self._delivered),
        )
        async with contextlib.aclosing(
            engine.generate(
                request_id=request_id,
                prompt=self._prompt,
                sampling_params=self._params,
                priority=priority,
                **engine_kwargs,
            )
        ) as outputs:
            async for output in outputs:
                output.outputs = [c for c in output.outputs if self._delivered[c.index].rest(c)]
                if output.finished:
                    for delivered in self._delivered:
                        if not delivered.caught_up:
                            raise delivered.differs(
                                f"the regeneration ended after {delivered.tokens_matched} tokens, "
                                f"but {len(delivered.token_ids)} had been sent"
                            )
                if output.outputs or output.finished:
                    yield output
                if output.finished:
                    return
