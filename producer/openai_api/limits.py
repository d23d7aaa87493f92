"""Bounds on what one OpenAI request may ask for, checked before it is queued.

vLLM accepts ``n`` up to 16384 and any number of stop strings; one such request would
hold a worker's batch, or its stop-string scan, for everyone. The gateway and the batch
runner refuse them up front with a 400 naming the parameter. ``max_n`` is an option
(``--max-n``); the others are constants here, documented in docs/gateway.md, "Bounds".
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

from producer.errors import InvalidParameter
from streamq.protocol import MAX_PROMPT_CHARS

DEFAULT_MAX_N: Final = 16
"""Completions per request (``n``): what a sampling UI asks for, far under vLLM's 16384."""
MAX_STOP_SEQUENCES: Final = 64
"""Stop strings per request (OpenAI allows 4; vLLM any number, each checked on every token)."""
MAX_STOP_CHARS: Final = 1_000
"""Characters in one stop string."""
MAX_STOP_TOKEN_IDS: Final = 1_024
"""Token ids in ``stop_token_ids``."""
MAX_MESSAGES: Final = 4_096
"""Messages in one chat request."""
MAX_PROMPTS: Final = 256
"""Prompts in one ``/v1/completions`` request: each is a request in the queue (an evaluation
harness sends a batch of them at once)."""
MAX_MESSAGE_CHARS: Final = MAX_PROMPT_CHARS
"""Characters in one message's content (the whole prompt is bounded by ``MAX_PROMPT_CHARS`` too)."""


@dataclass(frozen=True)
class RequestLimits:
    """The bounds one gateway or batch run applies; the defaults are the constants above."""

    max_n: int = DEFAULT_MAX_N
    max_stop_sequences: int = MAX_STOP_SEQUENCES
    max_stop_chars: int = MAX_STOP_CHARS
    max_stop_token_ids: int = MAX_STOP_TOKEN_IDS
    max_messages: int = MAX_MESSAGES
    max_message_chars: int = MAX_MESSAGE_CHARS
    max_prompts: int = MAX_PROMPTS
    reject_unknown_fields: bool = False
    """OpenAI's strictness: a field no table of ``fields`` names (at the top, or in a
    message) is a 400. Off, it is ignored and its name logged, as ``vllm serve`` does."""

    def check_sampling(self, body: Mapping[str, Any]) -> None:
        """``n``, ``best_of``, ``stop`` and ``stop_token_ids`` of a body; raises ``InvalidParameter``."""
        for name in ("n", "best_of"):
            value = body.get(name)
            if isinstance(value, int) and not isinstance(value, bool) and value > self.max_n:
                raise InvalidParameter(
                    f"{name}={value} is over the limit of {self.max_n} completions per request", param=name
                )
        stop = body.get("stop")
        if isinstance(stop, str):
            stop = [stop]
        if isinstance(stop, list):
            _check_count("stop", stop, self.max_stop_sequences, "stop sequences")
            for position, sequence in enumerate(stop):
                if isinstance(sequence, str) and len(sequence) > self.max_stop_chars:
                    raise InvalidParameter(
                        f"stop[{position}] is {len(sequence)} characters; the limit is {self.max_stop_chars}",
                        param="stop",
                    )
        stop_token_ids = body.get("stop_token_ids")
        if isinstance(stop_token_ids, list):
            _check_count("stop_token_ids", stop_token_ids, self.max_stop_token_ids, "token ids")

    def check_prompts(self, prompts: Sequence[object]) -> None:
        """The count of a completion request's prompts."""
        _check_count("prompt", prompts, self.max_prompts, "prompts")

    def check_messages(self, messages: Sequence[object]) -> None:
        """The count of a chat request's messages, before any is looked at."""
        _check_count("messages", messages, self.max_messages, "messages")

    def check_message_lengths(self, messages: Sequence[Mapping[str, Any]]) -> None:
        """Each message's length, its content parts joined."""
        for position, message in enumerate(messages):
            size = len(message["content"] or "")
            if size > self.max_message_chars:
                raise InvalidParameter(
                    f"messages[{position}].content is {size} characters; the limit is {self.max_message_chars}",
                    param="messages",
                )


DEFAULT_LIMITS: Final = RequestLimits()


def add_max_n_option(parser: argparse.ArgumentParser) -> None:
    """``--max-n``, shared by the gateway and the batch command (``RequestLimits(max_n=args.max_n)``)."""
    parser.add_argument(
        "--max-n",
        type=_positive_int,
        default=DEFAULT_MAX_N,
        help="refuse (400) a request asking for more completions than this in n or best_of (default: %(default)s)",
    )


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _check_count(param: str, values: Sequence[object], limit: int, what: str) -> None:
    if len(values) > limit:
        raise InvalidParameter(f"{param} holds {len(values)} {what}; the limit is {limit}", param=param)
