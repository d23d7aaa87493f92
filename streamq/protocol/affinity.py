"""A request's prefix identity: the keys by which the worker that served a prefix gets
first pick of the next request that shares it (docs/features/prefix-aware-pickup.md, PROTOCOL.md "Prefix affinity").

The producer side imports no tokenizer, so a prefix is named by its text: the keys are
64-bit BLAKE2b digests of leading parts of the prompt, longest first, each part at least
``MIN_PREFIX_CHARS`` long (a shorter one saves the engine too little to route on).

- A prompt: its first 256, 512, 1024, ... characters (doubling). A longer prompt that
  starts with an earlier one (a transcript that grows) shares all of that one's keys up
  to its length.
- Chat messages: the list up to the end of each message. A conversation's next turn
  (the same messages, then the reply, then a new message) shares the key of the whole
  earlier turn; conversations that open with the same system prompt or few-shot
  examples share the key that ends there. A message's length counts the assistant
  reply after it, which the worker that wrote it holds too.
- ``affinity_key``: the caller's own name for a conversation or document, alone.

Only the ``MAX_AFFINITY_KEYS`` longest parts are kept: the deepest match is the one that
routes, and each key costs a Redis command at enqueue and at claim.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Final

from streamq.protocol.messages import ChatMessage

MIN_PREFIX_CHARS: Final = 256
MAX_AFFINITY_KEYS: Final = 8
MAX_AFFINITY_KEY_CHARS: Final = 256
"""An explicit ``affinity_key``'s length bound (it is hashed, never stored)."""
_FIELD_END: Final = "\x1f"
_MESSAGE_END: Final = "\x1e"


def _digest(domain: bytes, text: str) -> str:
    return hashlib.blake2b(domain + text.encode("utf-8"), digest_size=8).hexdigest()


def prompt_keys(prompt: str) -> list[str]:
    """Keys of ``prompt``'s first 256, 512, 1024, ... characters, longest first."""
    lengths = []
    length = MIN_PREFIX_CHARS
    while length <= len(prompt):
        lengths.append(length)
        length *= 2
    return [_digest(b"text\x00", prompt[:length]) for length in reversed(lengths[-MAX_AFFINITY_KEYS:])]


def messages_keys(messages: Sequence[ChatMessage]) -> list[str]:
    """Keys of ``messages`` up to the end of each message whose prefix is long enough
    (counting an assistant reply that follows it), longest first."""
    hasher = hashlib.blake2b(b"chat\x00", digest_size=8)
    length = 0
    keys = []
    for i, message in enumerate(messages):
        part = message.role + _FIELD_END + message.text + _MESSAGE_END
        hasher.update(part.encode("utf-8"))
        length += len(part)
        following = messages[i + 1] if i + 1 < len(messages) else None
        held = length + (len(following.text) if following is not None and following.role == "assistant" else 0)
        if held >= MIN_PREFIX_CHARS:
            keys.append(hasher.copy().hexdigest())
    return list(reversed(keys[-MAX_AFFINITY_KEYS:]))


def explicit_key(affinity_key: str) -> str:
    """The key of a caller-named conversation or document."""
    return _digest(b"key\x00", affinity_key)


def affinity_keys(
    prompt: str | None, messages: Sequence[ChatMessage] | None, affinity_key: str | None = None
) -> list[str]:
    """A request's keys, longest first: ``affinity_key``'s alone when given, else its
    prompt's or messages'."""
    if affinity_key is not None:
        return [explicit_key(affinity_key)]
    if messages is not None:
        return messages_keys(messages)
    return prompt_keys(prompt or "")


def under_adapter(adapter: str, keys: Sequence[str]) -> list[str]:
    """The keys of a request run under LoRA adapter ``adapter``: its prefix ``keys`` salted
    with the adapter's name (the engine caches a prefix per adapter: the same text under
    another adapter, or none, shares nothing), then the adapter's own key, the shortest. The
    worker that ran the adapter last is that key's affinity worker, so a request that finds
    no conversation of its own goes to a worker that has the adapter loaded; an adapter with
    no live affinity worker goes to the worker that is the affinity worker of the fewest
    (enqueue.lua)."""
    salted = [_digest(b"lora\x00", adapter + _FIELD_END + key) for key in keys[: MAX_AFFINITY_KEYS - 1]]
    return [*salted, adapter_key(adapter)]


def adapter_key(adapter: str) -> str:
    """The key of LoRA adapter ``adapter``, owned by the worker that ran it last: written
    with a leading ``@``, by which enqueue and the claim tell it from a prefix's."""
    return "@" + _digest(b"adapter\x00", adapter)


def check_affinity_key(affinity_key: object) -> str | None:
    """``affinity_key`` if it is usable (a non-empty string of at most
    ``MAX_AFFINITY_KEY_CHARS``), else a ``ValueError`` saying why."""
    if affinity_key is None:
        return None
    if not isinstance(affinity_key, str) or not affinity_key:
        raise ValueError(f"affinity_key must be a non-empty string, got {affinity_key!r}")
    if len(affinity_key) > MAX_AFFINITY_KEY_CHARS:
        raise ValueError(f"affinity_key is {len(affinity_key)} characters; the limit is {MAX_AFFINITY_KEY_CHARS}")
    return affinity_key
