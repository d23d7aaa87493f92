"""The gateway answers a pooling model's APIs as ``vllm serve`` does: a real ``vllm serve``
and a real gateway in front of a real worker, both running the tiny model as an embedding
model (``--runner pooling --convert embed``), the same bodies sent to both, their
responses compared whole (only ids and timestamps may differ; vectors and scores within
1e-5). Bodies either refuses are refused by both, and the worker answers after them."""

from __future__ import annotations

import base64
import json
import math
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy
import openai
import pytest

from devkit.worker_process import tiny_engine_flags
from tests.support.vllm_serve import VARYING, beside_a_worker

MODEL = "tiny-embed-as-vllm-serve"
"""Served under a name of its own, on a queue of its own: no other worker of the session answers."""
QUEUE = f"streamq:queue:{MODEL}"
TOLERANCE = 1e-5
LONG_TEXT = "the quick brown fox jumps over the lazy dog " * 80
"""Far more tokens than the tiny model's context (256)."""


@pytest.fixture(scope="module")
def servers(
    worker_url: str, gateway_url: str, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, str]]:
    """``vllm serve``'s URL and the gateway's, each in front of the tiny model as an embedding model."""
    flags = [*tiny_engine_flags(tiny_model), "--runner", "pooling", "--convert", "embed", "--served-model-name", MODEL]
    logs = tmp_path_factory.mktemp("embeddings-vs-vllm-serve")
    with beside_a_worker(flags, worker_url=worker_url, gateway_url=gateway_url, queue=QUEUE, logs=logs) as urls:
        yield urls


def _both(servers: tuple[str, str], path: str, body: dict[str, Any]) -> tuple[httpx.Response, httpx.Response]:
    serve, gateway = servers
    return httpx.post(serve + path, json=body, timeout=120), httpx.post(gateway + path, json=body, timeout=120)


def _assert_close(theirs: Any, ours: Any, where: str = "") -> None:
    """``ours`` equals ``theirs`` but for ids and timestamps, floats within ``TOLERANCE``,
    base64 vectors compared as the floats they hold."""
    if isinstance(theirs, dict):
        assert isinstance(ours, dict) and list(ours) == list(theirs), f"{where}: {list(ours)} != {list(theirs)}"
        for key, value in theirs.items():
            if key not in VARYING:
                _assert_close(value, ours[key], f"{where}.{key}")
    elif isinstance(theirs, list):
        assert isinstance(ours, list) and len(ours) == len(theirs), f"{where}: lengths differ"
        for i, (a, b) in enumerate(zip(theirs, ours, strict=True)):
            _assert_close(a, b, f"{where}[{i}]")
    elif isinstance(theirs, float):
        assert isinstance(ours, float) and math.isclose(theirs, ours, abs_tol=TOLERANCE), f"{where}: {ours} != {theirs}"
    elif isinstance(theirs, str) and where.endswith((".embedding", ".data")):
        a, b = (numpy.frombuffer(base64.b64decode(s), dtype="<f4") for s in (theirs, ours))
        assert a.shape == b.shape and numpy.allclose(a, b, rtol=0, atol=TOLERANCE), where
    else:
        assert ours == theirs, f"{where}: {ours!r} != {theirs!r}"


def _assert_same(servers: tuple[str, str], path: str, body: dict[str, Any]) -> dict[str, Any]:
    theirs, ours = _both(servers, path, {"model": MODEL, **body})
    assert theirs.status_code == 200, theirs.text
    assert ours.status_code == 200, ours.text
    _assert_close(theirs.json(), ours.json())
    return dict(ours.json())


@pytest.mark.parametrize(
    "body",
    [
        pytest.param({"input": "The key to happiness is"}, id="a text"),
        pytest.param({"input": ["one text", "another, longer text", "x"]}, id="a list of texts"),
        pytest.param({"input": ["one text", "two texts"], "encoding_format": "base64"}, id="base64"),
        pytest.param({"input": [5, 6, 7, 8]}, id="token ids"),
        pytest.param({"input": [[5, 6], [7, 8, 9]]}, id="token-id lists"),
        pytest.param({"input": [LONG_TEXT, "short"], "truncate_prompt_tokens": 10}, id="truncate_prompt_tokens"),
        pytest.param({"input": "no special tokens", "add_special_tokens": False}, id="add_special_tokens"),
        pytest.param({"input": "raw", "use_activation": False, "user": "someone"}, id="use_activation"),
    ],
)
def test_embeddings_match_vllm_serve(servers: tuple[str, str], body: dict[str, Any]) -> None:
    ours = _assert_same(servers, "/v1/embeddings", body)
    assert ours["id"].startswith("embd-") and ours["usage"]["prompt_tokens"] > 0


def test_truncated_inputs_count_the_kept_tokens(servers: tuple[str, str]) -> None:
    ours = _assert_same(servers, "/v1/embeddings", {"input": [LONG_TEXT], "truncate_prompt_tokens": 10})
    assert ours["usage"]["prompt_tokens"] == 10


def test_the_response_id_ends_with_x_request_id_as_vllm_serves(servers: tuple[str, str]) -> None:
    for url in servers:
        name = f"embed-{uuid.uuid4().hex}"
        response = httpx.post(
            url + "/v1/embeddings", json={"model": MODEL, "input": "x"}, headers={"X-Request-Id": name}, timeout=120
        )
        assert response.status_code == 200 and response.json()["id"] == f"embd-{name}", response.text


def test_dimensions_are_refused_or_taken_alike(servers: tuple[str, str]) -> None:
    theirs, ours = _both(servers, "/v1/embeddings", {"model": MODEL, "input": "x", "dimensions": 8})
    assert ours.status_code == theirs.status_code, (theirs.text, ours.text)
    if theirs.status_code == 200:
        _assert_close(theirs.json(), ours.json())


def test_pooling_matches_vllm_serve(servers: tuple[str, str]) -> None:
    ours = _assert_same(servers, "/pooling", {"input": ["one text", "another"]})
    assert ours["id"].startswith("pooling-")


@pytest.mark.parametrize(
    "body",
    [
        pytest.param({"queries": "What is the capital?", "documents": ["Paris it is", "Bananas", "x"]}, id="1:N"),
        pytest.param({"text_1": ["a", "b"], "text_2": ["a", "c"]}, id="N:N text_1/text_2"),
        pytest.param({"data_1": "a", "data_2": "b"}, id="1:1 data_1/data_2"),
    ],
)
@pytest.mark.parametrize("path", ["/score", "/v1/score"])
def test_score_matches_vllm_serves_bi_encoder(servers: tuple[str, str], path: str, body: dict[str, Any]) -> None:
    ours = _assert_same(servers, path, body)
    assert ours["id"].startswith("score-")


@pytest.mark.parametrize("top_n", [0, 2])
@pytest.mark.parametrize("path", ["/rerank", "/v1/rerank"])
def test_rerank_matches_vllm_serve(servers: tuple[str, str], path: str, top_n: int) -> None:
    body = {"query": "What is the capital?", "documents": ["Paris it is", "Bananas", "The capital is Paris"]}
    ours = _assert_same(servers, path, {**body, "top_n": top_n})
    assert len(ours["results"]) == (top_n or 3)


def test_the_openai_sdk_embeds_through_the_gateway(servers: tuple[str, str]) -> None:
    serve, gateway = servers
    vectors = []
    for url in (serve, gateway):
        with openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120) as client:
            result = client.embeddings.create(model=MODEL, input=["first", "second"])  # base64 under the hood
            assert [item.index for item in result.data] == [0, 1]
            vectors.append(numpy.array([item.embedding for item in result.data]))
            assert result.usage.prompt_tokens == result.usage.total_tokens > 0
    assert vectors[0].shape == vectors[1].shape and numpy.allclose(vectors[0], vectors[1], rtol=0, atol=TOLERANCE)


def test_an_api_the_model_lacks_is_refused_by_both(servers: tuple[str, str]) -> None:
    """``vllm serve`` registers no ``/classify`` for an embedding model: a 404; the gateway
    answers 404 with the words of vLLM's handler."""
    theirs, ours = _both(servers, "/classify", {"model": MODEL, "input": "x"})
    assert (theirs.status_code, ours.status_code) == (404, 404), (theirs.text, ours.text)
    assert ours.json()["error"]["message"] == "The model does not support Classification API"


def test_an_input_past_the_context_is_a_400_naming_its_index(servers: tuple[str, str]) -> None:
    theirs, ours = _both(servers, "/v1/embeddings", {"model": MODEL, "input": ["short", LONG_TEXT]})
    assert (theirs.status_code, ours.status_code) == (400, 400), (theirs.text, ours.text)
    message = ours.json()["error"]["message"]
    assert message.startswith("inputs[1]: ") and "maximum context length" in message


@pytest.mark.parametrize(
    "body",
    [
        pytest.param({"input": 7}, id="a number"),
        pytest.param({"input": [1, "a"]}, id="mixed"),
        pytest.param({"input": "x", "encoding_format": "hex"}, id="encoding_format"),
        pytest.param({"input": "x", "normalize": True}, id="normalize"),
        pytest.param({"input": "x", "truncate_prompt_tokens": -2}, id="truncate_prompt_tokens"),
    ],
)
def test_a_bad_body_is_a_400_from_both_and_the_worker_answers_after(
    servers: tuple[str, str], body: dict[str, Any]
) -> None:
    theirs, ours = _both(servers, "/v1/embeddings", {"model": MODEL, **body})
    assert (theirs.status_code, ours.status_code) == (400, 400), (theirs.text, ours.text)
    assert ours.json()["error"]["type"] == "invalid_request_error"
    _assert_same(servers, "/v1/embeddings", {"input": "still answering"})


def test_an_empty_input_list_is_a_400_and_the_worker_answers_after(servers: tuple[str, str]) -> None:
    response = httpx.post(servers[1] + "/v1/embeddings", json={"model": MODEL, "input": []}, timeout=120)
    assert response.status_code == 400 and response.json()["error"]["param"] == "input", response.text
    _assert_same(servers, "/v1/embeddings", {"input": "still answering"})


POOLING_LINES: list[tuple[str, str, dict[str, Any]]] = [
    ("embed", "/v1/embeddings", {"input": ["one text", "another"]}),
    ("embed-b64", "/v1/embeddings", {"input": "x", "encoding_format": "base64"}),
    ("score", "/score", {"text_1": "a question", "text_2": ["an answer", "a banana"]}),
    ("rerank", "/v1/rerank", {"query": "a question", "documents": ["a banana", "an answer"], "top_n": 1}),
    ("too-long", "/v1/embeddings", {"input": ["short", LONG_TEXT]}),
]
"""Batch lines of the pooling APIs, as ``vllm run-batch`` reads them: each answered as the
path is by ``vllm serve``; the too-long one a 400 naming its input."""


def _batch_line(custom_id: str, url: str, body: dict[str, Any]) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": {"model": MODEL, **body}})


def _assert_lines_answered_as_vllm_serve(servers: tuple[str, str], outputs: dict[str, dict[str, Any]]) -> None:
    for custom_id, url, body in POOLING_LINES:
        if custom_id not in outputs:
            continue
        if custom_id == "too-long":
            assert outputs[custom_id]["status_code"] == 400, outputs[custom_id]
            continue
        theirs = httpx.post(servers[0] + url, json={"model": MODEL, **body}, timeout=120)
        assert theirs.status_code == 200 and outputs[custom_id]["status_code"] == 200, outputs[custom_id]
        _assert_close(theirs.json(), outputs[custom_id]["body"], custom_id)


def test_a_batch_file_of_pooling_lines_is_answered_as_vllm_serve_answers_them(
    servers: tuple[str, str], producer_url: str, tmp_path: Path
) -> None:
    source, results = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_text("".join(_batch_line(*line) + "\n" for line in POOLING_LINES))
    command = [sys.executable, "-m", "producer", "batch", str(source), str(results), "--redis-url", producer_url]
    run = subprocess.run([*command, "--no-progress"], capture_output=True, text=True, timeout=240)
    assert run.returncode == 1, run.stderr  # one line failed
    lines = [json.loads(line) for line in results.read_text().splitlines()]
    outputs = {line["custom_id"]: {**line["response"], "error": line["error"]} for line in lines}
    assert sorted(outputs) == sorted(custom_id for custom_id, _, _ in POOLING_LINES)
    assert outputs["too-long"]["error"].startswith("invalid_request: inputs[1]: ")
    _assert_lines_answered_as_vllm_serve(servers, outputs)


def test_the_batch_api_runs_an_embeddings_batch_as_vllm_serve_answers_its_lines(servers: tuple[str, str]) -> None:
    embeddings = [line for line in POOLING_LINES if line[1] == "/v1/embeddings"]
    data = "".join(_batch_line(*line) + "\n" for line in embeddings).encode()
    with openai.OpenAI(base_url=servers[1] + "/v1", api_key="unused", max_retries=0, timeout=120) as sdk:
        upload = sdk.files.create(file=("embeddings.jsonl", data), purpose="batch")
        batch = sdk.batches.create(input_file_id=upload.id, endpoint="/v1/embeddings", completion_window="24h")
        deadline = time.monotonic() + 120
        while batch.status not in ("completed", "failed", "expired", "cancelled"):
            assert time.monotonic() < deadline, batch
            time.sleep(0.3)
            batch = sdk.batches.retrieve(batch.id)
        assert batch.status == "completed", batch
        assert batch.request_counts is not None and (batch.request_counts.completed, batch.request_counts.failed) == (
            len(embeddings) - 1,
            1,
        )
        answered = [json.loads(x) for x in sdk.files.content(batch.output_file_id or "").text.splitlines()]
        failed = [json.loads(x) for x in sdk.files.content(batch.error_file_id or "").text.splitlines()]
    outputs = {line["custom_id"]: line["response"] for line in answered + failed}
    _assert_lines_answered_as_vllm_serve(servers, outputs)
