"""Requests past the edge's bounds (n, stop strings, stop token ids, messages) are refused
with a 400 that names the parameter, by the gateway's parser and the batch runner alike."""

from __future__ import annotations

from typing import Any

import pytest

from gateway.__main__ import build_parser as gateway_parser
from producer.cli import build_parser as cli_parser
from producer.errors import InvalidParameter
from producer.openai_api.errors import api_error_for
from producer.openai_api.limits import (
    DEFAULT_MAX_N,
    MAX_MESSAGES,
    MAX_STOP_CHARS,
    MAX_STOP_SEQUENCES,
    MAX_STOP_TOKEN_IDS,
    RequestLimits,
)
from producer.openai_api.requests import parse_openai_body

HI = [{"role": "user", "content": "Hi"}]


def completion(**fields: Any) -> dict[str, Any]:
    return {"model": "m", "prompt": "Hi", **fields}


def chat(**fields: Any) -> dict[str, Any]:
    return {"model": "m", "messages": HI, **fields}


def refusal(body: dict[str, Any], *, chat: bool = False, limits: RequestLimits | None = None) -> dict[str, Any]:
    """The error body the gateway answers ``body`` with; it must be a 400."""
    with pytest.raises(InvalidParameter) as caught:
        parse_openai_body(body, chat=chat, limits=limits or RequestLimits())
    error = api_error_for(caught.value)
    assert error.status == 400
    return dict(error.body()["error"])


@pytest.mark.parametrize("is_chat", [False, True])
def test_n_up_to_the_cap_is_accepted_and_past_it_refused_naming_the_cap(is_chat: bool) -> None:
    body = chat if is_chat else completion
    accepted = parse_openai_body(body(n=DEFAULT_MAX_N), chat=is_chat)
    assert accepted.submit_kwargs["n"] == DEFAULT_MAX_N
    error = refusal(body(n=DEFAULT_MAX_N + 1), chat=is_chat)
    assert error["param"] == "n" and error["code"] == "invalid_parameter"
    assert f"n={DEFAULT_MAX_N + 1}" in error["message"] and f"limit of {DEFAULT_MAX_N} " in error["message"]


def test_the_cap_is_the_configured_one_and_best_of_counts_too() -> None:
    limits = RequestLimits(max_n=2)
    assert parse_openai_body(completion(n=2, best_of=2), chat=False, limits=limits).submit_kwargs["n"] == 2
    assert refusal(completion(n=3), limits=limits)["message"] == "n=3 is over the limit of 2 completions per request"
    assert refusal(completion(n=3, best_of=3), limits=limits)["param"] == "n"
    assert parse_openai_body(completion(n=100), chat=False, limits=RequestLimits(max_n=100)).submit_kwargs["n"] == 100


def test_stop_sequences_are_bounded_in_number_and_length() -> None:
    many = [f"s{i}" for i in range(MAX_STOP_SEQUENCES)]
    assert parse_openai_body(completion(stop=many), chat=False).submit_kwargs["stop"] == many
    error = refusal(completion(stop=[*many, "one more"]))
    assert error["param"] == "stop" and f"the limit is {MAX_STOP_SEQUENCES}" in error["message"]
    long = "x" * (MAX_STOP_CHARS + 1)
    assert refusal(chat(stop=["ok", long]), chat=True)["message"] == (
        f"stop[1] is {MAX_STOP_CHARS + 1} characters; the limit is {MAX_STOP_CHARS}"
    )
    assert refusal(completion(stop=long))["param"] == "stop"  # one string, not in a list


def test_stop_token_ids_are_bounded_in_number() -> None:
    ids = list(range(MAX_STOP_TOKEN_IDS))
    assert parse_openai_body(completion(stop_token_ids=ids), chat=False).submit_kwargs["stop_token_ids"] == ids
    error = refusal(completion(stop_token_ids=[*ids, 0]))
    assert error["param"] == "stop_token_ids"
    assert (
        error["message"]
        == f"stop_token_ids holds {MAX_STOP_TOKEN_IDS + 1} token ids; the limit is {MAX_STOP_TOKEN_IDS}"
    )


def test_messages_are_bounded_in_number_and_length() -> None:
    messages = HI * MAX_MESSAGES
    assert len(parse_openai_body(chat(messages=messages), chat=True).submit_kwargs["messages"]) == MAX_MESSAGES
    error = refusal(chat(messages=[*messages, HI[0]]), chat=True)
    assert error["param"] == "messages" and f"the limit is {MAX_MESSAGES}" in error["message"]
    limits = RequestLimits(max_message_chars=4)
    parts = [{"type": "text", "text": "abc"}, {"type": "text", "text": "d"}]  # 5 characters joined by a newline
    error = refusal(chat(messages=[HI[0], {"role": "user", "content": parts}]), chat=True, limits=limits)
    assert error["message"] == "messages[1].content is 5 characters; the limit is 4"


def test_max_n_is_an_option_of_the_gateway_and_the_batch_command() -> None:
    assert gateway_parser().parse_args([]).max_n == DEFAULT_MAX_N
    assert gateway_parser().parse_args(["--max-n", "4"]).max_n == 4
    assert cli_parser().parse_args(["batch", "in.jsonl", "out.jsonl"]).max_n == DEFAULT_MAX_N
    assert cli_parser().parse_args(["batch", "in.jsonl", "out.jsonl", "--max-n", "2"]).max_n == 2
    for parser, prefix in ((gateway_parser(), []), (cli_parser(), ["batch", "in.jsonl", "out.jsonl"])):
        with pytest.raises(SystemExit) as caught:
            parser.parse_args([*prefix, "--max-n", "0"])
        assert caught.value.code == 2


def test_the_gateways_bounds_default_to_the_documented_values() -> None:
    args = gateway_parser().parse_args([])
    assert (args.max_queue_depth, args.max_body_bytes, args.max_n) == (1000, 4 * 1024 * 1024, 16)
