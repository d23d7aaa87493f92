"""Every field of vLLM's pooling request classes (``EmbeddingCompletionRequest``,
``PoolingCompletionRequest``, ``ClassificationCompletionRequest``, the ``ScoreRequest``
forms and ``RerankRequest``), and what the gateway does with it: one table, rendered into
docs/gateway.md and held against vLLM's classes by a test, as ``fields`` does for the
completion endpoints (a field a new vLLM adds fails that test until it is classified here).
``pooling`` applies it; a field outside these classes is ignored, as ``vllm serve`` ignores it.
"""

from __future__ import annotations

from typing import Final

from producer.openai_api.fields import Field, Support, _honoured, _ignored, _refused, tally

POOLING_FIELDS: Final[dict[str, Field]] = {
    "model": _honoured("routes the request to the model's workers; absent, the one model live workers serve"),
    "input": _honoured(
        "`/v1/embeddings`, `/pooling`, `/classify`: a text, a list of texts, token ids or a list of token-id "
        "lists, at most 2048, all run by one worker in one request; chat messages are refused"
    ),
    "encoding_format": _honoured("`float` or `base64`; `bytes` and `bytes_only` are refused"),
    "embed_dtype": _refused("results travel as float32: only `float32`", lambda value: value in (None, "float32")),
    "endianness": _refused(
        "base64 is little-endian float32: only `native` (on the gateway's machine) or `little`",
        lambda value: value in (None, "native", "little"),
    ),
    "dimensions": _honoured("`/v1/embeddings`: a Matryoshka model's; others refuse it, as in `vllm serve`"),
    "use_activation": _honoured("normalize an embedding, softmax the class scores; absent, the model's default"),
    "task": _honoured("`/pooling`: `embed` or `classify`; absent, the model's own"),
    "add_special_tokens": _honoured("default true"),
    "truncate_prompt_tokens": _honoured("each input's tokens cut to that many on the worker (-1: the context)"),
    "truncation_side": _refused("the worker keeps an input's first tokens"),
    "padding": _refused("the worker's tokenizer does not pad"),
    "mm_processor_kwargs": _refused("media are not carried by the queue: text and token ids only"),
    "user": _ignored("as in `vllm serve`"),
    "request_id": _honoured("the request's id (the `X-Request-Id` or `x-streamq-request-id` header wins)"),
    "priority": _honoured("orders the queue; see [priorities](features/priorities-and-tenants.md)"),
    "cache_salt": _honoured("goes with the inputs into the engine, as in `vllm serve`"),
    "queries": _honoured("`/score`: a text or a list, with `documents` or `items`"),
    "documents": _honoured("`/score` and `/rerank`: a text or a list of texts; multimodal content is refused"),
    "items": _honoured("`/score`: as `documents`"),
    "data_1": _honoured("`/score`: as `queries`, with `data_2`"),
    "data_2": _honoured("`/score`: as `documents`"),
    "text_1": _honoured("`/score`: as `queries`, with `text_2`"),
    "text_2": _honoured("`/score`: as `documents`"),
    "query": _honoured("`/rerank`: one text"),
    "top_n": _honoured("`/rerank`: the best that many results (0: all)"),
    "max_tokens_per_query": _refused("truncates text with the tokenizer, which the gateway does not hold"),
    "max_tokens_per_doc": _refused("truncates text with the tokenizer, which the gateway does not hold"),
    "instruction": _ignored("an embedding model's score embeds the texts as they are, as `vllm serve` does"),
    "chat_template_kwargs": _ignored("an embedding model's score embeds the texts as they are, as `vllm serve` does"),
}
"""Every pooling endpoint's fields, in one table (each note names the endpoints of a field
that not all of them take)."""


def pooling_summary() -> str:
    """The sentence docs/gateway.md opens the pooling table with."""
    counts = tally(POOLING_FIELDS)
    return (
        f"Of the {len(POOLING_FIELDS)} fields of vLLM's pooling requests: {counts[Support.HONOURED]} honoured, "
        f"{counts[Support.IGNORED]} ignored, {counts[Support.REFUSED]} refused."
    )
