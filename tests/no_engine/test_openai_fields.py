"""Every field of vLLM's request classes is classified (``producer/openai_api/fields.py``):
the table the gateway's page shows is the one the code applies, and it names every field
vLLM has, so a field a new vLLM adds fails here until someone decides what it does."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest

from producer.openai_api.fields import (
    CHAT_FIELDS,
    COMPLETION_FIELDS,
    Support,
    chat_differences,
    summary,
    table_markdown,
)
from producer.openai_api.requests import parse_openai_body
from streamq.protocol import InvalidRequest

with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)  # torch's own, raised while vLLM imports
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest

GATEWAY_PAGE = Path(__file__).resolve().parents[2] / "docs" / "gateway.md"


def test_every_field_of_vllms_completion_request_is_classified() -> None:
    assert set(COMPLETION_FIELDS) == set(CompletionRequest.model_fields)


def test_every_field_of_vllms_chat_request_is_classified() -> None:
    assert set(CHAT_FIELDS) == set(ChatCompletionRequest.model_fields)


def test_the_gateway_page_shows_the_tables_the_code_applies() -> None:
    page = GATEWAY_PAGE.read_text(encoding="utf-8")
    assert summary() in " ".join(page.split())
    assert table_markdown(COMPLETION_FIELDS) in page
    assert table_markdown(chat_differences()) in page


def test_every_refused_field_says_why() -> None:
    for fields in (COMPLETION_FIELDS, CHAT_FIELDS):
        assert all(spec.note for spec in fields.values() if spec.support is not Support.HONOURED)


BASES = {False: {"model": "m", "prompt": "Hi"}, True: {"model": "m", "messages": [{"role": "user", "content": "Hi"}]}}
ASKING: dict[str, Any] = {
    "use_beam_search": True,
    "length_penalty": 0.5,
    "truncate_prompt_tokens": 8,
    "truncation_side": "left",
    "logprob_token_ids": [5],
    "request_id": "mine",
    "routed_experts_prompt_start": 3,
    "cache_salt": "salt",
    "kv_transfer_params": {"do_remote_decode": True},
    "ec_transfer_params": {"x": 1},
    "suffix": "end",
    "prompt_embeds": "AAAA",
    "reasoning_effort": "low",
    "include_reasoning": False,
    "chat_template": "{{ messages }}",
    "media_io_kwargs": {"image": {}},
    "mm_processor_kwargs": {"a": 1},
    "return_prompt_text": True,
}
"""A value asking for something, for each refused field."""


@pytest.mark.parametrize(
    ("chat", "name"),
    [
        (chat, name)
        for chat in (False, True)
        for name, spec in (CHAT_FIELDS if chat else COMPLETION_FIELDS).items()
        if spec.support is Support.REFUSED
    ],
)
def test_a_refused_field_is_refused_by_name_unless_it_asks_for_nothing(chat: bool, name: str) -> None:
    with pytest.raises(InvalidRequest) as caught:
        parse_openai_body({**BASES[chat], name: ASKING[name]}, chat=chat)
    assert name in str(caught.value)
    default = (
        (ChatCompletionRequest if chat else CompletionRequest)
        .model_fields[name]
        .get_default(call_default_factory=False)
    )
    if name != "request_id":  # vLLM's default is a fresh uuid: streamq's is none
        parse_openai_body({**BASES[chat], name: default}, chat=chat)
