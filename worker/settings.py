"""arq settings for a streamq worker: JSON jobs, its hooks (``worker/hooks.py``), batching.

``arq worker.WorkerSettings`` runs it with arq's own command line (engine flags
from ``$STREAMQ_ENGINE_ARGS``); ``python -m worker`` runs the same settings in
``StreamqWorker``, which also starts jobs the moment they are enqueued.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from streamq.broker.connection import redis_settings_for
from streamq.env_vars import KEEP_RESULT_ENV
from streamq.environment import drain_seconds_from_env, queue_from_env, redis_url_from_env
from streamq.protocol import serialize_job
from streamq.protocol.names import DEFAULT_KEEP_RESULT_S
from worker.hooks import on_shutdown, on_startup
from worker.job import generate
from worker.redact import deserialize_job_redacted


def keep_result_from_env(environ: Mapping[str, str] = os.environ) -> float:
    """``$STREAMQ_KEEP_RESULT_S``: seconds arq keeps a finished job's result (default an hour)."""
    value = float(environ.get(KEEP_RESULT_ENV) or DEFAULT_KEEP_RESULT_S)
    if value < 0:
        raise ValueError(f"${KEEP_RESULT_ENV} must be >= 0, got {value:g}")
    return value


class WorkerSettings:
    """Settings as arq reads them (a bag of ``arq.Worker`` keyword arguments)."""

    functions = [generate]
    on_startup = on_startup
    on_shutdown = on_shutdown
    queue_name = queue_from_env()
    redis_settings = redis_settings_for(redis_url_from_env())
    job_serializer = staticmethod(serialize_job)
    job_deserializer = staticmethod(deserialize_job_redacted)  # arq logs each job's arguments: no prompts
    # The engine, not arq, decides how many requests run together: StreamqWorker
    # raises this to the engine's max_num_seqs once the engine is up.
    max_jobs = 256
    # Without wake-ups (plain `arq`), this bounds the pickup delay; with them it is
    # only the idle fallback. Either way far below arq's 0.5 s default.
    poll_delay = 0.05
    # SIGTERM/SIGINT: stop taking jobs, let running ones finish for this long, then
    # cancel the rest (arq puts them back on the queue for another worker).
    job_completion_wait = drain_seconds_from_env()
    job_timeout = 3600  # long generations are normal; arq's 300 s default would kill them
    # Status reads how a request ended from its result or its replay log, whichever is kept longer.
    keep_result = keep_result_from_env()
    health_check_interval = 10


def worker_settings(**overrides: Any) -> dict[str, Any]:
    """``WorkerSettings`` as a dict of keyword arguments, with ``overrides`` applied."""
    settings = {k: v for k, v in vars(WorkerSettings).items() if not k.startswith("_")}
    settings.update(overrides)
    return settings
