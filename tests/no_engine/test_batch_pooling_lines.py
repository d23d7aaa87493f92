"""Batch lines for pooling models (``/v1/embeddings``, ``/score``, ``/rerank``): each one
pooling request of many inputs, its output ``vllm serve``'s response body; no Redis, no engine."""

from __future__ import annotations

import json

import numpy
import pytest

from gateway.routes.batches import BATCH_ENDPOINTS
from producer.batch import line_submit_kwargs, read_batch
from producer.client import Completion
from producer.errors import InvalidRequest
from producer.openai_api.endpoints import ENDPOINTS
from producer.openai_api.limits import DEFAULT_LIMITS
from producer.pooled import Pooled
from streamq.protocol import Pooling


def _line(url: str, body: dict[str, object]) -> str:
    return json.dumps({"custom_id": "c1", "method": "POST", "url": url, "body": body})


def _kwargs(url: str, body: dict[str, object]) -> dict[str, object]:
    (line,) = read_batch([_line(url, body)])
    return line_submit_kwargs(line, limits=DEFAULT_LIMITS, priority=10, tenant=None, affinity={})


def _finished(vectors: list[list[float]], tokens: list[int]) -> Completion:
    data = numpy.asarray(vectors, dtype="<f4").tobytes()
    pooled = Pooled("r1", [[len(v)] for v in vectors], tokens, data)
    return Completion("r1", [""], [[]], ["stop"], sum(tokens), 0, pooled=pooled)


def test_an_embeddings_line_is_one_request_of_all_its_inputs_at_the_batch_priority() -> None:
    kwargs = _kwargs("/v1/embeddings", {"model": "emb", "input": [[5, 6], [1, 2]], "truncate_prompt_tokens": 8})
    assert kwargs["model"] == "emb"
    assert kwargs["inputs"] == [[5, 6], [1, 2]]
    assert kwargs["pooling"] == Pooling(task="embed")
    assert kwargs["truncate_prompt_tokens"] == 8
    assert kwargs["priority"] == 10


@pytest.mark.parametrize(
    "body", [{"model": "emb", "input": []}, {"model": "emb", "input": [{"a": 1}]}, {"model": "emb"}]
)
def test_an_embeddings_line_with_bad_input_cannot_run(body: dict[str, object]) -> None:
    with pytest.raises(InvalidRequest):
        _kwargs("/v1/embeddings", body)


def test_an_embeddings_lines_output_is_the_embedding_response() -> None:
    endpoint = ENDPOINTS["/v1/embeddings"]
    body = {"model": "emb", "input": ["a", "b"], "encoding_format": "float"}
    response = endpoint.to_response(
        [_finished([[1.0, 0.0], [0.0, 0.5]], [2, 3])], model="emb", shape=endpoint.shape(body), created=7
    )
    assert response["object"] == "list" and response["created"] == 7 and response["model"] == "emb"
    assert [d["embedding"] for d in response["data"]] == [[1.0, 0.0], [0.0, 0.5]]
    assert response["usage"]["prompt_tokens"] == 5


def test_a_score_line_scores_each_document_against_the_query_by_cosine() -> None:
    endpoint = ENDPOINTS["/score"]
    body = {"model": "emb", "text_1": "q", "text_2": ["same", "orthogonal"]}
    kwargs = _kwargs("/score", body)
    assert kwargs["inputs"] == ["q", "same", "orthogonal"]
    completion = _finished([[1.0, 0.0], [1.0, 0.0], [0.0, 1.0]], [1, 1, 1])
    response = endpoint.to_response([completion], model="emb", shape=endpoint.shape(body))
    assert [round(d["score"], 6) for d in response["data"]] == [1.0, 0.0]


def test_the_batch_api_takes_the_pooling_endpoints_vllm_run_batch_reads() -> None:
    assert {"/v1/embeddings", "/score", "/v1/score", "/rerank", "/v1/rerank"} <= set(BATCH_ENDPOINTS)
    assert {"/v1/embeddings", "/score", "/v1/score", "/rerank", "/v1/rerank"} <= set(ENDPOINTS)
