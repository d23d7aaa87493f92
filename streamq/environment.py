"""The environment variables both sides read, each read in one place: the worker's
settings, its command line, the client's and gateway's options all call these."""

from __future__ import annotations

import os
from collections.abc import Mapping

from streamq.protocol.names import (
    DEFAULT_DRAIN_SECONDS,
    DEFAULT_QUEUE,
    DEFAULT_REDIS_URL,
    DRAIN_SECONDS_ENV,
    QUEUE_ENV,
    REDIS_URL_ENV,
)


def redis_url_from_env(environ: Mapping[str, str] = os.environ) -> str:
    """``$REDIS_URL``, else ``DEFAULT_REDIS_URL``."""
    return environ.get(REDIS_URL_ENV, DEFAULT_REDIS_URL)


def queue_from_env(environ: Mapping[str, str] = os.environ) -> str:
    """``$STREAMQ_QUEUE``, else ``DEFAULT_QUEUE``."""
    return environ.get(QUEUE_ENV, DEFAULT_QUEUE)


def drain_seconds_from_env(environ: Mapping[str, str] = os.environ) -> int:
    """``$STREAMQ_DRAIN_SECONDS``, else ``DEFAULT_DRAIN_SECONDS``."""
    return int(environ.get(DRAIN_SECONDS_ENV, DEFAULT_DRAIN_SECONDS))
