"""vLLM's pooling APIs' bodies to one pooling request, and its results to the response
bodies (checked against vLLM 0.32's own protocol classes and its bi-encoder scoring)."""

from __future__ import annotations

import base64
import warnings
from pathlib import Path

import numpy
import pytest

from producer.errors import InvalidParameter
from producer.openai_api.errors import ApiError, api_error_for
from producer.openai_api.fields import Support, table_markdown
from producer.openai_api.pooling import (
    CLASSIFY,
    EMBEDDINGS,
    POOLING,
    RERANK,
    SCORE,
    check_model_tasks,
    parse_pooling_body,
    pooling_response,
)
from producer.openai_api.pooling_fields import POOLING_FIELDS, pooling_summary
from producer.pooled import Pooled
from streamq.protocol import MAX_POOLING_INPUTS, InvalidRequest, Pooling

with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)  # torch's own, raised while vLLM imports
    import torch
    from vllm.entrypoints.pooling.classify import protocol as classify_protocol
    from vllm.entrypoints.pooling.embed import protocol as embed_protocol
    from vllm.entrypoints.pooling.pooling import protocol as pooling_protocol
    from vllm.entrypoints.pooling.scoring import protocol as scoring_protocol
    from vllm.entrypoints.serve.engine.protocol import UsageInfo

GATEWAY_PAGE = Path(__file__).resolve().parents[2] / "docs" / "gateway.md"
VECTORS = numpy.array([[0.6, 0.8, 0.0], [1.0, 0.0, 0.0], [0.0, 0.6, -0.8]], dtype="<f4")
POOLED = Pooled("r1", [[3]] * 3, [2, 3, 4], VECTORS.tobytes())


def _usage() -> UsageInfo:
    return UsageInfo(prompt_tokens=9, total_tokens=9)


# --- bodies ---


@pytest.mark.parametrize(
    ("value", "inputs"),
    [
        ("one text", ["one text"]),
        (["a", "b"], ["a", "b"]),
        ([5, 6, 7], [[5, 6, 7]]),
        ([[5], [6, 7]], [[5], [6, 7]]),
    ],
)
def test_embeddings_input_takes_vllms_four_forms(value: object, inputs: list[object]) -> None:
    call = parse_pooling_body("/v1/embeddings", {"model": "m", "input": value})
    assert call.inputs == inputs
    assert call.submit_kwargs() == {"model": "m", "inputs": inputs, "pooling": Pooling(), "add_special_tokens": True}


def test_embeddings_fields_map_onto_the_pooling_request() -> None:
    body = {
        "input": "x",
        "encoding_format": "base64",
        "dimensions": 8,
        "truncate_prompt_tokens": 10,
        "add_special_tokens": False,
        "user": "someone",
        "priority": -3,
        "use_activation": False,
        "request_id": "mine-1",
    }
    call = parse_pooling_body("/v1/embeddings", body)
    assert call.model is None and call.encoding_format == "base64"
    assert call.pooling == Pooling(task="embed", dimensions=8, use_activation=False)
    assert call.options == {"truncate_prompt_tokens": 10, "add_special_tokens": False, "priority": -3}
    assert call.response_id() == "embd-mine-1"
    assert call.response_id("hdr") == "embd-hdr"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": []}, "input"),
        ({}, "input"),
        ({"input": 7}, "input"),
        ({"input": [1, "a"]}, "input"),
        ({"input": [[1], []]}, "input"),
        ({"input": [-1]}, "input"),
        ({"input": ["x"] * (MAX_POOLING_INPUTS + 1)}, "input"),
        ({"input": [{"role": "user", "content": "hi"}]}, "input"),
        ({"input": "x", "encoding_format": "bytes"}, "encoding_format"),
        ({"input": "x", "encoding_format": "hex"}, "encoding_format"),
        ({"input": "x", "dimensions": 0}, "dimensions"),
        ({"input": "x", "dimensions": "8"}, "dimensions"),
        ({"input": "x", "truncate_prompt_tokens": -2}, "truncate_prompt_tokens"),
        ({"input": "x", "add_special_tokens": "yes"}, "add_special_tokens"),
        ({"input": "x", "use_activation": 1}, "use_activation"),
        ({"input": "x", "priority": 2**40}, "priority"),
        ({"input": "x", "user": 5}, "user"),
        ({"input": "x", "padding": "max_length"}, "padding"),
        ({"input": "x", "embed_dtype": "float16"}, "embed_dtype"),
        ({"input": "x", "request_id": "has space"}, "request_id"),
    ],
)
def test_a_bad_embeddings_body_is_a_400_naming_its_field(body: dict[str, object], param: str) -> None:
    with pytest.raises(InvalidParameter) as caught:
        parse_pooling_body("/v1/embeddings", body)
    error = api_error_for(caught.value)
    assert (error.status, error.param, error.body()["error"]["type"]) == (400, param, "invalid_request_error")


def test_normalize_is_refused_with_vllms_words() -> None:
    with pytest.raises(InvalidParameter, match="`normalize` was removed; use `use_activation` instead"):
        parse_pooling_body("/v1/embeddings", {"input": "x", "normalize": True})


def test_a_body_that_is_not_an_object_is_refused() -> None:
    with pytest.raises(InvalidRequest, match="JSON object"):
        parse_pooling_body("/v1/embeddings", ["x"])


def test_pooling_runs_the_models_task_and_refuses_dimensions_as_vllm() -> None:
    assert parse_pooling_body("/pooling", {"input": "x"}).pooling == Pooling(task="embed")
    assert parse_pooling_body("/pooling", {"input": "x"}, default_task="classify").pooling.task == "classify"
    with pytest.raises(InvalidParameter, match="dimensions is currently not supported"):
        parse_pooling_body("/pooling", {"input": "x", "dimensions": 4})
    with pytest.raises(InvalidParameter, match="Unsupported task: 'token_embed'"):
        parse_pooling_body("/pooling", {"input": "x", "task": "token_embed"})


def test_classify_is_a_classify_request() -> None:
    call = parse_pooling_body("/classify", {"input": ["a"], "use_activation": True})
    assert call.pooling == Pooling(task="classify", use_activation=True)


@pytest.mark.parametrize("names", [("queries", "documents"), ("text_1", "text_2"), ("data_1", "data_2")])
def test_score_takes_vllms_field_names_and_embeds_queries_then_documents(names: tuple[str, str]) -> None:
    call = parse_pooling_body("/score", {names[0]: "q", names[1]: ["d1", "d2"]})
    assert (call.inputs, call.queries, call.pooling) == (["q", "d1", "d2"], 1, Pooling(task="embed"))
    assert "add_special_tokens" not in call.options


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"queries": ["a", "b"], "documents": ["c", "d", "e"]}, "Input lengths must be either 1:1, 1:N or N:N"),
        ({"queries": [], "documents": ["c"]}, "At least one text element must be given"),
        ({"queries": "a", "documents": []}, "At least one text_pair element must be given"),
        ({"query": "a"}, "a score body needs one pair of fields"),
        ({"queries": "a", "documents": [{"content": []}]}, "streamq scores text only"),
        (
            {"queries": "a", "documents": "b", "max_tokens_per_doc": 5},
            "max_tokens_per_doc=5 is not supported by streamq",
        ),
    ],
)
def test_a_bad_score_body_is_a_400(body: dict[str, object], message: str) -> None:
    with pytest.raises(InvalidRequest, match=message) as caught:
        parse_pooling_body("/v1/score", body)
    assert api_error_for(caught.value).status == 400


def test_rerank_takes_a_query_documents_and_top_n() -> None:
    call = parse_pooling_body("/rerank", {"query": "q", "documents": ["a", "b"], "top_n": 1})
    assert (call.inputs, call.queries, call.documents, call.top_n) == (["q", "a", "b"], 1, ["a", "b"], 1)
    for body in ({"query": ["q"], "documents": ["a"]}, {"query": "q", "documents": "a", "top_n": -1}, {"query": "q"}):
        with pytest.raises(InvalidRequest):
            parse_pooling_body("/v1/rerank", body)


# --- responses, against vLLM's classes ---


def test_the_embeddings_response_is_vllms_embedding_response() -> None:
    call = parse_pooling_body("/v1/embeddings", {"input": ["a", "b", "c"]})
    body = pooling_response(call, POOLED, model="m", created=5, response_id="embd-1")
    data = [embed_protocol.EmbeddingResponseData(index=i, embedding=v.tolist()) for i, v in enumerate(VECTORS)]
    expected = embed_protocol.EmbeddingResponse(id="embd-1", created=5, model="m", data=data, usage=_usage())
    assert body == expected.model_dump()


def test_base64_embeddings_are_the_little_endian_float32_bytes() -> None:
    call = parse_pooling_body("/v1/embeddings", {"input": ["a", "b", "c"], "encoding_format": "base64"})
    body = pooling_response(call, POOLED, model="m")
    decoded = [numpy.frombuffer(base64.b64decode(item["embedding"]), dtype="<f4") for item in body["data"]]
    assert numpy.array_equal(numpy.stack(decoded), VECTORS)
    assert body["id"].startswith("embd-")


def test_the_pooling_response_is_vllms_pooling_response() -> None:
    call = parse_pooling_body("/pooling", {"input": ["a", "b", "c"]})
    body = pooling_response(call, POOLED, model="m", created=5, response_id="pooling-1")
    data = [pooling_protocol.PoolingResponseData(index=i, data=v.tolist()) for i, v in enumerate(VECTORS)]
    expected = pooling_protocol.PoolingResponse(id="pooling-1", created=5, model="m", data=data, usage=_usage())
    assert body == expected.model_dump()


def test_the_classify_response_is_vllms_with_the_label_of_the_best_class() -> None:
    call = parse_pooling_body("/classify", {"input": ["a", "b", "c"]})
    body = pooling_response(call, POOLED, model="m", created=5, response_id="classify-1", labels={0: "no", 1: "yes"})
    labels = ["yes", "no", "yes"]
    data = [
        classify_protocol.ClassificationData(index=i, label=labels[i], probs=v.tolist(), num_classes=3)
        for i, v in enumerate(VECTORS)
    ]
    expected = classify_protocol.ClassificationResponse(
        id="classify-1", created=5, model="m", data=data, usage=_usage()
    )
    assert body == expected.model_dump()


def _torch_cosine(a: numpy.ndarray, b: numpy.ndarray) -> float:
    return float(torch.nn.functional.cosine_similarity(torch.from_numpy(a), torch.from_numpy(b), dim=0))


def test_the_score_response_is_vllms_with_the_bi_encoders_cosine_similarities() -> None:
    call = parse_pooling_body("/score", {"queries": "q", "documents": ["a", "b"]})
    body = pooling_response(call, POOLED, model="m", created=5, response_id="score-1")
    scores = [_torch_cosine(VECTORS[0], VECTORS[1]), _torch_cosine(VECTORS[0], VECTORS[2])]
    data = [scoring_protocol.ScoreResponseData(index=i, score=s) for i, s in enumerate(scores)]
    expected = scoring_protocol.ScoreResponse(id="score-1", created=5, model="m", data=data, usage=_usage())
    for mine in body["data"]:
        mine["score"] = pytest.approx(mine["score"], abs=1e-6)
    assert body == expected.model_dump()


def test_n_queries_score_pairwise() -> None:
    pooled = Pooled("r", [[3]] * 4, [1] * 4, numpy.concatenate([VECTORS[:2], VECTORS[:2]]).tobytes())
    call = parse_pooling_body("/score", {"text_1": ["a", "b"], "text_2": ["a", "b"]})
    assert [item["score"] for item in pooling_response(call, pooled, model="m")["data"]] == pytest.approx([1.0, 1.0])


def test_the_rerank_response_is_vllms_best_first_and_cut_at_top_n() -> None:
    call = parse_pooling_body("/rerank", {"query": "q", "documents": ["a", "b"], "top_n": 1})
    body = pooling_response(call, POOLED, model="m", response_id="score-1")
    best = _torch_cosine(VECTORS[0], VECTORS[1])
    expected = scoring_protocol.RerankResponse(
        id="score-1",
        model="m",
        usage=scoring_protocol.RerankUsage(prompt_tokens=9, total_tokens=9),
        results=[
            scoring_protocol.RerankResult(
                index=0, document=scoring_protocol.RerankDocument(text="a"), relevance_score=best
            )
        ],
    ).model_dump()
    assert body["results"][0]["relevance_score"] == pytest.approx(best, abs=1e-6)
    body["results"][0]["relevance_score"] = best
    assert body == expected


def test_a_result_count_other_than_the_inputs_is_an_error() -> None:
    call = parse_pooling_body("/v1/embeddings", {"input": ["a"]})
    with pytest.raises(ValueError, match="3 results for 1 inputs"):
        pooling_response(call, POOLED, model="m")


# --- which models answer which API ---


@pytest.mark.parametrize(
    ("api", "tasks", "message"),
    [
        (EMBEDDINGS, {"generate"}, "The model does not support Embeddings API"),
        (EMBEDDINGS, {"classify"}, "The model does not support Embeddings API"),
        (CLASSIFY, {"embed"}, "The model does not support Classification API"),
        (POOLING, {"generate"}, "The model does not support Pooling API"),
        (SCORE, {"generate"}, "The model does not support Score API"),
        (RERANK, {"generate"}, "The model does not support Rerank (Score) API"),
    ],
)
def test_an_api_the_model_lacks_is_a_404_in_vllms_words(api: object, tasks: set[str], message: str) -> None:
    with pytest.raises(ApiError) as caught:
        check_model_tasks(api, tasks, "m")  # type: ignore[arg-type]
    assert (caught.value.status, caught.value.message) == (404, message)


def test_score_on_a_cross_encoder_is_a_400_that_says_why() -> None:
    with pytest.raises(ApiError) as caught:
        check_model_tasks(SCORE, {"classify"}, "ranker")
    assert caught.value.status == 400 and "cross-encoder" in caught.value.message


def test_an_api_the_model_has_or_an_unknown_model_passes() -> None:
    check_model_tasks(EMBEDDINGS, {"embed", "token_embed"}, "m")
    check_model_tasks(RERANK, {"embed"}, "m")
    check_model_tasks(CLASSIFY, set(), "m")


# --- the fields table ---


def test_every_field_of_vllms_pooling_requests_is_classified() -> None:
    classes = (
        embed_protocol.EmbeddingCompletionRequest,
        pooling_protocol.PoolingCompletionRequest,
        classify_protocol.ClassificationCompletionRequest,
        scoring_protocol.ScoreQueriesDocumentsRequest,
        scoring_protocol.ScoreQueriesItemsRequest,
        scoring_protocol.ScoreDataRequest,
        scoring_protocol.ScoreTextRequest,
        scoring_protocol.RerankRequest,
    )
    assert set(POOLING_FIELDS) == {name for cls in classes for name in cls.model_fields}


def test_the_gateway_page_shows_the_pooling_table() -> None:
    page = GATEWAY_PAGE.read_text(encoding="utf-8")
    assert pooling_summary() in " ".join(page.split())
    assert table_markdown(POOLING_FIELDS) in page


@pytest.mark.parametrize("name", [n for n, spec in POOLING_FIELDS.items() if spec.support is Support.REFUSED])
def test_a_refused_field_is_a_400_naming_it_and_its_default_passes(name: str) -> None:
    body = {"input": "x", "query": "q", "documents": ["d"]}
    with pytest.raises(InvalidParameter) as caught:
        parse_pooling_body("/v1/embeddings", {**body, name: "asks-for-something"})
    assert caught.value.param == name
    default = {"embed_dtype": "float32", "endianness": "little"}.get(name)
    parse_pooling_body("/v1/embeddings", {**body, name: default})
