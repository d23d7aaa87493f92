"""Tool calls and reasoning as ``vllm serve`` makes them: a real ``vllm serve`` and a real
worker behind a real gateway, both with the same tool and reasoning parsers (hermes, qwen3),
the same tiny model, the same requests at temperature 0 (``test_gateway_matches_vllm_serve``
compares everything else, on servers without parsers: a parser changes how a stream is cut).
Anthropic's Messages API, which ``vllm serve`` answers through these parsers too, is held
against it here, through the anthropic SDK."""

from __future__ import annotations

import functools
import json
import re
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from devkit.worker_process import tiny_engine_flags
from producer.client import StreamqClient
from tests.support.session import MAX_MODEL_LEN
from tests.support.vllm_serve import beside_a_worker, comparable, post

MAX_TOKENS = 12


@dataclass(frozen=True)
class ToolServers:
    """Where the two servers answer, and the model they serve."""

    serve_url: str
    gateway_url: str
    tiny_model: Path


TOOLS_MODEL = "tiny-with-tools"
TOOL_FLAGS = ["--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--reasoning-parser", "qwen3"]
NO_THINKING = {"enable_thinking": False}
"""Qwen3's reasoning parser reads the output as reasoning until ``</think>`` unless told
that the template turned thinking off (as a Qwen3 client asking for tool calls does)."""
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "strict": True,  # the grammar pins the arguments: a random model's call stays short
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
CLOCK = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The time in a zone",
        "strict": True,
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
SCRIPTED_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
"""What ``auto`` gets the tiny model to write (a regex of exactly this text, which vLLM
joins to the tools' own grammar): a random model never calls a tool of its own accord."""
TOOL_CHOICES: dict[str, dict[str, Any]] = {
    "named": {"tool_choice": {"type": "function", "function": {"name": "get_time"}}},
    "required": {"tool_choice": "required", "parallel_tool_calls": False},
    "auto": {"tool_choice": "auto", "structured_outputs": {"regex": re.escape(SCRIPTED_CALL)}},
}


@pytest.fixture(scope="module")
def tool_servers(
    worker_url: str, gateway_url: str, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ToolServers]:
    """``vllm serve`` and a worker with hermes tool parsing and qwen3 reasoning parsing,
    serving the tiny model as ``TOOLS_MODEL``, and a gateway; the engines start at once."""
    logs = tmp_path_factory.mktemp("tools-vs-vllm-serve")
    flags = tiny_engine_flags(tiny_model, max_model_len=MAX_MODEL_LEN)
    flags += ["--served-model-name", TOOLS_MODEL, "--max-num-seqs", "16", *TOOL_FLAGS]
    queue = f"streamq:queue:{TOOLS_MODEL}"
    with beside_a_worker(flags, worker_url=worker_url, gateway_url=gateway_url, queue=queue, logs=logs) as urls:
        yield ToolServers(*urls, tiny_model)


def tool_body(tiny_model: Path, choice: str, *, stream: bool) -> dict[str, Any]:
    """A request that calls a tool; whitespace tokens held down (``logit_bias``), or the
    random model fills the JSON grammar's optional whitespace until ``max_tokens``."""
    messages = [{"role": "user", "content": "What is the weather in Oslo?"}]
    body = {"model": TOOLS_MODEL, "messages": messages, "tools": [WEATHER, CLOCK], "max_tokens": 80}
    bias = {str(token): -100 for token in whitespace_tokens(tiny_model)}
    body |= {"temperature": 0, "logit_bias": bias, "chat_template_kwargs": NO_THINKING}
    return {**body, "stream": stream, **TOOL_CHOICES[choice]}


@functools.cache
def whitespace_tokens(tiny_model: Path) -> list[int]:
    """The tiny model's tokens that decode to whitespace alone."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    return [i for i in range(len(tokenizer)) if not tokenizer.decode([i]).strip() and tokenizer.decode([i])]


def streamed_message(chunks: list[Any]) -> dict[str, Any]:
    """A streamed chat completion put together from its deltas: content, reasoning, each
    tool call (its id left out: ids are random) and the finish reason."""
    content, reasoning, calls, finish = "", "", {}, None
    for chunk in chunks:
        for choice in chunk["choices"]:
            delta = choice["delta"]
            assert set(delta) <= {"role", "content", "reasoning", "tool_calls"}, delta
            content += delta.get("content") or ""
            reasoning += delta.get("reasoning") or ""
            for call in delta.get("tool_calls") or []:
                entry = calls.setdefault(call["index"], {"name": "", "arguments": ""})
                function = call.get("function") or {}
                entry["name"] += function.get("name") or ""
                entry["arguments"] += function.get("arguments") or ""
            finish = choice.get("finish_reason") or finish
    calls_in_order = [calls[i] for i in sorted(calls)]
    return {"content": content, "reasoning": reasoning, "tool_calls": calls_in_order, "finish_reason": finish}


@pytest.mark.parametrize("choice", list(TOOL_CHOICES))
def test_whole_tool_calls_match(tool_servers: ToolServers, choice: str) -> None:
    body = tool_body(tool_servers.tiny_model, choice, stream=False)
    (ours,), _ = post(tool_servers.gateway_url, "/v1/chat/completions", body)
    (reference,), _ = post(tool_servers.serve_url, "/v1/chat/completions", body)
    assert comparable(ours) == comparable(reference)
    assert "tool_calls" in ours["choices"][0]["message"], (ours, reference)
    (call,) = ours["choices"][0]["message"]["tool_calls"]
    assert call["id"] and call["type"] == "function"
    expected = {"named": "get_time", "required": call["function"]["name"], "auto": "get_weather"}[choice]
    assert call["function"]["name"] == expected
    assert set(json.loads(call["function"]["arguments"])) <= {"city", "zone"}
    assert ours["choices"][0]["finish_reason"] == ("stop" if choice == "named" else "tool_calls")


@pytest.mark.parametrize("choice", list(TOOL_CHOICES))
def test_streamed_tool_calls_match(tool_servers: ToolServers, choice: str) -> None:
    body = tool_body(tool_servers.tiny_model, choice, stream=True)
    ours, _ = post(tool_servers.gateway_url, "/v1/chat/completions", body)
    reference, _ = post(tool_servers.serve_url, "/v1/chat/completions", body)
    assert streamed_message(ours) == streamed_message(reference)
    assert streamed_message(ours)["tool_calls"], "the stream carries a call"
    # The same call as the whole response's (whose arguments vLLM writes out again, spaced).
    (whole,), _ = post(tool_servers.gateway_url, "/v1/chat/completions", {**body, "stream": False})
    call = whole["choices"][0]["message"]["tool_calls"][0]["function"]
    streamed = streamed_message(ours)["tool_calls"][0]
    assert streamed["name"] == call["name"]
    assert json.loads(streamed["arguments"]) == json.loads(call["arguments"])


def test_the_openai_sdks_tool_calling_flow_works_unchanged(tool_servers: ToolServers) -> None:
    """The openai SDK's tool-calling example, against each server: ask with tools, run the
    call, send the SDK's own message back with the tool's answer, read the reply."""
    import openai

    bias = {str(token): -100 for token in whitespace_tokens(tool_servers.tiny_model)}
    seen = {}
    for server, url in (("vllm serve", tool_servers.serve_url), ("gateway", tool_servers.gateway_url)):
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", timeout=120)
        messages: list[Any] = [{"role": "user", "content": "What is the weather in Oslo?"}]
        tools: Any = [WEATHER, CLOCK]
        first = client.chat.completions.create(
            model=TOOLS_MODEL, messages=messages, tools=tools, tool_choice="required", temperature=0, max_tokens=80,
            logit_bias=bias, parallel_tool_calls=False, extra_body={"chat_template_kwargs": NO_THINKING},
        )  # fmt: skip
        message = first.choices[0].message
        messages.append(message)
        for call in message.tool_calls or []:
            answer = {"forecast": "sunny", **json.loads(call.function.arguments)}  # type: ignore[union-attr]
            messages.append({"role": "tool", "tool_call_id": call.id, "content": json.dumps(answer)})
        reply = client.chat.completions.create(
            model=TOOLS_MODEL,
            messages=messages,
            tools=tools,
            temperature=0,
            max_tokens=8,
            extra_body={"ignore_eos": True, "chat_template_kwargs": NO_THINKING},
        )
        calls = [(c.function.name, c.function.arguments) for c in message.tool_calls or []]  # type: ignore[union-attr]
        seen[server] = (first.choices[0].finish_reason, calls, reply.choices[0].message.content)
    assert seen["gateway"] == seen["vllm serve"]
    finish_reason, calls, reply_text = seen["gateway"]
    assert finish_reason == "tool_calls" and len(calls) == 1 and reply_text


async def test_the_python_client_and_batch_files_get_the_same_calls(
    tool_servers: ToolServers, producer_url: str, tmp_path: Path
) -> None:
    """``generate(tools=...)`` and a batch line with tools give the call the gateway gives."""
    body = tool_body(tool_servers.tiny_model, "named", stream=False)
    (reference,), _ = post(tool_servers.gateway_url, "/v1/chat/completions", body)
    expected = reference["choices"][0]["message"]["tool_calls"][0]["function"]

    async with await StreamqClient.connect(producer_url) as client:
        completion = await client.generate(
            messages=body["messages"],
            model=TOOLS_MODEL,
            tools={"tools": body["tools"], "tool_choice": body["tool_choice"]},
            chat_options={"kwargs": NO_THINKING},
            max_tokens=body["max_tokens"],
            temperature=0,
            logit_bias=body["logit_bias"],
        )
    assert completion.parsed is not None and completion.parsed[0] is not None
    (call,) = completion.parsed[0].message["tool_calls"]  # type: ignore[index]
    assert call["function"] == expected and expected["name"] in completion.text  # the text is the raw call

    in_path, out_path = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    line = {"custom_id": "call", "method": "POST", "url": "/v1/chat/completions", "body": {**body, "stream": False}}
    in_path.write_text(json.dumps(line) + "\n")
    command = [sys.executable, "-m", "producer", "batch", str(in_path), str(out_path)]
    done = subprocess.run([*command, "--redis-url", producer_url, "--no-progress"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    (answer,) = [json.loads(text) for text in out_path.read_text().splitlines()]
    choice = answer["response"]["body"]["choices"][0]
    assert choice["message"]["tool_calls"][0]["function"] == expected


TRIES = 10
STREAM_INTERVAL = 4
"""The engine's output every 4 tokens (``stream_interval``, a field both servers take), not
every token: a late consumer merges outputs only once it is 4 steps behind, instead of one,
so that a stream's cut is, nearly always, the interval's on both servers, however loaded."""


def cut(chunks: list[Any]) -> list[int]:
    """How many tokens each chunk of a stream carries (``return_token_ids`` names them)."""
    return [len(c["token_ids"]) for chunk in chunks for c in chunk["choices"] if c.get("token_ids") is not None]


def cut_alike(tool_servers: ToolServers, body: dict[str, Any]) -> tuple[list[Any], list[Any]]:
    """A stream of ours and one of ``vllm serve``'s of ``body`` that cut the tokens into the
    same chunks, from up to ``TRIES`` of each. A streamed count of reasoning tokens is the
    parser's as fed chunk by chunk, so it depends on the cut (``vllm serve`` against itself
    too), and either server's vLLM merges outputs its consumer was late for (a matter of
    timing, see ``test_gateway_matches_vllm_serve``): any of ours is matched with any of
    theirs, both asked for ``STREAM_INTERVAL``: the usual cut of both."""
    body = {**body, "return_token_ids": True, "stream_interval": STREAM_INTERVAL}
    ours_by_cut: dict[tuple[int, ...], list[Any]] = {}
    theirs_by_cut: dict[tuple[int, ...], list[Any]] = {}
    for _ in range(TRIES):
        ours, _ = post(tool_servers.gateway_url, "/v1/chat/completions", body)
        reference, _ = post(tool_servers.serve_url, "/v1/chat/completions", body)
        ours_by_cut.setdefault(tuple(cut(ours)), ours)
        theirs_by_cut.setdefault(tuple(cut(reference)), reference)
        for shared in ours_by_cut.keys() & theirs_by_cut.keys():
            return ours_by_cut[shared], theirs_by_cut[shared]
    raise AssertionError(
        f"no cut shared in {TRIES} streams each: ours {list(ours_by_cut)}, theirs {list(theirs_by_cut)}"
    )


def weather_question(*, stream: bool, **extra: Any) -> dict[str, Any]:
    """The greedy chat body the reasoning tests send both servers, with ``extra`` fields."""
    return {
        "model": TOOLS_MODEL,
        "messages": [{"role": "user", "content": "What is the weather in Oslo?"}],
        "max_tokens": MAX_TOKENS,
        "ignore_eos": True,
        "temperature": 0,
        "stream": stream,
        **extra,
    }


@pytest.mark.parametrize("stream", [False, True])
def test_reasoning_is_split_off_as_vllm_serve_does(tool_servers: ToolServers, stream: bool) -> None:
    """The engine's ``--reasoning-parser`` on the worker gives ``reasoning`` apart from
    ``content``, and counts its tokens, whole and streamed, as on ``vllm serve``: with
    thinking on and no ``</think>`` written, the tiny model's whole output is reasoning."""
    body = weather_question(stream=stream)
    if stream:
        body["stream_options"] = {"include_usage": True}
        ours, reference = cut_alike(tool_servers, body)
        assert streamed_message(ours) == streamed_message(reference)
        message, used = streamed_message(ours), ours[-1]["usage"]
        assert used == reference[-1]["usage"], f"both cut as {cut(ours)}"
    else:
        ours, _ = post(tool_servers.gateway_url, "/v1/chat/completions", body)
        reference, _ = post(tool_servers.serve_url, "/v1/chat/completions", body)
        assert comparable(ours) == comparable(reference)
        message, used = ours[0]["choices"][0]["message"], ours[0]["usage"]
    assert message["reasoning"] and not message["content"]
    # vllm serve's count of a streamed completion's reasoning tokens is its parser's own as
    # fed chunk by chunk (smaller here); a whole one's counts every token of it. Either way,
    # the same as ours.
    thought = used["completion_tokens_details"]["reasoning_tokens"]
    assert thought >= 1 if stream else thought == MAX_TOKENS


# Anthropic's Messages API, through the anthropic SDK, against both servers (``vllm serve``
# maps it onto its chat completions, the gateway onto the same queued request).

FUNCTIONS: list[Any] = [WEATHER["function"], CLOCK["function"]]
ANTHROPIC_TOOLS: Any = [
    {"name": f["name"], "description": f["description"], "input_schema": f["parameters"], "strict": True}
    for f in FUNCTIONS
]
ASK: Any = [{"role": "user", "content": "What is the weather in Oslo?"}]
GREEDY: dict[str, Any] = {"extra_body": {"temperature": 0}}
"""Sampling fields are not the anthropic SDK's arguments any more: they go as extra body fields.
With thinking on, the tiny model's whole reply is reasoning: a ``thinking`` block."""
TOOL_CALL: dict[str, Any] = {"extra_body": {"temperature": 0, "chat_template_kwargs": NO_THINKING}}
"""Thinking off: the reasoning parser would read a call as reasoning."""


def anthropic_clients(tool_servers: ToolServers) -> dict[str, Any]:
    """The anthropic SDK on each server (``vllm serve`` first)."""
    import anthropic

    urls = {"vllm serve": tool_servers.serve_url, "gateway": tool_servers.gateway_url}
    return {name: anthropic.Anthropic(base_url=url, api_key="unused", timeout=120) for name, url in urls.items()}


def without_ids(message: Any) -> dict[str, Any]:
    """A message as both servers must agree on it: all but its id (and tool calls' ids, and
    thinking blocks' signatures: random on both)."""
    dumped = message.model_dump(exclude_none=True)
    dumped.pop("id")
    for block in dumped["content"]:
        block.pop("id", None)
        block.pop("signature", None)
    return dict(dumped)


def test_messages_create_and_stream_match_vllm_serve(tool_servers: ToolServers) -> None:
    """``messages.create`` and ``messages.stream`` at temperature 0: the same message (text,
    stop reason, usage) on both servers, whole and streamed."""
    seen: dict[str, Any] = {}
    for server, client in anthropic_clients(tool_servers).items():
        # (No system prompt: count_tokens holds its rendering against vllm serve's. With this
        # one, the tiny model writes tokens that vllm serve keeps as special tokens and broken
        # bytes, and the worker drops, on chat completions alike.)
        ask: Any = {"model": TOOLS_MODEL, "max_tokens": MAX_TOKENS, "messages": ASK, **GREEDY}
        whole = client.messages.create(**ask)
        with client.messages.stream(**ask) as stream:
            kinds = [event.type for event in stream]
            streamed = stream.get_final_message()
        seen[server] = (without_ids(whole), without_ids(streamed), kinds)
    whole, streamed, kinds = seen["gateway"]
    assert (whole, streamed) == seen["vllm serve"][:2]
    assert whole == streamed, "a stream's message is the whole one"
    assert whole["usage"]["output_tokens"] > 0 and whole["stop_reason"] in ("end_turn", "max_tokens")
    assert whole["content"][0]["type"] == "thinking" and whole["content"][0]["thinking"]
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop" and "message_delta" in kinds


def test_a_messages_tool_round_trip_matches_vllm_serve(tool_servers: ToolServers) -> None:
    """A named tool forced with ``tool_choice``, its ``tool_use`` block sent back with a
    ``tool_result``, the reply read: the same on both servers, whole and streamed."""
    seen: dict[str, Any] = {}
    for server, client in anthropic_clients(tool_servers).items():
        # Room for the whitespace the random model writes inside the call (no logit_bias here).
        ask: Any = {"model": TOOLS_MODEL, "max_tokens": 120, "tools": ANTHROPIC_TOOLS}
        choice = {"type": "tool", "name": "get_time"}
        first = client.messages.create(messages=ASK, tool_choice=choice, **ask, **TOOL_CALL)
        with client.messages.stream(messages=ASK, tool_choice=choice, **ask, **TOOL_CALL) as stream:
            streamed = stream.get_final_message()
        results = [
            {"type": "tool_result", "tool_use_id": block.id, "content": json.dumps({"time": "12:00", **block.input})}
            for block in first.content
            if block.type == "tool_use"
        ]
        turns = [*ASK, {"role": "assistant", "content": first.content}, {"role": "user", "content": results}]
        reply = client.messages.create(messages=turns, **{**ask, "max_tokens": MAX_TOKENS}, **GREEDY)
        seen[server] = (without_ids(first), without_ids(streamed), without_ids(reply))
    first, streamed, reply = seen["gateway"]
    assert seen["gateway"] == seen["vllm serve"]
    assert first == streamed
    (call,) = first["content"]
    assert call["type"] == "tool_use" and call["name"] == "get_time" and set(call["input"]) == {"zone"}
    assert first["stop_reason"] == "tool_use"
    assert reply["usage"]["input_tokens"] > first["usage"]["input_tokens"], "the reply's prompt holds the round trip"


def test_count_tokens_matches_vllm_serve(tool_servers: ToolServers) -> None:
    """``messages.count_tokens``: the prompt as the chat template renders it, tools and
    system prompt included, counted alike."""
    counted = {
        server: client.messages.count_tokens(
            model=TOOLS_MODEL, system="You are terse.", messages=ASK, tools=ANTHROPIC_TOOLS
        ).input_tokens
        for server, client in anthropic_clients(tool_servers).items()
    }
    assert counted["gateway"] == counted["vllm serve"] > 0
    whole = anthropic_clients(tool_servers)["gateway"].messages.create(
        model=TOOLS_MODEL, max_tokens=1, system="You are terse.", messages=ASK, tools=ANTHROPIC_TOOLS
    )
    assert whole.usage.input_tokens == counted["gateway"]


@pytest.mark.parametrize(
    ("change", "words"),
    [
        ({"max_tokens": None}, "max_tokens"),
        ({"messages": [{"role": "user", "content": [{"type": "video", "text": "Hi"}]}]}, "video"),
    ],
)
def test_a_bad_messages_body_is_a_400_in_anthropics_shape(
    tool_servers: ToolServers, change: dict[str, Any], words: str
) -> None:
    """A body ``vllm serve`` refuses is refused by the gateway too, in Anthropic's error shape."""
    body = {
        k: v for k, v in {"model": TOOLS_MODEL, "max_tokens": 8, "messages": ASK, **change}.items() if v is not None
    }
    reference = httpx.post(tool_servers.serve_url + "/v1/messages", json=body, timeout=60)
    ours = httpx.post(tool_servers.gateway_url + "/v1/messages", json=body, timeout=60)
    assert reference.status_code == ours.status_code == 400
    assert ours.json()["type"] == "error" and ours.json()["error"]["type"] == "invalid_request_error"
    assert words in ours.json()["error"]["message"]


def test_a_responses_function_call_round_trip_matches(tool_servers: ToolServers) -> None:
    """The Responses API's tool flow through the openai SDK, against each server: a
    ``function_call`` output item (``auto``, the call scripted as for chat), sent back with
    its ``function_call_output``; the calls and the reply the same on both."""


def test_a_responses_function_call_round_trip_is_the_chat_flows(tool_servers: ToolServers) -> None:
    """The Responses API's tool flow through the openai SDK: a ``function_call`` output item
    (``auto``, the call scripted as for chat), sent back with its ``function_call_output``,
    gives the calls and the reply that the same turns give through chat completions on the
    gateway. (Not against ``vllm serve``'s Responses API: with a tool parser, its structured
    outputs differ from run to run at temperature 0.)"""
    import openai

    tools: Any = [WEATHER, CLOCK]
    bias = {str(token): -100 for token in whitespace_tokens(tool_servers.tiny_model)}
    regex = {"regex": re.escape(SCRIPTED_CALL)}
    question = {"role": "user", "content": "What is the weather in Oslo?"}
    answer = json.dumps({"forecast": "sunny"})
    asked: Any = {"temperature": 0, "logit_bias": bias}
    with openai.OpenAI(base_url=tool_servers.gateway_url + "/v1", api_key="unused", max_retries=0, timeout=120) as sdk:
        first = sdk.responses.create(
            model=TOOLS_MODEL, input=[question], tools=[{"type": "function", **t["function"]} for t in tools],
            tool_choice="auto", temperature=0, max_output_tokens=80, store=False,
            extra_body={"logit_bias": bias, "chat_template_kwargs": NO_THINKING, "structured_outputs": regex},
        )  # fmt: skip
        calls = [item for item in first.output if item.type == "function_call"]
        sent_back = [call.model_dump(exclude_none=True) for call in calls]
        outputs = [{"type": "function_call_output", "call_id": call.call_id, "output": answer} for call in calls]
        reply = sdk.responses.create(
            model=TOOLS_MODEL, input=[question, *sent_back, *outputs],
            tools=[{"type": "function", **t["function"]} for t in tools], temperature=0, max_output_tokens=8,
            store=False, extra_body={"ignore_eos": True, "chat_template_kwargs": NO_THINKING},
        )  # fmt: skip
        chat = sdk.chat.completions.create(
            model=TOOLS_MODEL, messages=[question], tools=tools, tool_choice="auto", max_tokens=80,
            extra_body={"chat_template_kwargs": NO_THINKING, "structured_outputs": regex}, **asked,
        )  # fmt: skip
        message = chat.choices[0].message
        chat_calls = message.tool_calls or []
        tool_answers = [{"role": "tool", "tool_call_id": c.id, "content": answer} for c in chat_calls]
        chat_reply = sdk.chat.completions.create(
            model=TOOLS_MODEL, tools=tools, temperature=0, max_tokens=8, messages=[question, message, *tool_answers],
            extra_body={"ignore_eos": True, "chat_template_kwargs": NO_THINKING},
        )  # fmt: skip
    assert [call.name for call in calls] == ["get_weather"]  # the strict tool's grammar picks the city
    assert [(c.function.name, json.loads(c.function.arguments)) for c in chat_calls] == [  # type: ignore[union-attr]
        (call.name, json.loads(call.arguments)) for call in calls
    ]
    assert reply.output_text and reply.output_text == chat_reply.choices[0].message.content


def test_responses_reasoning_items_are_vllm_serves(tool_servers: ToolServers) -> None:
    """The workers' reasoning parser gives the Responses API's ``reasoning`` item, as on
    ``vllm serve``: with thinking on and no ``</think>`` written, the whole output."""
    import openai

    body: Any = {
        "model": TOOLS_MODEL,
        "input": "What is the weather in Oslo?",
        "max_output_tokens": MAX_TOKENS,
        "temperature": 0,
        "store": False,
        "extra_body": {"ignore_eos": True},
    }
    answers = []
    for url in (tool_servers.gateway_url, tool_servers.serve_url):
        with openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120) as sdk:
            answers.append(sdk.responses.create(**body))
    ours, reference = answers
    assert [item.type for item in ours.output] == [item.type for item in reference.output] == ["reasoning"]
    assert ours.output[0].content == reference.output[0].content  # type: ignore[union-attr]
    assert ours.usage is not None and reference.usage is not None
    assert ours.usage.output_tokens_details.reasoning_tokens == reference.usage.output_tokens_details.reasoning_tokens


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(
    "extra", [{"include_reasoning": False}, {"reasoning_effort": "none"}], ids=["no-reasoning", "effort-none"]
)
def test_the_reasoning_fields_change_the_answer_as_in_vllm_serve(
    tool_servers: ToolServers, stream: bool, extra: dict[str, Any]
) -> None:
    """``include_reasoning: false`` drops the reasoning; ``reasoning_effort: none`` turns
    thinking off (``enable_thinking``), so the parser reads the output as content: both
    as ``vllm serve`` answers them, and unlike the answer without them (all reasoning)."""
    body = weather_question(stream=stream, **extra)
    if stream:
        ours, reference = cut_alike(tool_servers, body)
        message = streamed_message(ours)
        assert message == streamed_message(reference)
    else:
        (whole,), _ = post(tool_servers.gateway_url, "/v1/chat/completions", body)
        (reference_whole,), _ = post(tool_servers.serve_url, "/v1/chat/completions", body)
        assert comparable(whole) == comparable(reference_whole)
        message = whole["choices"][0]["message"]
    assert not message["reasoning"]
    assert bool(message["content"]) == ("reasoning_effort" in extra)


def test_continuous_usage_counts_the_reasoning_so_far_as_vllm_serve(tool_servers: ToolServers) -> None:
    """``stream_options.continuous_usage_stats`` on a worker with a reasoning parser: every
    chunk's usage counts its reasoning tokens so far, as ``vllm serve``'s does."""
    usage = {"include_usage": True, "continuous_usage_stats": True}
    body = weather_question(stream=True, return_token_ids=True, stream_options=usage)
    ours, reference = cut_alike(tool_servers, body)
    assert [chunk["usage"] for chunk in ours] == [chunk["usage"] for chunk in reference]
    assert reference[1]["usage"]["completion_tokens_details"]["reasoning_tokens"] >= 1
