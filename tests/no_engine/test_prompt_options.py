"""The worker cuts a prompt's tokens to ``truncate_prompt_tokens`` as vLLM's renderer does
(``worker/prompt_options.py``), and gives the engine its ``cache_salt`` with the prompt."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from streamq.protocol import GenerateRequest, InvalidRequest
from worker.prompt_options import engine_prompt, truncated

TOKENS = [1, 2, 3, 4, 5, 6]
RIGHT_SIDED = SimpleNamespace(truncation_side="right")


def request(**fields: Any) -> GenerateRequest:
    return GenerateRequest(request_id="r", prompt="Hi", **fields)


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({}, TOKENS),
        ({"truncate_prompt_tokens": 4}, [1, 2, 3, 4]),
        ({"truncate_prompt_tokens": 4, "truncation_side": "left"}, [3, 4, 5, 6]),
        ({"truncate_prompt_tokens": 4, "truncation_side": "right"}, [1, 2, 3, 4]),
        ({"truncate_prompt_tokens": 6}, TOKENS),
        ({"truncate_prompt_tokens": -1, "truncation_side": "left"}, [2, 3, 4, 5, 6]),  # the context (6) less one
    ],
)
def test_a_prompt_is_cut_to_truncate_prompt_tokens_from_its_side(fields: dict[str, Any], expected: list[int]) -> None:
    assert truncated(TOKENS, request(**fields), 6, RIGHT_SIDED) == expected


def test_without_a_side_the_tokenizers_side_is_cut() -> None:
    assert truncated(TOKENS, request(truncate_prompt_tokens=2), 8, SimpleNamespace(truncation_side="left")) == [5, 6]


def test_truncating_to_more_than_the_context_is_refused_as_vllm_serve_refuses_it() -> None:
    with pytest.raises(InvalidRequest, match="cannot be greater than max_model_len = 6"):
        truncated(TOKENS, request(truncate_prompt_tokens=7), 6, RIGHT_SIDED)


def test_the_cache_salt_goes_with_the_prompt_into_the_engine() -> None:
    assert engine_prompt("Hi", None) == "Hi"
    assert engine_prompt("Hi", "s") == {"prompt": "Hi", "cache_salt": "s"}
    assert engine_prompt([1, 2], None) == {"prompt_token_ids": [1, 2]}
    assert engine_prompt([1, 2], "s") == {"prompt_token_ids": [1, 2], "cache_salt": "s"}
