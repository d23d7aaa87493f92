"""Every environment variable streamq reads, in one place: its name, what it holds, its
default, who reads it and what it does, as vLLM's ``envs.py`` lists vLLM's.

Each service still reads its own where it starts (the worker's become its flags' defaults, a
flag given wins); this registry is what the docs are generated from
(``python -m streamq.env_vars`` prints docs/operations/configuration.md's table) and what a
test holds the code to: a ``STREAMQ_*`` name the code reads that is not here fails it, and
so does one here that the code no longer reads.
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
        "REDIS_URL",
        "URL",
        DEFAULT_REDIS_URL,
        ("worker", "producer", "exporter"),
        "the Redis of the queues (`redis://`, `rediss://`, `unix://`, `redis+sentinel://`)",
        "--redis-url",
    ),
    EnvVar(
        "STREAMQ_EVENTS_REDIS_URL",
        "URL",
        "unset: `$REDIS_URL` carries the events too",
        ("worker", "producer"),
        "a Redis Cluster (`redis+cluster://host:port,...`) for the token path: each request's log, owner "
        "key and channel",
        "--events-redis-url",
    ),
    EnvVar(
        "STREAMQ_QUEUE",
        "queue name",
        DEFAULT_QUEUE,
        ("worker", "producer"),
        "the queue a worker serves and a producer sends to when no model routes it",
        "--queue",
    ),
    EnvVar(
        "STREAMQ_DRAIN_SECONDS",
        "seconds",
        str(DEFAULT_DRAIN_SECONDS),
        ("worker",),
        "how long a stopping worker lets its running requests finish before it hands them back",
        "--drain-seconds",
    ),
    EnvVar(
        "STREAMQ_LOG_TTL_S",
        "seconds",
        str(LOG_TTL_MS // 1000),
        ("worker", "producer"),
        "how long a request's replay log is kept after its last event",
        "--log-ttl-s",
    ),
    EnvVar(
        "STREAMQ_LOG_MAXLEN",
        "entries",
        str(LOG_MAXLEN),
        ("worker",),
        "the replay log's length cap (`MAXLEN ~`)",
        "--log-maxlen",
    ),
    EnvVar(
        "STREAMQ_KEEP_RESULT_S",
        "seconds",
        str(DEFAULT_KEEP_RESULT_S),
        ("worker",),
        "how long arq keeps a finished job's result (`arq:result:<id>`)",
        "--keep-result-s",
    ),
    EnvVar(
        "STREAMQ_CHECKPOINT_TOKENS",
        "tokens",
        str(DEFAULT_CHECKPOINT_TOKENS),
        ("worker",),
        "tokens per checkpoint of a request nobody streams",
    ),
    EnvVar(
        "STREAMQ_COALESCE",
        "`1` or `0`",
        "1",
        ("worker",),
        "`0` stops the worker from merging a request's waiting chunks into one event",
        "--no-coalesce",
    ),
    EnvVar(
        "STREAMQ_DURABLE_ENDS",
        "`auto`, `off`, `replicas=N|all,fsync=none|local`",
        DEFAULT_DURABLE_ENDS,
        ("worker",),
        "what a request's end waits for (replicas, the primary's fsync) before anyone is told",
        "--durable-ends",
    ),
    EnvVar(
        "STREAMQ_CALLBACK_SECRET",
        "text",
        "unset: deliveries unsigned",
        ("worker",),
        "the key of the HMAC that signs completion callbacks",
    ),
    EnvVar(
        "STREAMQ_ALLOW_EVICTING_REDIS",
        "`1` or `0`",
        "0",
        ("worker",),
        "`1` starts the worker under an `allkeys-*` `maxmemory-policy`, warned",
        "--allow-evicting-redis",
    ),
    EnvVar(
        "STREAMQ_METRICS_PORT",
        "port",
        "9400",
        ("worker",),
        "where the worker serves `/metrics`, `/ready` and `/health` (0: nowhere)",
        "--metrics-port",
    ),
    EnvVar(
        "STREAMQ_FRONT_ENDS",
        "number",
        "1",
        ("worker",),
        "worker processes feeding one engine core, as `vllm serve --api-server-count`",
        "--front-ends",
    ),
    EnvVar(
        "STREAMQ_CPU_NICE",
        "nice value",
        "10",
        ("worker",),
        "how far the worker lowers its CPU weight, so its engine never starves Redis and clients on the "
        "host (0: not at all)",
        "--cpu-nice",
    ),
    EnvVar(
        "STREAMQ_ENGINE_ARGS",
        "`vllm serve` flags",
        "unset",
        ("worker",),
        "the engine's flags where the worker runs as plain `arq worker.WorkerSettings` (no command line)",
    ),
    EnvVar(
        "STREAMQ_ENGINE_FACTORY",
        "`module:function`",
        "unset: vLLM's `AsyncLLM`",
        ("worker",),
        "a function that builds the worker's engine instead (tests and benchmarks: the scripted engine)",
        "--engine-factory",
    ),
    EnvVar(
        "STREAMQ_LORA_PLUGIN",
        "`1`",
        "unset",
        ("worker",),
        "set by the worker itself for its engine's processes (it logs each LoRA adapter loaded from "
        "disk); not for users",
    ),
    EnvVar(
        "STREAMQ_AFFINITY_WINDOW_S",
        "seconds",
        f"{AFFINITY_WINDOW_MS / 1000:g}",
        ("producer",),
        "how long a request waits for the worker holding its prefix before any worker may take it (0: pickup off)",
    ),
    EnvVar(
        "STREAMQ_MODEL_MEMORY_S",
        "seconds",
        str(DEFAULT_MODEL_MEMORY_S),
        ("producer",),
        "how long a model with no live worker still takes requests after its last one (they wait for the next)",
        "--model-memory-s (the gateway's)",
    ),
    EnvVar(
        "STREAMQ_DECLARED_MODELS",
        "`NAME` or `NAME=QUEUE`, comma-separated",
        "unset",
        ("producer", "exporter"),
        "models that take requests with no live worker even if none was ever seen",
    ),
    EnvVar(
        "STREAMQ_API_KEYS",
        "keys, comma-separated",
        "unset: none",
        ("gateway",),
        "API keys the gateway accepts besides `--api-key` and those stored in Redis",
    ),
    EnvVar("STREAMQ_GATEWAY_HOST", "address", "127.0.0.1", ("gateway",), "where the gateway listens", "--host"),
    EnvVar("STREAMQ_GATEWAY_PORT", "port", "8000", ("gateway",), "the gateway's port", "--port"),
    EnvVar(
        "STREAMQ_DEMO_MODEL",
        "model name",
        "Qwen/Qwen2.5-0.5B-Instruct",
        ("devkit",),
        "`make demo`'s model (the tiny local model when the hub cannot be reached)",
    ),
    EnvVar("STREAMQ_DASHBOARD_PORT", "port", "8000", ("devkit",), "`make dashboard`'s gateway port"),
    EnvVar(
        "STREAMQ_SCRIPTED_TOKENS_PER_S",
        "steps per second",
        "100",
        ("devkit",),
        "the scripted engine's pace (tests and benchmarks)",
    ),
    EnvVar(
        "STREAMQ_SCRIPTED_MAX_NUM_SEQS",
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
