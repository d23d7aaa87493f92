"""vLLM's logprobs as the protocol carries them (``TokenLogprob``).

vLLM keeps a position's logprobs as a dict: the sampled (or prompt) token first, then
the top-k in rank order, where the sampled token, when it is among them, keeps its first
place with the top-k's values. The event carries the token and the whole top-k in rank
order instead, from which a reader rebuilds vLLM's dict order (the token, then the top-k
without it) and so every OpenAI shape ``vllm serve`` makes of it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from vllm import SamplingParams
from vllm.logprobs import Logprob, PromptLogprobs, SampleLogprobs
from vllm.outputs import CompletionOutput
from vllm.tokenizers.detokenizer_utils import convert_ids_list_to_tokens
from vllm.v1.engine.async_llm import AsyncLLM

from streamq.protocol import LOGPROB_FLOOR, TokenLogprob, TopLogprob

Decode = Callable[[int], str]
"""A token id's text, for logprobs the engine did not detokenize (a continuation after a
take-over generates with detokenization off)."""


def _finite(logprob: float) -> float:
    """``logprob``, or the floor for ``-inf`` (and NaN: JSON has neither, and an event
    with ``null`` for a number would not decode)."""
    return logprob if logprob >= LOGPROB_FLOOR else LOGPROB_FLOOR


def _text(token_id: int, logprob: Logprob, decode: Decode) -> str:
    return logprob.decoded_token if logprob.decoded_token is not None else decode(token_id)


def sample_logprobs(
    token_ids: Sequence[int], logprobs: SampleLogprobs | None, top_k: int, decode: Decode
) -> list[TokenLogprob]:
    """The logprobs of a delta's ``token_ids``.

    ``logprobs`` may hold more positions than ``token_ids`` when tokens were dropped from
    a delta (the part of a regeneration already sent, or tokens after a stop string):
    the positions whose tokens are ``token_ids`` are taken, from the end first."""
    if logprobs is None or not token_ids:
        return []
    positions: list[dict[int, Logprob]] = [p for p in logprobs if p is not None]
    if len(positions) != len(token_ids):
        tail = positions[len(positions) - len(token_ids) :]
        positions = tail if [next(iter(p)) for p in tail] == list(token_ids) else positions[: len(token_ids)]
    return [_position(t, p, top_k, decode) for t, p in zip(token_ids, positions, strict=True)]


def prompt_logprobs(
    prompt_token_ids: Sequence[int], logprobs: PromptLogprobs, top_k: int, decode: Decode
) -> list[TokenLogprob | None]:
    """The logprobs of the prompt's tokens (``None`` where vLLM has none: the first)."""
    return [
        None if position is None else _position(token_id, position, top_k, decode)
        for token_id, position in zip(prompt_token_ids, logprobs, strict=False)
    ]


def _position(token_id: int, position: dict[int, Logprob], top_k: int, decode: Decode) -> TokenLogprob:
    """One position of vLLM's logprobs for ``token_id``, of which ``top_k`` most likely
    tokens were asked for (``-1``: the whole vocabulary)."""
    items = list(position.items())
    first_id, first = items[0]
    assert first_id == token_id, f"vLLM puts the token first: got {first_id} for {token_id}"
    token = _text(token_id, first, decode)
    logprob = _finite(first.logprob)
    rank = first.rank if first.rank is not None else 0
    top = [TopLogprob(i, _text(i, lp, decode), _finite(lp.logprob)) for i, lp in items[1:]]
    if (top_k < 0 or len(top) < top_k) and 0 < rank <= len(top) + 1:
        # The token ranks among the top-k, where vLLM's dict keeps it first only.
        top.insert(rank - 1, TopLogprob(token_id, token, logprob))
    return TokenLogprob(logprob, rank, token, top)


def decoder(tokenizer: Any) -> Decode:
    """A token id's text as vLLM's logprobs spell it (``convert_ids_list_to_tokens``)."""

    def decode(token_id: int) -> str:
        return str(convert_ids_list_to_tokens(tokenizer, [token_id])[0])

    return decode


class LogprobsReader:
    """Takes the sampled tokens' logprobs a request asked for out of the engine's outputs
    (the prompt's are ``worker.prompt_report``'s)."""

    def __init__(self, top_k: int, tokenizer: Any) -> None:
        self._top_k = top_k
        self._decode = decoder(tokenizer)

    @classmethod
    def for_request(cls, params: SamplingParams, engine: AsyncLLM) -> LogprobsReader | None:
        """A reader, or ``None`` when the request asked for no logprobs (the common case:
        the job's loop then does no logprobs work at all)."""
        if params.logprobs is None and not params.logprob_token_ids:
            return None
        # With logprob_token_ids the engine's dict holds the token, then those ids: ``top`` keeps them as they are.
        return cls(params.logprobs if params.logprobs is not None else 0, engine.get_tokenizer())

    def sample(self, completion: CompletionOutput) -> list[TokenLogprob]:
        """The logprobs of a completion's delta."""
        return sample_logprobs(completion.token_ids, completion.logprobs, self._top_k, self._decode)
