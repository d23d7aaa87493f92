"""What a request's first chunk says about its prompt: the prompt's token ids with their
logprobs (``prompt_logprobs``) and its text (``echo``), once per request.

An attempt that goes on from tokens already sent reports nothing: the first chunk went
out before."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.outputs import RequestOutput
from vllm.v1.engine.async_llm import AsyncLLM

from streamq.protocol import ChunkEvent, GenerateRequest, PromptEcho, TokenLogprob
from worker.logprobs import decoder, prompt_logprobs


@dataclass(frozen=True)
class PromptReport:
    """The prompt fields of a request's first chunk."""

    token_ids: list[int]
    logprobs: list[TokenLogprob | None] | None = None
    echo: PromptEcho | None = None

    def apply(self, event: ChunkEvent) -> None:
        """Set the fields on ``event``."""
        event.prompt_token_ids = self.token_ids
        if self.logprobs is not None:
            event.prompt_logprobs = self.logprobs
        if self.echo is not None:
            event.prompt_echo = self.echo


class PromptReporter:
    """Builds a request's ``PromptReport`` from the first engine output that has the prompt."""

    def __init__(self, request: GenerateRequest, top_k: int | None, tokenizer: Any) -> None:
        self._request = request
        self._top_k = top_k
        self._tokenizer = tokenizer
        self._pending = True

    @classmethod
    def for_request(
        cls, request: GenerateRequest, prompt_logprobs_k: int | None, engine: AsyncLLM, *, with_prompt: bool
    ) -> PromptReporter | None:
        """A reporter, or ``None`` when this attempt reports nothing (the common case: no
        ``echo``, ``return_prompt_token_ids`` or ``prompt_logprobs``, or the first chunk went
        out already)."""
        if not with_prompt or (prompt_logprobs_k is None and not request.echo and not request.return_prompt_token_ids):
            return None
        return cls(request, prompt_logprobs_k, engine.get_tokenizer())

    def report(self, output: RequestOutput) -> PromptReport | None:
        """The report, the first time ``output`` carries what it needs; else ``None``."""
        if not self._pending or output.prompt_token_ids is None:
            return None
        if self._top_k is not None and output.prompt_logprobs is None:
            return None
        self._pending = False
        token_ids = list(output.prompt_token_ids)
        logprobs = None
        if self._top_k is not None and output.prompt_logprobs is not None:
            logprobs = prompt_logprobs(token_ids, output.prompt_logprobs, self._top_k, decoder(self._tokenizer))
        echo = self._echo(output, token_ids) if self._request.echo else None
        return PromptReport(token_ids, logprobs, echo)

    def _echo(self, output: RequestOutput, token_ids: list[int]) -> PromptEcho:
        """The prompt's text as ``vllm serve`` echoes it: a text prompt as sent, token ids
        decoded (special tokens kept); and the first token's text alone."""
        text = output.prompt if output.prompt is not None else self._request.prompt
        if text is None:
            text = str(self._tokenizer.decode(token_ids))
        first = str(self._tokenizer.decode(token_ids[0])) if token_ids else ""
        return PromptEcho(text=text, first_token=first)
