"""How far a request has got: tokens and finish reasons per completion.

A job tallies its own output here, and a job that runs again after its worker died
rebuilds the tally from the replay log, then continues the generation from it, as
NVIDIA Dynamo's request migration does: the prompt plus the tokens already sent
become the new prompt, and only the remaining token budget is generated. The
subscriber sees one answer with no repeated and no missing text.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec
from vllm import SamplingParams
from vllm.inputs import TokensPrompt
from vllm.v1.engine.async_llm import AsyncLLM

from producer.protocol import ChunkEvent, ErrorEvent, FinalEvent, GenerateRequest, decode_event
from producer.replay import ReplayLog


class NotResumable(Exception):
    """The request's earlier output cannot be continued (``n > 1``)."""


class Progress:
    """Tokens generated and finish reasons so far, per completion index."""

    def __init__(self, n: int) -> None:
        self.token_ids: list[list[int]] = [[] for _ in range(n)]
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
            elif isinstance(event, FinalEvent):
                progress.ended = True
                progress.finish_reasons = list(event.finish_reasons)
                progress.prompt_tokens = event.prompt_tokens
            elif isinstance(event, ErrorEvent):
                progress.ended = True
        return progress

    def continuation(
        self, engine: AsyncLLM, request: GenerateRequest, chat_ids: list[int] | None, params: SamplingParams
    ) -> tuple[TokensPrompt, SamplingParams]:
        """Prompt and sampling that generate the rest of the answer.

        Raises ``NotResumable`` for ``n > 1``: the completions share one engine
        request, which cannot be restarted from several different prefixes.
        """
        if len(self.token_ids) > 1:
            raise NotResumable("a request with n > 1 cannot continue on another worker")
        if chat_ids is not None:
            prompt_ids = chat_ids
        else:
            assert request.prompt is not None
            prompt_ids = list(engine.get_tokenizer().encode(request.prompt))
        self.prompt_tokens = len(prompt_ids)
        generated = self.token_ids[0]
        rest = params.clone()
        if rest.max_tokens is not None:
            rest.max_tokens -= len(generated)
        rest.min_tokens = max(0, rest.min_tokens - len(generated))
        return TokensPrompt(prompt_token_ids=prompt_ids + generated), rest
