"""How a request's tokens reach Redis: streamed, or in checkpoints.

A request someone follows token by token (``stream`` true, the default) has every engine
DELTA published as it comes. A request whose only consumer is its end (``stream`` false:
a batch line, a ``stream: false`` call, a callback) must not pay per token: the engine is
asked for an output only every ``checkpoint_tokens`` tokens (vLLM's per-request
``stream_interval``, which also spares its output handler the per-token ``RequestOutput``s),
and the worker writes what it holds as one chunk event per checkpoint and at the end.

A checkpoint bounds what a take-over must redo: it goes on from the tokens logged, so a
worker's death costs at most ``checkpoint_tokens`` tokens per completion generated twice.
This is the only place where the two kinds differ: the engine's ``stream_interval`` here,
the events' holding in ``RequestEvents``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from streamq.env_vars import CHECKPOINT_TOKENS_ENV
from streamq.protocol import GenerateRequest
from streamq.protocol.names import DEFAULT_CHECKPOINT_TOKENS


def checkpoint_tokens_from_env(environ: Mapping[str, str] = os.environ) -> int:
    """``$STREAMQ_CHECKPOINT_TOKENS``, else ``DEFAULT_CHECKPOINT_TOKENS``."""
    raw = environ.get(CHECKPOINT_TOKENS_ENV)
    if raw is None:
        return DEFAULT_CHECKPOINT_TOKENS
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"${CHECKPOINT_TOKENS_ENV} must be an integer (tokens), got {raw!r}") from None
    if value < 1:
        raise ValueError(f"${CHECKPOINT_TOKENS_ENV} must be 1 or more, got {value}")
    return value


@dataclass(frozen=True)
class Delivery:
    """How one request's tokens are delivered."""

    checkpoint_tokens: int | None
    """``None``: streamed, each DELTA an event. Else: tokens per checkpoint of each completion."""

    @classmethod
    def of(cls, request: GenerateRequest, checkpoint_tokens: int) -> Delivery:
        """The delivery ``request`` asks for, with the worker's ``checkpoint_tokens``."""
        return cls(None if request.stream else checkpoint_tokens)

    @property
    def streamed(self) -> bool:
        return self.checkpoint_tokens is None

    def whole(self, max_tokens: int | None) -> bool:
        """Whether a request of at most ``max_tokens`` tokens per completion asks the engine
        for its end only (``FINAL_ONLY``: one output, where an interval sends the first token
        at once and then the rest): not streamed, and within one checkpoint, so that no
        checkpoint could come before its end and a take-over generates at most a
        checkpoint's worth again, as for any request."""
        return self.checkpoint_tokens is not None and max_tokens is not None and max_tokens <= self.checkpoint_tokens

    def stream_interval(self, requested: int | None) -> int | None:
        """The ``stream_interval`` to ask the engine for, given the request's own: a
        checkpoint's worth of tokens when not streamed (the engine sends the first token
        at once, and the last; it takes the larger of this and its own ``--stream-interval``)."""
        if self.checkpoint_tokens is None:
            return requested
        return max(requested or 1, self.checkpoint_tokens)
