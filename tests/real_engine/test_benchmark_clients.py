"""The request bodies benchmark clients send by default are answered by the gateway.

guidellm 0.8.1 (the benchmark vLLM's and llm-d's teams publish their figures with) is not a
test dependency: it pins packages below this project's (``make guidellm-venv`` installs it
for ``bench/guidellm_run.py``). Its bodies are here as it sends them, captured from
``guidellm run --data kind=synthetic_text`` against a recording server (its request
handlers, ``guidellm/backends/openai/request_handlers.py``, build them): chat completions
streamed with ``continuous_usage_stats`` and ``max_completion_tokens``, and the Responses
API's ``input`` items with ``max_output_tokens``, both with vLLM's ``ignore_eos``.
``vllm bench serve`` and lm-eval are driven for real by ``test_gateway.py`` and
``test_gateway_matches_vllm_serve.py``.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from devkit.gateway_process import GatewayProcess

PROMPT = "1 0 m0 Finish medical w"
OUTPUT_TOKENS = 8


def guidellm_streamed(model: str, **fields: Any) -> dict[str, Any]:
    """What guidellm sends on both completion endpoints, with the endpoint's ``fields``."""
    return {
        "model": model,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        "ignore_eos": True,
        **fields,
    }


def guidellm_chat(model: str) -> dict[str, Any]:
    messages = [{"role": "user", "content": [{"type": "text", "text": PROMPT}]}]
    return guidellm_streamed(model, max_completion_tokens=OUTPUT_TOKENS, messages=messages)


def guidellm_completions(model: str) -> dict[str, Any]:
    return guidellm_streamed(model, max_tokens=OUTPUT_TOKENS, prompt=PROMPT)


def guidellm_responses(model: str) -> dict[str, Any]:
    return {
        "model": model,
        "stream": True,
        "max_output_tokens": OUTPUT_TOKENS,
        "ignore_eos": True,
        "input": [{"role": "user", "content": [{"type": "input_text", "text": PROMPT}]}],
    }


def streamed(url: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    """The JSON of each ``data:`` event of a streamed answer (``[DONE]`` left out)."""
    with httpx.stream("POST", url, json=body, timeout=120) as response:
        if response.status_code != 200:
            response.read()
            pytest.fail(f"{response.status_code}: {response.text}")
        data = [line.removeprefix("data: ") for line in response.iter_lines() if line.startswith("data: ")]
    return [json.loads(item) for item in data if item != "[DONE]"]


@pytest.mark.parametrize(
    ("path", "build"), [("/v1/chat/completions", guidellm_chat), ("/v1/completions", guidellm_completions)]
)
def test_guidellms_default_stream_is_answered_with_usage_in_every_chunk(
    gateway: GatewayProcess, model: str, path: str, build: Any
) -> None:
    """Each chunk carries the usage so far, as ``vllm serve`` sends it with
    ``continuous_usage_stats``; the last (usage alone) the whole request's."""
    chunks = streamed(gateway.url + path, build(model))
    assert chunks and all(chunk.get("usage") for chunk in chunks), chunks
    prompt_tokens = {chunk["usage"]["prompt_tokens"] for chunk in chunks}
    assert len(prompt_tokens) == 1
    completion = [chunk["usage"]["completion_tokens"] for chunk in chunks]
    assert completion == sorted(completion) and completion[-1] == OUTPUT_TOKENS
    for chunk in chunks:
        usage = chunk["usage"]
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]


def test_guidellms_default_responses_stream_is_answered(gateway: GatewayProcess, model: str) -> None:
    events = streamed(gateway.url + "/v1/responses", guidellm_responses(model))
    assert events[-1]["type"] == "response.completed", events[-1]
    usage = events[-1]["response"]["usage"]
    assert usage["output_tokens"] == OUTPUT_TOKENS
    deltas = [event for event in events if event["type"] == "response.output_text.delta"]
    assert deltas
    assert [event["sequence_number"] for event in events] == list(range(len(events)))
