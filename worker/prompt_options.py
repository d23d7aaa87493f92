"""The prompt fields of ``vllm serve``'s requests that the engine does not take from
``SamplingParams``: ``truncate_prompt_tokens`` (with ``truncation_side``), applied to the
prompt's token ids as vLLM's renderer applies it, and ``cache_salt``, which goes with the
prompt into the engine."""

from __future__ import annotations

from typing import Any

from vllm.inputs import TextPrompt, TokensPrompt

from streamq.protocol import GenerateRequest, InvalidRequest


def truncated(token_ids: list[int], request: GenerateRequest, max_model_len: int, tokenizer: Any) -> list[int]:
    """``token_ids`` cut to the request's ``truncate_prompt_tokens`` (``-1``: the context less
    the one token kept for output), from its ``truncation_side`` (else the tokenizer's);
    as they are without it. More than the context is refused, as ``vllm serve`` refuses it."""
    keep = request.truncate_prompt_tokens
    if keep is None:
        return token_ids
    check_truncation(keep, max_model_len)
    if keep < 0:
        keep = max(0, max_model_len - 1)
    if keep >= len(token_ids):
        return token_ids
    side = request.truncation_side or getattr(tokenizer, "truncation_side", "right")
    return token_ids[len(token_ids) - keep :] if side == "left" else token_ids[:keep]


def check_truncation(keep: int, max_model_len: int) -> None:
    """Refuse a ``truncate_prompt_tokens`` past the context, as ``vllm serve`` refuses it."""
    if keep > max_model_len:
        raise InvalidRequest(
            f"truncate_prompt_tokens={keep} cannot be greater than max_model_len = {max_model_len}. "
            "Please request a smaller truncation size."
        )


def engine_prompt(prompt: str | list[int], cache_salt: str | None) -> str | TextPrompt | TokensPrompt:
    """``prompt`` as the engine takes it: text, or token ids, with the request's cache salt."""
    if isinstance(prompt, str):
        return prompt if cache_salt is None else TextPrompt(prompt=prompt, cache_salt=cache_salt)
    if cache_salt is None:
        return TokensPrompt(prompt_token_ids=prompt)
    return TokensPrompt(prompt_token_ids=prompt, cache_salt=cache_salt)
