"""The environment variables both sides read, each read in one place: the worker's
settings, its command line, the client's and gateway's options all call these."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Final

from streamq.env_vars import (
    AFFINITY_WINDOW_ENV,
    DECLARED_MODELS_ENV,
    DRAIN_SECONDS_ENV,
    EVENTS_REDIS_URL_ENV,
    MODEL_MEMORY_ENV,
    QUEUE_ENV,
    REDIS_URL_ENV,
)
from streamq.protocol.names import (
    AFFINITY_WINDOW_MS,
    DEFAULT_DRAIN_SECONDS,
    DEFAULT_MODEL_MEMORY_S,
    DEFAULT_QUEUE,
    DEFAULT_REDIS_URL,
)
from streamq.redaction import redact_url

CLUSTER_SCHEMES: Final = {"redis+cluster": False, "rediss+cluster": True}
"""The Redis Cluster URL schemes, and whether each speaks TLS."""


TRUE_WORDS: Final = ("1", "true", "yes", "on")
FALSE_WORDS: Final = ("0", "false", "no", "off")
"""How a yes-or-no setting is written (any case), in the environment and in a URL's query."""


def parse_flag(name: str, value: str | None, *, default: bool) -> bool:
    """A yes-or-no setting ``name`` written ``value``: ``default`` when unset or empty; a word
    of neither list raises ``ValueError`` naming it (a typo must not flip the setting)."""
    word = (value or "").strip().lower()
    if not word:
        return default
    if word in TRUE_WORDS:
        return True
    if word in FALSE_WORDS:
        return False
    raise ValueError(f"{name}={value!r}: expected one of {', '.join(TRUE_WORDS + FALSE_WORDS)}")


def flag_from_env(name: str, environ: Mapping[str, str] = os.environ, *, default: bool) -> bool:
    """``parse_flag`` of ``$name``."""
    return parse_flag(f"${name}", environ.get(name), default=default)


def is_cluster_url(url: str) -> bool:
    """True for a ``redis+cluster://`` or ``rediss+cluster://`` URL."""
    return url.partition("://")[0] in CLUSTER_SCHEMES


def check_events_url(url: str | None) -> str | None:
    """``url`` (``None`` and ``""`` alike: unset) if it may name the data plane; ``ValueError``
    saying why not: only a Redis Cluster may (one Redis serves both planes by ``$REDIS_URL``)."""
    if not url:
        return None
    if not is_cluster_url(url):
        raise ValueError(
            f"{redact_url(url)!r}: the events Redis is a Redis Cluster (redis+cluster://host:port[,host:port...] "
            f"or rediss+cluster://); without one, leave it unset and one Redis carries both planes"
        )
    return url


def events_url_from_env(environ: Mapping[str, str] = os.environ) -> str | None:
    """``$STREAMQ_EVENTS_REDIS_URL`` (a Redis Cluster for the data plane), else ``None``:
    the control plane's Redis carries the data plane too."""
    return check_events_url(environ.get(EVENTS_REDIS_URL_ENV))


def redis_url_from_env(environ: Mapping[str, str] = os.environ) -> str:
    """``$REDIS_URL``, else ``DEFAULT_REDIS_URL``."""
    return environ.get(REDIS_URL_ENV, DEFAULT_REDIS_URL)


def queue_from_env(environ: Mapping[str, str] = os.environ) -> str:
    """``$STREAMQ_QUEUE``, else ``DEFAULT_QUEUE``."""
    return environ.get(QUEUE_ENV, DEFAULT_QUEUE)


def affinity_window_from_env(environ: Mapping[str, str] = os.environ) -> float:
    """``$STREAMQ_AFFINITY_WINDOW_S``, else ``AFFINITY_WINDOW_MS`` in seconds; a value that is
    not a number is a ``ValueError`` naming the variable."""
    raw = environ.get(AFFINITY_WINDOW_ENV)
    if raw is None:
        return AFFINITY_WINDOW_MS / 1000
    try:
        return float(raw)
    except ValueError:
        raise ValueError(f"${AFFINITY_WINDOW_ENV} must be a number of seconds, got {raw!r}") from None


def drain_seconds_from_env(environ: Mapping[str, str] = os.environ) -> int:
    """``$STREAMQ_DRAIN_SECONDS``, else ``DEFAULT_DRAIN_SECONDS``."""
    return int(environ.get(DRAIN_SECONDS_ENV, DEFAULT_DRAIN_SECONDS))


def model_memory_from_env(environ: Mapping[str, str] = os.environ) -> float:
    """``$STREAMQ_MODEL_MEMORY_S``, else ``DEFAULT_MODEL_MEMORY_S``; a negative or non-numeric
    value is a ``ValueError`` naming the variable."""
    raw = environ.get(MODEL_MEMORY_ENV)
    if raw is None:
        return DEFAULT_MODEL_MEMORY_S
    try:
        seconds = float(raw)
    except ValueError:
        seconds = -1
    if not seconds >= 0:
        raise ValueError(f"${MODEL_MEMORY_ENV} must be a number of seconds >= 0, got {raw!r}")
    return seconds


def parse_declared_models(text: str) -> dict[str, str | None]:
    """``NAME[=QUEUE],...`` as a mapping (``None``: the client's queue); ``ValueError`` for an
    empty name or queue."""
    declared: dict[str, str | None] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, sep, queue = (part.strip() for part in item.partition("="))
        if not name or (sep and not queue):
            raise ValueError(f"a declared model is NAME or NAME=QUEUE, got {item!r}")
        declared[name] = queue or None
    return declared


def declared_models_from_env(environ: Mapping[str, str] = os.environ) -> dict[str, str | None]:
    """``$STREAMQ_DECLARED_MODELS`` (``NAME[=QUEUE],...``), else none."""
    try:
        return parse_declared_models(environ.get(DECLARED_MODELS_ENV, ""))
    except ValueError as exc:
        raise ValueError(f"${DECLARED_MODELS_ENV}: {exc}") from None
