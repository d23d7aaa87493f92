"""Every environment variable streamq reads, in one place: its name, what it holds, its
default, who reads it and what it does, as vLLM's ``envs.py`` lists vLLM's.

Each name is a constant here (``QUEUE_ENV``, ``FRONT_ENDS_ENV``, ...), spelled once: the
registry's entries use them and every reader imports them from this module, nowhere else.
Each service still reads its own where it starts (the worker's become its flags' defaults, a
flag given wins); this registry is what the docs are generated from
(``python -m streamq.env_vars`` prints docs/operations/configuration.md's table) and what a
test holds the code to: a ``STREAMQ_*`` name spelled outside this module fails it, and so
does one here that the code no longer reads.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final, Literal

from streamq.protocol.names import (
    AFFINITY_WINDOW_MS,
    DEFAULT_CHECKPOINT_TOKENS,
    DEFAULT_DRAIN_SECONDS,
    DEFAULT_DURABLE_ENDS,
    DEFAULT_KEEP_RESULT_S,
    DEFAULT_MODEL_MEMORY_S,
    DEFAULT_QUEUE,
    DEFAULT_REDIS_URL,
    LOG_MAXLEN,
    LOG_TTL_MS,
)

# --- the names: each spelled here once; every reader imports it from this module --------
REDIS_URL_ENV: Final = "REDIS_URL"
EVENTS_REDIS_URL_ENV: Final = "STREAMQ_EVENTS_REDIS_URL"
"""A Redis Cluster (``redis+cluster://host:port[,host:port...]``) for the data plane: each
request's log, owner key and channel. Unset: the Redis of ``$REDIS_URL`` carries them too."""
QUEUE_ENV: Final = "STREAMQ_QUEUE"
"""The queue both sides use unless told otherwise (default ``DEFAULT_QUEUE``)."""
DRAIN_SECONDS_ENV: Final = "STREAMQ_DRAIN_SECONDS"
"""How long a stopping worker lets its running jobs finish before handing them back."""
LOG_TTL_ENV: Final = "STREAMQ_LOG_TTL_S"
LOG_MAXLEN_ENV: Final = "STREAMQ_LOG_MAXLEN"
KEEP_RESULT_ENV: Final = "STREAMQ_KEEP_RESULT_S"
"""The worker only: seconds arq keeps a finished job's result (``arq:result:<id>``)."""
CHECKPOINT_TOKENS_ENV: Final = "STREAMQ_CHECKPOINT_TOKENS"
"""The worker only: tokens per checkpoint of a request that is not streamed (default
``DEFAULT_CHECKPOINT_TOKENS``)."""
COALESCE_ENV: Final = "STREAMQ_COALESCE"
"""``0`` stops a worker from merging a request's waiting chunks into one event (default ``1``)."""
DURABLE_ENDS_ENV: Final = "STREAMQ_DURABLE_ENDS"
"""The worker only: what an end waits for before anyone is told (``--durable-ends``):
``auto`` (every replica online), ``off``, or ``replicas=N|all,fsync=none|local``."""
CALLBACK_SECRET_ENV: Final = "STREAMQ_CALLBACK_SECRET"
"""The worker only: the key of the HMAC that signs callback deliveries (unset: unsigned)."""
ALLOW_EVICTING_ENV: Final = "STREAMQ_ALLOW_EVICTING_REDIS"
METRICS_PORT_ENV: Final = "STREAMQ_METRICS_PORT"
FRONT_ENDS_ENV: Final = "STREAMQ_FRONT_ENDS"
CPU_NICE_ENV: Final = "STREAMQ_CPU_NICE"
ENGINE_ARGS_ENV: Final = "STREAMQ_ENGINE_ARGS"
ENGINE_FACTORY_ENV: Final = "STREAMQ_ENGINE_FACTORY"
LORA_PLUGIN_ENV: Final = "STREAMQ_LORA_PLUGIN"
"""Set by the worker for its engine's processes (``worker/lora_plugin.py``)."""
AFFINITY_WINDOW_ENV: Final = "STREAMQ_AFFINITY_WINDOW_S"
"""The producer only (library, command line, gateway): its ``affinity_window_s`` when not
given (seconds; default ``AFFINITY_WINDOW_MS`` / 1000; 0 turns prefix-aware pickup off for it)."""
MODEL_MEMORY_ENV: Final = "STREAMQ_MODEL_MEMORY_S"
"""The producer only (library, command line, gateway): seconds a model with no live worker
still takes requests after its last one (default ``DEFAULT_MODEL_MEMORY_S``; 0: none)."""
DECLARED_MODELS_ENV: Final = "STREAMQ_DECLARED_MODELS"
"""The producer only: models that take requests with no live worker even if none was ever
seen, comma-separated ``NAME`` or ``NAME=QUEUE`` (a name alone: the client's queue)."""
API_KEYS_ENV: Final = "STREAMQ_API_KEYS"
"""Comma-separated API keys the gateway accepts besides ``--api-key`` (default: none)."""
FILES_URL_ENV: Final = "STREAMQ_FILES_URL"
"""The gateway only: where the Batch API's files live (a directory or ``s3://bucket/prefix``)."""
GATEWAY_HOST_ENV: Final = "STREAMQ_GATEWAY_HOST"
GATEWAY_PORT_ENV: Final = "STREAMQ_GATEWAY_PORT"
DEMO_MODEL_ENV: Final = "STREAMQ_DEMO_MODEL"
DASHBOARD_PORT_ENV: Final = "STREAMQ_DASHBOARD_PORT"
SCRIPTED_TOKENS_PER_S_ENV: Final = "STREAMQ_SCRIPTED_TOKENS_PER_S"
"""The scripted engine's steps per second (so each request's tokens per second)."""
SCRIPTED_MAX_NUM_SEQS_ENV: Final = "STREAMQ_SCRIPTED_MAX_NUM_SEQS"
"""The scripted engine's requests at once, which sizes its worker's ``max_jobs``."""


Reader = Literal["worker", "producer", "gateway", "exporter", "devkit"]
"""``producer``: the library and the command line (the gateway is a producer too, and reads
what they read)."""


@dataclass(frozen=True)
class EnvVar:
    name: str
    holds: str
    """What its value is: a URL, seconds, a number, a list, ``1``/``0``."""
    default: str
    """As a reader takes it when the variable is unset."""
    readers: tuple[Reader, ...]
    does: str
    flag: str | None = None
    """The command-line flag it is the default of, where there is one (the flag wins)."""


ENV_VARS: Final[tuple[EnvVar, ...]] = (
    EnvVar(
        REDIS_URL_ENV,
        "URL",
        DEFAULT_REDIS_URL,
        ("worker", "producer", "exporter"),
        "the Redis of the queues (`redis://`, `rediss://`, `unix://`, `redis+sentinel://`)",
        "--redis-url",
    ),
    EnvVar(
        EVENTS_REDIS_URL_ENV,
        "URL",
        "unset: `$REDIS_URL` carries the events too",
        ("worker", "producer"),
        "a Redis Cluster (`redis+cluster://host:port,...`) for the token path: each request's log, owner "
        "key and channel",
        "--events-redis-url",
    ),
    EnvVar(
        QUEUE_ENV,
        "queue name",
        DEFAULT_QUEUE,
        ("worker", "producer"),
        "the queue a worker serves and a producer sends to when no model routes it",
        "--queue",
    ),
    EnvVar(
        DRAIN_SECONDS_ENV,
        "seconds",
        str(DEFAULT_DRAIN_SECONDS),
        ("worker",),
        "how long a stopping worker lets its running requests finish before it hands them back",
        "--drain-seconds",
    ),
    EnvVar(
        LOG_TTL_ENV,
        "seconds",
        str(LOG_TTL_MS // 1000),
        ("worker", "producer"),
        "how long a request's replay log is kept after its last event",
        "--log-ttl-s",
    ),
    EnvVar(
        LOG_MAXLEN_ENV,
        "entries",
        str(LOG_MAXLEN),
        ("worker",),
        "the replay log's length cap (`MAXLEN ~`)",
        "--log-maxlen",
    ),
    EnvVar(
        KEEP_RESULT_ENV,
        "seconds",
        str(DEFAULT_KEEP_RESULT_S),
        ("worker",),
        "how long arq keeps a finished job's result (`arq:result:<id>`)",
        "--keep-result-s",
    ),
    EnvVar(
        CHECKPOINT_TOKENS_ENV,
        "tokens",
        str(DEFAULT_CHECKPOINT_TOKENS),
        ("worker",),
        "tokens per checkpoint of a request nobody streams",
    ),
    EnvVar(
        COALESCE_ENV,
        "`1` or `0`",
        "1",
        ("worker",),
        "`0` stops the worker from merging a request's waiting chunks into one event",
        "--no-coalesce",
    ),
    EnvVar(
        DURABLE_ENDS_ENV,
        "`auto`, `off`, `replicas=N|all,fsync=none|local`",
        DEFAULT_DURABLE_ENDS,
        ("worker",),
        "what a request's end waits for (replicas, the primary's fsync) before anyone is told",
        "--durable-ends",
    ),
    EnvVar(
        CALLBACK_SECRET_ENV,
        "text",
        "unset: deliveries unsigned",
        ("worker",),
        "the key of the HMAC that signs completion callbacks",
    ),
    EnvVar(
        ALLOW_EVICTING_ENV,
        "`1` or `0`",
        "0",
        ("worker",),
        "`1` starts the worker under an `allkeys-*` `maxmemory-policy`, warned",
        "--allow-evicting-redis",
    ),
    EnvVar(
        METRICS_PORT_ENV,
        "port",
        "9400",
        ("worker",),
        "where the worker serves `/metrics`, `/ready` and `/health` (0: nowhere)",
        "--metrics-port",
    ),
    EnvVar(
        FRONT_ENDS_ENV,
        "number",
        "1",
        ("worker",),
        "worker processes feeding one engine core, as `vllm serve --api-server-count`",
        "--front-ends",
    ),
    EnvVar(
        CPU_NICE_ENV,
        "nice value",
        "10",
        ("worker",),
        "how far the worker lowers its CPU weight, so its engine never starves Redis and clients on the "
        "host (0: not at all)",
        "--cpu-nice",
    ),
    EnvVar(
        ENGINE_ARGS_ENV,
        "`vllm serve` flags",
        "unset",
        ("worker",),
        "the engine's flags where the worker runs as plain `arq worker.WorkerSettings` (no command line)",
    ),
    EnvVar(
        ENGINE_FACTORY_ENV,
        "`module:function`",
        "unset: vLLM's `AsyncLLM`",
        ("worker",),
        "a function that builds the worker's engine instead (tests and benchmarks: the scripted engine)",
        "--engine-factory",
    ),
    EnvVar(
        LORA_PLUGIN_ENV,
        "`1`",
        "unset",
        ("worker",),
        "set by the worker itself for its engine's processes (it logs each LoRA adapter loaded from "
        "disk); not for users",
    ),
    EnvVar(
        AFFINITY_WINDOW_ENV,
        "seconds",
        f"{AFFINITY_WINDOW_MS / 1000:g}",
        ("producer",),
        "how long a request waits for the worker holding its prefix before any worker may take it (0: pickup off)",
    ),
    EnvVar(
        MODEL_MEMORY_ENV,
        "seconds",
        str(DEFAULT_MODEL_MEMORY_S),
        ("producer",),
        "how long a model with no live worker still takes requests after its last one (they wait for the next)",
        "--model-memory-s (the gateway's)",
    ),
    EnvVar(
        DECLARED_MODELS_ENV,
        "`NAME` or `NAME=QUEUE`, comma-separated",
        "unset",
        ("producer", "exporter"),
        "models that take requests with no live worker even if none was ever seen",
    ),
    EnvVar(
        API_KEYS_ENV,
        "keys, comma-separated",
        "unset: none",
        ("gateway",),
        "API keys the gateway accepts besides `--api-key` and those stored in Redis",
    ),
    EnvVar(
        FILES_URL_ENV,
        "directory or `s3://bucket/prefix`",
        "unset: `$XDG_DATA_HOME/streamq/files` (or `~/.local/share/streamq/files`)",
        ("gateway",),
        "where uploaded files and batch outputs live (`/v1/files`); S3 credentials from the usual `AWS_*` variables",
        "--files-url",
    ),
    EnvVar(GATEWAY_HOST_ENV, "address", "127.0.0.1", ("gateway",), "where the gateway listens", "--host"),
    EnvVar(GATEWAY_PORT_ENV, "port", "8000", ("gateway",), "the gateway's port", "--port"),
    EnvVar(
        DEMO_MODEL_ENV,
        "model name",
        "Qwen/Qwen2.5-0.5B-Instruct",
        ("devkit",),
        "`make demo`'s model (the tiny local model when the hub cannot be reached)",
    ),
    EnvVar(DASHBOARD_PORT_ENV, "port", "8000", ("devkit",), "`make dashboard`'s gateway port"),
    EnvVar(
        SCRIPTED_TOKENS_PER_S_ENV,
        "steps per second",
        "100",
        ("devkit",),
        "the scripted engine's pace (tests and benchmarks)",
    ),
    EnvVar(
        SCRIPTED_MAX_NUM_SEQS_ENV,
        "number",
        "256",
        ("devkit",),
        "the scripted engine's requests at once (tests and benchmarks)",
    ),
)

BY_NAME: Final = {var.name: var for var in ENV_VARS}


def markdown_table() -> str:
    """The table of docs/operations/configuration.md."""
    rows = ["| variable | holds | default | read by | flag | what it does |", "|---|---|---|---|---|---|"]
    for var in ENV_VARS:
        first, _, rest = (var.flag or "").partition(" ")
        flag = f"`{first}`" + (f" {rest}" if rest else "") if first else ""
        default = var.default if var.default.startswith("unset") or " " in var.default else f"`{var.default}`"
        rows.append(f"| `{var.name}` | {var.holds} | {default} | {', '.join(var.readers)} | {flag} | {var.does} |")
    return "\n".join(rows) + "\n"


if __name__ == "__main__":
    print(markdown_table(), end="")
