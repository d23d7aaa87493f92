"""A pooling request through the engine: every input's vector, packed for one event.

A request of many inputs is one job: its texts are tokenized in one batch call (one thread
hop and one call of the tokenizer per request, where tokenizing each input alone is most of
what a front end spends per input), then each input is its own engine request (as ``vllm
serve`` splits a list), all in the engine at once so it batches them, and their results go
out together, packed as little-endian float32 (``PooledEvent``), not as JSON numbers. The
task is always named (``embed``, ``classify``): vLLM's default for a pooling request without
one is ``token_embed``, a vector per token.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy
from vllm import PoolingParams
from vllm.exceptions import VLLMValidationError
from vllm.v1.engine.async_llm import AsyncLLM

from streamq.protocol import MAX_POOLED_BYTES, GenerateRequest, InvalidRequest, Pooling
from worker.progress import thread_tokenizer
from worker.prompt_options import check_truncation, engine_prompt

ENGINE_ID_SEPARATOR = "#"
"""Between a request's id and an input's index in the engine's request ids: a character no
request id holds, so no two requests' inputs share an engine id."""


async def engine_tasks(engine: AsyncLLM) -> tuple[tuple[str, ...], int | None]:
    """What the engine runs (vLLM's task names) and, for a pooling model, its most values
    per input (the hidden size). An engine that cannot say runs ``generate``."""
    supported = getattr(engine, "get_supported_tasks", None)
    if supported is None:
        return ("generate",), None
    tasks = tuple(str(task) for task in await supported())
    if "generate" in tasks:
        return tasks, None
    return tasks, int(engine.model_config.get_hidden_size())


@dataclass(frozen=True)
class PooledResults:
    """Every input's result, packed, and its tokens."""

    shapes: list[list[int]]
    prompt_tokens: list[int]
    data: bytes


def pooling_params(pooling: Pooling) -> PoolingParams:
    """vLLM's parameters for the request's ``pooling`` (task always set)."""
    return PoolingParams(task=pooling.task, dimensions=pooling.dimensions, use_activation=pooling.use_activation)


def _keep(request: GenerateRequest, max_model_len: int) -> int | None:
    """How many tokens of each input to keep: ``truncate_prompt_tokens`` (``-1``: the whole
    context, a pooling request leaving none for output, as ``vllm serve``)."""
    keep = request.truncate_prompt_tokens
    if keep is None:
        return None
    check_truncation(keep, max_model_len)
    return max_model_len if keep < 0 else keep


async def encode_all(
    engine: AsyncLLM, request: GenerateRequest, priority: int, on_first: Callable[[], None]
) -> PooledResults:
    """Run every input of ``request`` through the engine at once and pack the results.

    An input the engine refuses (too long, a bad token id) fails the whole request with
    vLLM's message, prefixed with the input's index; the other inputs are aborted (a
    cancelled ``encode`` aborts its engine request)."""
    assert request.inputs is not None and request.pooling is not None, "validated: a pooling request"
    params = pooling_params(request.pooling)
    keep = _keep(request, engine.model_config.max_model_len)
    inputs = await _token_ids(engine, request.inputs, keep, request.add_special_tokens)
    first = asyncio.Event()

    async def one(index: int, token_ids: list[int]) -> tuple[Any, int]:
        engine_id = f"{request.request_id}{ENGINE_ID_SEPARATOR}{index}"
        try:
            prompt = engine_prompt(token_ids, request.cache_salt)
            output = None
            outputs = engine.encode(prompt, params, engine_id, priority=priority)
            async for last in outputs:  # one output, when the input is done
                output = last
        except (VLLMValidationError, ValueError) as exc:
            raise InvalidRequest(f"inputs[{index}]: {exc}") from None
        assert output is not None, "encode yields the request's one output"
        if not first.is_set():
            first.set()
            on_first()
        return output.outputs.data, len(output.prompt_token_ids or ())

    tasks = [asyncio.ensure_future(one(index, item)) for index, item in enumerate(inputs)]
    try:
        results = await asyncio.gather(*tasks)
    finally:
        for task in tasks:  # one failed: the rest leave the engine
            task.cancel()
    arrays = [_as_float32(data) for data, _ in results]
    size = sum(array.nbytes for array in arrays)
    if size > MAX_POOLED_BYTES:  # a producer that did not check the bound before enqueue
        raise InvalidRequest(
            f"the results of {len(arrays)} inputs are {size} bytes, past the {MAX_POOLED_BYTES}-byte bound on one "
            "request's: send fewer inputs per request"
        )
    return PooledResults(
        shapes=[list(array.shape) for array in arrays],
        prompt_tokens=[tokens for _, tokens in results],
        data=b"".join(array.tobytes() for array in arrays),
    )


async def _token_ids(
    engine: AsyncLLM, inputs: list[str | list[int]], keep: int | None, add_special_tokens: bool | None
) -> list[list[int]]:
    """Every input as the token ids the engine is given, cut to ``keep``: the texts tokenized
    in one batch call of the tokenizer in a thread (``truncation`` and ``max_length`` as vLLM's
    renderer passes them), one call a request, not one per input. A text past the context is
    left whole, for the engine to refuse with vLLM's message."""
    ids = [item if keep is None else item[:keep] for item in inputs if not isinstance(item, str)]
    texts = [item for item in inputs if isinstance(item, str)]
    tokenized: Iterator[list[int]] = iter(())
    if texts:
        kwargs: dict[str, Any] = {"add_special_tokens": add_special_tokens is not False}
        if keep is not None:
            kwargs.update(truncation=True, max_length=keep)
        tokenized = iter(await asyncio.to_thread(_encode_batch, engine.get_tokenizer(), texts, kwargs))
    given = iter(ids)
    return [next(tokenized) if isinstance(item, str) else next(given) for item in inputs]


def _encode_batch(engine_tokenizer: Any, texts: list[Any], kwargs: dict[str, Any]) -> list[list[int]]:
    return [list(ids) for ids in thread_tokenizer(engine_tokenizer)(texts, **kwargs)["input_ids"]]


def _as_float32(data: Any) -> numpy.ndarray:
    """A result (a CPU tensor, of whatever float type the model runs) as float32 numbers."""
    if hasattr(data, "numpy"):
        data = data.float().numpy()
    return numpy.asarray(data, dtype="<f4")
