"""A chat request's output read by vLLM's own parsers (``worker/chat_parsing.py``), without an
engine: vLLM's hermes tool parser on the tiny model's tokenizer, fed a tool call token by
token, as a worker feeds it. A request taken over mid-call has its parsers fed what the
earlier attempt sent; its subscriber must still get one well-formed call."""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import pytest

from streamq.protocol import FinishReason, ParsedOutput

with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)  # torch's own, raised while vLLM imports
    from transformers import AutoTokenizer
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.parser import ParserManager

    from worker.chat_parsing import TOOL_CALLS, OutputParsing

WEATHER = {
    "type": "function",
    "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}},
}
OUTPUT = 'Let me look. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
"""What a model that calls a tool writes (hermes markup): some content, then the call."""

Chunk = tuple[str, list[int]]


@pytest.fixture(scope="module")
def tokenizer(tiny_model: Path) -> Any:
    return AutoTokenizer.from_pretrained(tiny_model)


@pytest.fixture(scope="module")
def chunks(tokenizer: Any) -> list[Chunk]:
    """``OUTPUT`` one token per chunk, as a streamed request's DELTAs bring it."""
    ids = tokenizer.encode(OUTPUT, add_special_tokens=False)
    chunks = [(tokenizer.decode([token]), [token]) for token in ids]
    assert "".join(text for text, _ in chunks) == OUTPUT
    return chunks


def parsing(tokenizer: Any, *, streamed: bool) -> OutputParsing:
    request = ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "Weather?"}], "tools": [WEATHER]}
    )
    parser_cls = ParserManager.get_parser(tool_parser_name="hermes", enable_auto_tools=True)
    assert parser_cls is not None
    parser = parser_cls(tokenizer, request.tools, chat_template_kwargs={})  # type: ignore[arg-type]
    return OutputParsing(request, [parser], streamed=streamed, auto_tools=True, prompt_token_ids=[1, 2])


def feed(parsing: OutputParsing, chunks: list[Chunk], *, last: bool = True) -> list[ParsedOutput | None]:
    """Each chunk through ``parsing``; the last one ends the completion with ``stop``."""
    return [
        parsing.chunk(0, text, ids, FinishReason.STOP if last and i == len(chunks) - 1 else None)
        for i, (text, ids) in enumerate(chunks)
    ]


def assembled(outputs: list[ParsedOutput | None]) -> dict[str, Any]:
    """The streamed deltas as a client puts them together: content, calls (with their ids)
    and the finish reason the parsers gave."""
    content, calls, finish = "", {}, None
    for output in outputs:
        assert output is not None, "a streamed chunk is always parsed"
        finish = output.finish_reason or finish
        delta = output.message or {}
        content += delta.get("content") or ""
        for call in delta.get("tool_calls") or []:
            entry = calls.setdefault(call["index"], {"ids": [], "name": "", "arguments": ""})
            if call.get("id"):
                entry["ids"].append(call["id"])
            entry["name"] += (call.get("function") or {}).get("name") or ""
            entry["arguments"] += (call.get("function") or {}).get("arguments") or ""
    return {"content": content, "calls": [calls[i] for i in sorted(calls)], "finish_reason": finish}


def test_a_streamed_call_comes_as_deltas_of_one_call(tokenizer: Any, chunks: list[Chunk]) -> None:
    whole = assembled(feed(parsing(tokenizer, streamed=True), chunks))
    (call,) = whole["calls"]
    assert whole["content"].strip() == "Let me look."
    assert call["name"] == "get_weather" and json.loads(call["arguments"]) == {"city": "Oslo"}
    assert len(call["ids"]) == 1
    assert whole["finish_reason"] == TOOL_CALLS


@pytest.mark.parametrize("cut", [3, 8, 20, 30, -3])
def test_a_stream_taken_over_mid_call_still_yields_one_well_formed_call(
    tokenizer: Any, chunks: list[Chunk], cut: int
) -> None:
    """The first attempt sent ``chunks[:cut]``; the next one replays them into new parsers
    and sends the rest: the subscriber's deltas make the same single call."""
    undisturbed = assembled(feed(parsing(tokenizer, streamed=True), chunks))
    first = feed(parsing(tokenizer, streamed=True), chunks[:cut], last=False)
    taken_over = parsing(tokenizer, streamed=True)
    taken_over.replay(0, [text for text, _ in chunks[:cut]], [ids for _, ids in chunks[:cut]])
    rest = feed(taken_over, chunks[cut:])
    seen = assembled(first + rest)
    (call,) = seen["calls"]
    assert len(call["ids"]) == 1, "one call, named once"
    assert {**seen, "calls": [{**call, "ids": []}]} == {
        **undisturbed,
        "calls": [{**undisturbed["calls"][0], "ids": []}],
    }


def test_a_whole_response_taken_over_gets_the_whole_message(tokenizer: Any, chunks: list[Chunk]) -> None:
    """Not streamed: the message is parsed from the whole text once the completion ends,
    the earlier attempt's part included."""
    undisturbed = feed(parsing(tokenizer, streamed=False), chunks)
    assert undisturbed[:-1] == [None] * (len(chunks) - 1)
    taken_over = parsing(tokenizer, streamed=False)
    taken_over.replay(0, [text for text, _ in chunks[:10]], [ids for _, ids in chunks[:10]])
    (last,) = feed(taken_over, chunks[10:])[-1:]
    for output in (undisturbed[-1], last):
        assert output is not None and output.message is not None
        assert output.finish_reason == TOOL_CALLS
        (call,) = output.message["tool_calls"]
        assert call["function"] == {"name": "get_weather", "arguments": json.dumps({"city": "Oslo"})}
        assert output.message["content"].strip() == "Let me look."
