"""A pooling request's results as a client reads them: vectors, not bytes.

The worker sends every input's result packed in one ``pooled`` event (little-endian float32,
input after input). ``Pooled`` unpacks them: as numpy arrays where numpy is installed (no
copy: each array views the event's bytes), as lists of floats otherwise, so the client needs
no numpy of its own.
"""

from __future__ import annotations

import array
import base64
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, cast

from streamq.broker.registry import Routes
from streamq.protocol import MAX_POOLED_BYTES, GenerateRequest, InvalidRequest, PooledEvent, task_refusal

try:  # numpy is optional: lists of floats without it
    import numpy

    HAVE_NUMPY = True
except ImportError:  # pragma: no cover - the test environment has numpy
    HAVE_NUMPY = False


@dataclass(frozen=True)
class Pooled:
    """The results of one pooling request (``StreamqClient.embed``, ``classify``), one per
    input, in the order of its inputs."""

    request_id: str
    shapes: list[list[int]]
    """Per input, its result's shape (a vector: one dimension)."""
    prompt_tokens: list[int]
    """Per input, the tokens the engine ran (after truncation)."""
    data: bytes
    """Every result packed, little-endian float32, input after input."""
    worker_id: str | None = None

    @classmethod
    def of_event(cls, event: PooledEvent, worker_id: str | None = None) -> Pooled:
        if event.dtype != "float32":
            raise ValueError(f"request {event.request_id}: results of dtype {event.dtype!r}, not float32")
        data = event.data if isinstance(event.data, bytes) else b""
        return cls(event.request_id, event.shapes, event.prompt_tokens, data, worker_id)

    def __len__(self) -> int:
        return len(self.shapes)

    @property
    def total_prompt_tokens(self) -> int:
        """The tokens of every input: what OpenAI's ``usage`` counts."""
        return sum(self.prompt_tokens)

    def _spans(self) -> list[tuple[int, int, list[int]]]:
        spans, start = [], 0
        for shape in self.shapes:
            count = 1
            for size in shape:
                count *= size
            spans.append((start, start + count, shape))
            start += count
        if start * 4 != len(self.data):
            raise ValueError(f"request {self.request_id}: {len(self.data)} bytes of results for {start} values")
        return spans

    @property
    def vectors(self) -> list[Any]:
        """Each input's result: a float32 numpy array where numpy is installed (a view of
        ``data``), else a list of floats (nested for a result of more than one dimension)."""
        if HAVE_NUMPY:
            values = numpy.frombuffer(self.data, dtype="<f4")
            return [values[start:end].reshape(shape) for start, end, shape in self._spans()]
        floats = array.array("f", self.data)
        if sys.byteorder != "little":  # pragma: no cover - the wire is little-endian
            floats.byteswap()
        return [_nested(floats[start:end].tolist(), shape) for start, end, shape in self._spans()]

    def as_lists(self) -> list[Any]:
        """Each input's result as (nested) lists of Python floats, numpy or not."""
        return [v.tolist() if HAVE_NUMPY else v for v in self.vectors]

    def as_base64(self) -> list[str]:
        """Each input's result as base64 of its little-endian float32 bytes: OpenAI's
        ``encoding_format: base64``."""
        return [base64.b64encode(self.data[start * 4 : end * 4]).decode() for start, end, _ in self._spans()]


def _nested(values: list[float], shape: list[int]) -> Any:
    """``values`` shaped as ``shape`` (row-major) in nested lists."""
    if len(shape) <= 1:
        return values
    step = len(values) // shape[0]
    return [_nested(values[i * step : (i + 1) * step], shape[1:]) for i in range(shape[0])]


def inputs_of(inputs: str | Sequence[int] | Sequence[str | Sequence[int]] | None) -> list[str | list[int]] | None:
    """A pooling request's ``inputs`` as the wire takes them: one text or token-id list, or
    a sequence of them."""
    if inputs is None:
        return None
    if isinstance(inputs, str):
        return [inputs]
    if not _is_sequence(inputs):
        raise InvalidRequest(f"inputs must be a text, a token-id list or a list of them, got {type(inputs).__name__}")
    items = list(inputs)
    if items and all(_is_token_id(item) for item in items):
        return [cast(list[int], items)]
    for index, item in enumerate(items):  # a dict or bytes would otherwise pass as its keys or byte values
        if not isinstance(item, str) and not (_is_sequence(item) and all(map(_is_token_id, cast(Sequence[int], item)))):
            raise InvalidRequest(f"inputs[{index}] must be a text or a list of token ids, got {type(item).__name__}")
    return [item if isinstance(item, str) else list(cast(Sequence[int], item)) for item in items]


def _is_sequence(value: object) -> bool:
    """A list-like of inputs or token ids: not a text, bytes or a mapping (a ``Sequence``)."""
    return isinstance(value, Sequence) and not isinstance(value, str | bytes | bytearray | memoryview)


def _is_token_id(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_task(request: GenerateRequest, routes: Routes, model: str) -> None:
    """Refuse, before it is enqueued, a request that ``model``'s live workers cannot run (a
    generation request for a pooling model or the reverse: vLLM's messages), and a pooling
    request whose results could pass ``MAX_POOLED_BYTES``. Nothing is known of a model
    with no live worker: its request waits, and the worker that takes it checks it."""
    tasks = routes.tasks(model)
    if not tasks:
        return
    if (refusal := task_refusal(tasks, request.pooling)) is not None:
        raise InvalidRequest(f"{refusal} (model {model!r})")
    if request.pooling is None:
        return
    size = routes.pooled_size(model)
    inputs = len(request.inputs or ())
    if size is not None and inputs * size * 4 > MAX_POOLED_BYTES:
        raise InvalidRequest(
            f"{inputs} inputs of up to {size} values each could pass the {MAX_POOLED_BYTES}-byte bound on one "
            f"request's results: send at most {MAX_POOLED_BYTES // (size * 4)} inputs per request"
        )
