"""The model's tokenizer configuration in Redis (``streamq:tokenizer:<model>``), as
``vllm serve``'s ``/tokenizer_info`` returns it, so that the gateway can answer that route
(evaluation harnesses read it to tokenize on the client) without a tokenizer of its own."""

from __future__ import annotations

import logging
import warnings
from typing import Any

import msgspec
from redis.asyncio import Redis

from streamq.protocol import TOKENIZER_INFO_PREFIX

logger = logging.getLogger("streamq.worker")


def tokenizer_info(engine: Any) -> dict[str, Any] | None:
    """vLLM's own ``TokenizerInfo`` of the engine's tokenizer (no ``--chat-template``
    override, as ``vllm serve`` without one); ``None`` for an engine without a tokenizer."""
    get_tokenizer = getattr(engine, "get_tokenizer", None)
    if get_tokenizer is None:
        return None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        from vllm.entrypoints.serve.tokenize.serving import TokenizerInfo
    info: dict[str, Any] = TokenizerInfo(get_tokenizer(), None).to_dict()
    return info


async def publish_tokenizer_info(redis: Redis, model: str, engine: Any) -> None:
    """Write the model's tokenizer configuration (best effort: only ``/tokenizer_info``
    needs it)."""
    try:
        info = tokenizer_info(engine)
        if info is not None:
            await redis.set(TOKENIZER_INFO_PREFIX + model, msgspec.json.encode(info))
    except Exception as exc:
        logger.warning("could not publish the tokenizer's configuration: %s", exc)
