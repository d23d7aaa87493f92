"""arq settings for a streamq worker: JSON jobs, its hooks (``worker/hooks.py``), batching.

``WorkerSettings`` holds what every worker shares and reads nothing from the environment;
``arq_settings`` adds what one worker's configuration (``worker/config.py``) says, and puts
that configuration in arq's ``ctx`` for the start-up hook. ``arq worker.WorkerSettings``
runs it with arq's own command line: ``worker.WorkerSettings`` is built when arq asks for
it, from the environment (engine flags from ``$STREAMQ_ENGINE_ARGS``); ``python -m worker``
runs the same settings in ``StreamqWorker``, which also starts jobs the moment they are
enqueued.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from streamq.broker.connection import redis_settings_for
from streamq.protocol import serialize_job
from worker.config import CONFIG_KEY, DEFAULT_JOB_TIMEOUT_S, WorkerConfig, config_from_env
from worker.hooks import on_shutdown, on_startup
from worker.job import generate
from worker.redact import deserialize_job_redacted


class WorkerSettings:
    """Settings as arq reads them (a bag of ``arq.Worker`` keyword arguments), those every
    worker shares; ``arq_settings`` adds one worker's."""

    functions = [generate]
    on_startup = on_startup
    on_shutdown = on_shutdown
    job_serializer = staticmethod(serialize_job)
    job_deserializer = staticmethod(deserialize_job_redacted)  # arq logs each job's arguments: no prompts
    # The engine, not arq, decides how many requests run together: StreamqWorker
    # raises this to the engine's max_num_seqs once the engine is up.
    max_jobs = 256
    # Without wake-ups (plain `arq`), this bounds the pickup delay; with them it is
    # only the idle fallback. Either way far below arq's 0.5 s default.
    poll_delay = 0.05
    job_timeout = DEFAULT_JOB_TIMEOUT_S
    health_check_interval = 10


def arq_settings(config: WorkerConfig) -> dict[str, Any]:
    """``WorkerSettings`` and ``config`` as ``arq.Worker``'s keyword arguments, ``config``
    in its ``ctx``."""
    settings = {k: v for k, v in vars(WorkerSettings).items() if not k.startswith("_")}
    settings.update(
        redis_settings=redis_settings_for(config.redis_url),
        queue_name=config.queue,
        # SIGTERM/SIGINT: stop taking jobs, let running ones finish for this long, then
        # cancel the rest (arq puts them back on the queue for another worker).
        job_completion_wait=config.drain_seconds,
        job_timeout=config.job_timeout_s,
        # Status reads how a request ended from its result or its replay log, whichever is kept longer.
        keep_result=config.keep_result_s,
        ctx={CONFIG_KEY: config},
    )
    if config.max_jobs is not None:
        settings["max_jobs"] = config.max_jobs
    return settings


def settings_from_env(environ: Mapping[str, str] = os.environ) -> dict[str, Any]:
    """What ``arq worker.WorkerSettings`` runs: the settings of ``config_from_env``."""
    return arq_settings(config_from_env(environ))
