"""vLLM's pooling APIs (``/v1/embeddings``, ``/pooling``, ``/classify``, ``/score``,
``/rerank``) on the producer side, shared by the gateway and the batch runner.

``parse_pooling_body`` turns a body into a ``PoolingCall`` (``submit_kwargs()``: the
``inputs`` and ``Pooling`` of one streamq request, whatever the endpoint), and
``pooling_response`` builds the response body from the request's ``Pooled`` results as
``vllm serve`` 0.32's protocol classes dump them (``EmbeddingResponse``,
``PoolingResponse``, ``ClassificationResponse``, ``ScoreResponse``, ``RerankResponse``).

Score and rerank are an embedding model's (a bi-encoder's): the queries and documents are
embedded in one request and each pair scored by the cosine similarity of its vectors, as
vLLM's ``BiEncoderIOProcessor`` does. A cross-encoder (a ``classify`` model that scores a
query and a document together) is refused with a 400: streamq does not build its pair
prompts. A field vLLM takes that streamq cannot honour is refused naming it, never dropped.
"""

from __future__ import annotations

import math
import time
import uuid
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, Literal

from producer.errors import InvalidParameter
from producer.openai_api.errors import ApiError, ApiErrorType, bad_request
from producer.openai_api.fields import Support
from producer.openai_api.pooling_fields import POOLING_FIELDS
from producer.openai_api.requests import cache_salt_of, priority_of, truncate_prompt_tokens_of
from producer.pooled import Pooled
from streamq.protocol import MAX_POOLING_INPUTS, InvalidRequest, Pooling, is_valid_request_id

PoolingKind = Literal["embeddings", "pooling", "classify", "score", "rerank"]


@dataclass(frozen=True)
class PoolingApi:
    """One of vLLM's pooling APIs: its paths, its name in vLLM's refusal, and its ids' prefix."""

    kind: PoolingKind
    paths: tuple[str, ...]
    name: str
    """As ``vllm serve`` words a model that lacks it: "The model does not support <name>"."""
    id_prefix: str
    """``vllm serve``'s response ids: ``<prefix>-<request id>``."""


EMBEDDINGS: Final = PoolingApi("embeddings", ("/v1/embeddings",), "Embeddings API", "embd")
POOLING: Final = PoolingApi("pooling", ("/pooling",), "Pooling API", "pooling")
CLASSIFY: Final = PoolingApi("classify", ("/classify",), "Classification API", "classify")
SCORE: Final = PoolingApi("score", ("/score", "/v1/score"), "Score API", "score")
RERANK: Final = PoolingApi("rerank", ("/rerank", "/v1/rerank", "/v2/rerank"), "Rerank (Score) API", "score")
POOLING_APIS: Final = {api.kind: api for api in (EMBEDDINGS, POOLING, CLASSIFY, SCORE, RERANK)}
POOLING_PATHS: Final = {path: api for api in POOLING_APIS.values() for path in api.paths}
"""Each path ``vllm serve`` answers for a pooling model, to its API."""

SCORE_FIELD_PAIRS: Final = (("queries", "documents"), ("queries", "items"), ("data_1", "data_2"), ("text_1", "text_2"))
"""The names of a score body's two sides, in the order vLLM's ``ScoreRequest`` union tries them."""


@dataclass(frozen=True)
class PoolingCall:
    """A validated pooling body: what to submit, and what its response needs."""

    api: PoolingApi
    model: str | None
    inputs: list[str | list[int]]
    """Every input to run, in order (score and rerank: the queries, then the documents)."""
    pooling: Pooling
    options: dict[str, Any] = field(default_factory=dict)
    """``submit`` keywords beside ``inputs`` and ``pooling``: ``truncate_prompt_tokens``,
    ``add_special_tokens``, ``priority``, ``cache_salt``."""
    request_id: str | None = None
    """The body's ``request_id`` (vLLM's field), checked."""
    encoding_format: Literal["float", "base64"] = "float"
    queries: int = 0
    """Score and rerank: how many of ``inputs`` are queries (1: one query against every document)."""
    documents: list[str] = field(default_factory=list)
    """Rerank: the documents' texts, which its results echo."""
    top_n: int = 0
    """Rerank: the results kept (0: all)."""

    def submit_kwargs(self) -> dict[str, Any]:
        """``StreamqClient.submit`` keyword arguments of the call's one request (with ``model``
        where the body named one)."""
        kwargs: dict[str, Any] = {"inputs": self.inputs, "pooling": self.pooling, **self.options}
        if self.model is not None:
            kwargs["model"] = self.model
        return kwargs

    def response_id(self, request_id: str | None = None) -> str:
        """The response's ``id`` as ``vllm serve`` names it: its prefix, then the request's id
        (the ``X-Request-Id`` header's, else the body's, else a new one)."""
        return f"{self.api.id_prefix}-{request_id or self.request_id or uuid.uuid4().hex}"


def parse_pooling_body(path: str, body: object, *, default_task: Literal["embed", "classify"] = "embed") -> PoolingCall:
    """Validate a decoded JSON body of one of ``POOLING_PATHS``; raises ``InvalidRequest``
    (``InvalidParameter`` naming the field) for what ``vllm serve`` would refuse, and for what
    streamq cannot do. ``default_task``: ``/pooling``'s task when the body names none (the
    model's own: ``embed`` for an embedding model)."""
    api = POOLING_PATHS.get(path)
    if api is None:
        raise ValueError(f"{path} is not a pooling path: {', '.join(POOLING_PATHS)}")
    if not isinstance(body, Mapping):
        raise InvalidRequest(f"the request body must be a JSON object, got {type(body).__name__}")
    _refuse_removed(body)
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise InvalidParameter(f"model must be a string, got {_short(model)}", param="model")
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise InvalidParameter(f"user must be a string, got {_short(user)}", param="user")
    request_id = body.get("request_id")
    if request_id is not None and (not isinstance(request_id, str) or not is_valid_request_id(request_id)):
        raise InvalidParameter(
            "request_id must be letters, digits and '._:-', at most 128 characters", param="request_id"
        )
    common = dict(api=api, model=model or None, request_id=request_id, options=_options(body, api))
    use_activation = _optional_bool(body, "use_activation")
    if api.kind in ("score", "rerank"):
        return _scoring_call(api, body, common, use_activation)
    if "messages" in body or _is_chat(body.get("input")):
        raise InvalidParameter(f"streamq's {path} takes text or token ids as input, not chat messages", param="input")
    inputs = _inputs(body.get("input"))
    encoding = "float"
    if api.kind in ("embeddings", "pooling"):
        encoding = _encoding_format(body)
    if api.kind == "classify":  # vLLM's classify body has no dimensions: ignored, as vllm serve ignores it
        pooling = Pooling(task="classify", use_activation=use_activation)
    elif api.kind == "pooling":
        if body.get("dimensions") is not None:  # vLLM's words
            raise InvalidParameter("dimensions is currently not supported", param="dimensions")
        task = body.get("task") or default_task
        if task not in ("embed", "classify"):
            raise InvalidParameter(
                f"Unsupported task: {task!r}: streamq's /pooling runs 'embed' and 'classify'", param="task"
            )
        pooling = Pooling(task=task, use_activation=use_activation)
    else:
        pooling = Pooling(task="embed", dimensions=_dimensions(body), use_activation=use_activation)
    return PoolingCall(inputs=inputs, pooling=pooling, encoding_format=encoding, **common)  # type: ignore[arg-type]


def _scoring_call(
    api: PoolingApi, body: Mapping[str, Any], common: dict[str, Any], use_activation: bool | None
) -> PoolingCall:
    """A score or rerank body: its two sides, checked as vLLM's ``validate_score_input``."""
    top_n = 0
    if api.kind == "rerank":
        if "query" not in body or "documents" not in body:
            raise InvalidRequest("a rerank body needs 'query' and 'documents'")
        first, second = _score_side(body["query"], "query", single=True), _score_side(body["documents"], "documents")
        top_n = body.get("top_n") or 0
        if not isinstance(top_n, int) or isinstance(top_n, bool) or top_n < 0:
            raise InvalidParameter(f"top_n must be an integer of 0 or more, got {_short(top_n)}", param="top_n")
    else:
        names = next((pair for pair in SCORE_FIELD_PAIRS if pair[0] in body and pair[1] in body), None)
        if names is None:
            pairs = ", ".join(f"{a}/{b}" for a, b in SCORE_FIELD_PAIRS)
            raise InvalidRequest(f"a score body needs one pair of fields: {pairs}")
        first, second = _score_side(body[names[0]], names[0]), _score_side(body[names[1]], names[1])
    # vLLM's words (validate_score_input)
    if len(first) > 1 and len(first) != len(second):
        raise InvalidRequest("Input lengths must be either 1:1, 1:N or N:N")
    if not first:
        raise InvalidRequest("At least one text element must be given")
    if not second:
        raise InvalidRequest("At least one text_pair element must be given")
    inputs: list[str | list[int]] = [*first, *second]
    if len(inputs) > MAX_POOLING_INPUTS:
        raise InvalidRequest(f"{len(inputs)} texts to embed; the limit is {MAX_POOLING_INPUTS} per request")
    pooling = Pooling(task="embed", use_activation=use_activation)
    documents = second if api.kind == "rerank" else []
    return PoolingCall(inputs=inputs, pooling=pooling, queries=len(first), documents=documents, top_n=top_n, **common)


def _score_side(value: object, name: str, *, single: bool = False) -> list[str]:
    """One side of a score: a text or a list of texts (vLLM's multimodal content is refused)."""
    items = [value] if isinstance(value, str) or single else value
    if not isinstance(items, list):
        raise InvalidParameter(f"{name} must be a string or a list of strings, got {_short(value)}", param=name)
    for item in items:
        if not isinstance(item, str):
            kind = "a string" if single else "a string or a list of strings"
            raise InvalidParameter(f"{name} must be {kind} (streamq scores text only), got {_short(item)}", param=name)
    return list(items)


def _refuse_removed(body: Mapping[str, Any]) -> None:
    """``normalize``, which vLLM 0.32 removed (its words), and the fields ``POOLING_FIELDS``
    refuses, unless they carry their default."""
    if "normalize" in body:
        raise InvalidParameter("Parameter `normalize` was removed; use `use_activation` instead.", param="normalize")
    for name, spec in POOLING_FIELDS.items():
        if spec.support is Support.REFUSED and name in body and not spec.is_default(body[name]):
            raise InvalidParameter(f"{name}={_short(body[name])} is not supported by streamq: {spec.note}", param=name)


def _options(body: Mapping[str, Any], api: PoolingApi) -> dict[str, Any]:
    """``submit``'s options of a pooling body, type-checked now."""
    options: dict[str, Any] = {}
    if (keep := truncate_prompt_tokens_of(body)) is not None:
        options["truncate_prompt_tokens"] = keep
    if api.kind not in ("score", "rerank"):  # vLLM adds a scoring request's special tokens always
        options["add_special_tokens"] = _optional_bool(body, "add_special_tokens", default=True)
    if (priority := priority_of(body)) is not None:
        options["priority"] = priority
    if (salt := cache_salt_of(body)) is not None:
        options["cache_salt"] = salt
    return options


def _is_token_id(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _is_chat(value: object) -> bool:
    return (
        isinstance(value, list)
        and bool(value)
        and all(isinstance(item, (dict, list)) and _chat_item(item) for item in value)
    )


def _chat_item(item: object) -> bool:
    if isinstance(item, dict):
        return isinstance(item.get("role"), str)
    return (
        isinstance(item, list)
        and bool(item)
        and all(isinstance(m, dict) and isinstance(m.get("role"), str) for m in item)
    )


def _inputs(value: object) -> list[str | list[int]]:
    """``input`` in vLLM's forms: a text, a list of texts, a token-id list, or a list of them."""
    inputs: list[str | list[int]]
    if value is None:
        raise InvalidParameter("input is required: a text, a list of texts, or token ids", param="input")
    if isinstance(value, list) and not value:
        raise InvalidParameter("input must not be empty", param="input")
    if isinstance(value, str):
        inputs = [value]
    elif isinstance(value, list) and all(isinstance(item, str) for item in value):
        inputs = list(value)
    elif isinstance(value, list) and all(_is_token_id(item) for item in value):
        inputs = [list(value)]
    elif isinstance(value, list) and all(
        isinstance(item, list) and all(_is_token_id(t) for t in item) for item in value
    ):
        inputs = [list(item) for item in value]
        if empty := [index for index, item in enumerate(inputs) if not item]:
            raise InvalidParameter(f"input[{empty[0]}] is an empty token-id list", param="input")
    else:
        raise InvalidParameter(
            "input must be a string, a list of strings, a list of token ids (integers >= 0) "
            f"or a list of token-id lists, got {_short(value)}",
            param="input",
        )
    if len(inputs) > MAX_POOLING_INPUTS:
        raise InvalidParameter(
            f"input holds {len(inputs)} inputs; the limit is {MAX_POOLING_INPUTS} per request", param="input"
        )
    return inputs


def _encoding_format(body: Mapping[str, Any]) -> Literal["float", "base64"]:
    value = body.get("encoding_format") or "float"
    if value in ("bytes", "bytes_only"):
        raise InvalidParameter(
            f"encoding_format={value!r} is not supported by streamq: use float or base64", param="encoding_format"
        )
    if value not in ("float", "base64"):
        raise InvalidParameter(
            f"encoding_format must be 'float' or 'base64', got {_short(value)}", param="encoding_format"
        )
    return "base64" if value == "base64" else "float"


def _dimensions(body: Mapping[str, Any]) -> int | None:
    value = body.get("dimensions")
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise InvalidParameter(f"dimensions must be a positive integer, got {_short(value)}", param="dimensions")
    return value


def _optional_bool(body: Mapping[str, Any], name: str, *, default: bool | None = None) -> Any:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise InvalidParameter(f"{name} must be true or false, got {_short(value)}", param=name)
    return value


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def check_model_tasks(api: PoolingApi, tasks: Collection[str], model: str) -> None:
    """Refuse ``api`` for a model whose live workers run ``tasks`` (vLLM's task names; empty:
    unknown, nothing refused). ``vllm serve`` registers no route a model lacks (a 404), and
    its handler words the refusal "The model does not support <api>": a 404 with those words.
    Score and rerank on a classification model (a cross-encoder) are a 400: streamq scores
    with embedding models only."""
    if not tasks:
        return
    needed = {"embeddings": {"embed"}, "pooling": {"embed", "classify"}, "classify": {"classify"}}
    if api.kind in ("score", "rerank"):
        if "embed" in tasks:
            return
        if "classify" in tasks:
            raise bad_request(
                f"model {model!r} is a classification (cross-encoder) model: streamq scores with "
                "embedding models only (the cosine similarity of the query's and each document's vectors)",
                param="model",
            )
    elif needed[api.kind] & set(tasks):
        return
    raise ApiError(404, f"The model does not support {api.name}", type=ApiErrorType.NOT_FOUND, param="model")


def pooling_response(
    call: PoolingCall,
    pooled: Pooled,
    *,
    model: str,
    created: int | None = None,
    response_id: str | None = None,
    labels: Mapping[int, str] | None = None,
) -> dict[str, Any]:
    """The response body of ``call`` from its request's results, as ``vllm serve`` dumps it.
    ``response_id``: the whole id (default: ``call.response_id()``); ``labels``: a
    classification model's ``id2label`` (without it, ``label`` is ``None``)."""
    if len(pooled) != len(call.inputs):
        raise ValueError(f"{len(pooled)} results for {len(call.inputs)} inputs")
    response_id = response_id or call.response_id()
    created = int(time.time()) if created is None else created
    tokens = pooled.total_prompt_tokens
    kind = call.api.kind
    if kind == "rerank":
        return _rerank(call, pooled, model=model, response_id=response_id)
    if kind == "score":
        data = [
            {"index": i, "object": "score", "score": score} for i, score in enumerate(_scores(pooled, call.queries))
        ]
    elif kind == "classify":
        data = []
        for i, probs in enumerate(pooled.as_lists()):
            best = max(range(len(probs)), key=probs.__getitem__) if probs else 0
            label = (labels or {}).get(best)
            data.append({"index": i, "label": label, "probs": probs, "num_classes": len(probs)})
    else:
        values = pooled.as_base64() if call.encoding_format == "base64" else pooled.as_lists()
        name, obj = ("embedding", "embedding") if kind == "embeddings" else ("data", "pooling")
        data = [{"index": i, "object": obj, name: value} for i, value in enumerate(values)]
    return {
        "id": response_id,
        "object": "list",
        "created": created,
        "model": model,
        "data": data,
        "usage": usage(tokens),
    }


def usage(prompt_tokens: int) -> dict[str, Any]:
    """vLLM's ``UsageInfo`` of a pooling response, as it dumps it."""
    return {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens,
        "completion_tokens": 0,
        "prompt_tokens_details": None,
        "completion_tokens_details": None,
    }


def _scores(pooled: Pooled, queries: int) -> list[float]:
    """Each pair's cosine similarity: one query against every document, or query i with
    document i (vLLM's ``BiEncoderIOProcessor``: ``torch.nn.functional.cosine_similarity``)."""
    vectors = pooled.as_lists()
    firsts, seconds = vectors[:queries], vectors[queries:]
    if len(firsts) == 1:
        firsts = firsts * len(seconds)
    return [_cosine(a, b) for a, b in zip(firsts, seconds, strict=True)]


_COSINE_EPS: Final = 1e-8
"""torch's ``cosine_similarity`` default: the smallest norm it divides by."""


def _cosine(a: Sequence[float], b: Sequence[float]) -> float:
    if len(a) != len(b):
        raise ValueError(f"vectors of {len(a)} and {len(b)} values cannot be compared")
    norm_a = max(math.sqrt(math.fsum(x * x for x in a)), _COSINE_EPS)
    norm_b = max(math.sqrt(math.fsum(y * y for y in b)), _COSINE_EPS)
    return math.fsum(x * y for x, y in zip(a, b, strict=True)) / (norm_a * norm_b)


def _rerank(call: PoolingCall, pooled: Pooled, *, model: str, response_id: str) -> dict[str, Any]:
    """vLLM's ``RerankResponse``: results best first, the first ``top_n`` (0: all)."""
    scored = sorted(enumerate(_scores(pooled, call.queries)), key=lambda pair: pair[1], reverse=True)
    if 0 < call.top_n < len(scored):
        scored = scored[: call.top_n]
    results = [
        {"index": i, "document": {"text": call.documents[i], "multi_modal": None}, "relevance_score": score}
        for i, score in scored
    ]
    tokens = pooled.total_prompt_tokens
    return {
        "id": response_id,
        "model": model,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        "results": results,
    }
