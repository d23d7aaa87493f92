"""``python -m gateway``: serve OpenAI's completions API from the queue.

python -m gateway --redis-url redis://localhost:6379 --port 8000 --api-key-file /run/secrets/api-keys
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Final

import uvicorn

from gateway.app import DEFAULT_QUEUE_TIMEOUT_S, create_app
from gateway.auth import static_keys
from gateway.batch_api.config import (
    COMPLETION_WINDOWS,
    DEFAULT_BATCH_PRIORITY,
    DEFAULT_MAX_FILE_BYTES,
    DEFAULT_MAX_LINES,
    DEFAULT_MAX_RUNNING_BATCHES,
    DEFAULT_MAX_STORED_BYTES,
    DEFAULT_ONLINE_RESERVE,
    DEFAULT_OUTPUT_EXPIRY_S,
    LEASE_MS,
    BatchApiConfig,
    default_files_url,
)
from gateway.body_limit import DEFAULT_MAX_BODY_BYTES
from gateway.sse import DEFAULT_KEEPALIVE_S
from producer.openai_api.limits import RequestLimits, add_max_n_option
from streamq.broker.connection import add_redis_url_option, events_url_from_args, redis_url_from_args
from streamq.env_vars import (
    API_KEYS_ENV,
    DECLARED_MODELS_ENV,
    FILES_URL_ENV,
    GATEWAY_HOST_ENV,
    GATEWAY_PORT_ENV,
    MODEL_MEMORY_ENV,
)
from streamq.environment import parse_declared_models

DEFAULT_MAX_QUEUE_DEPTH: Final = 1000
"""Jobs a model's queue may hold (waiting or running) before the gateway answers 429: a
bound on what a burst can pile up in Redis, far above what a pool of workers runs at once."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m gateway",
        description="OpenAI-compatible HTTP gateway: /v1/completions, /v1/chat/completions, /v1/models, "
        "/tokenize, /detokenize, /tokenizer_info, /health, /metrics. "
        "Requests are routed by model to the queues of live workers.",
    )
    add_redis_url_option(parser)
    parser.add_argument("--host", default=os.environ.get(GATEWAY_HOST_ENV, "127.0.0.1"))
    parser.add_argument("--port", type=int, default=int(os.environ.get(GATEWAY_PORT_ENV, "8000")))
    parser.add_argument(
        "--max-queue-depth",
        type=int,
        default=DEFAULT_MAX_QUEUE_DEPTH,
        help="answer 429 when a model's queue already holds this many jobs, waiting or running "
        "(default: %(default)s; 0: no limit)",
    )
    parser.add_argument(
        "--queue-timeout-s",
        type=float,
        default=DEFAULT_QUEUE_TIMEOUT_S,
        help="how long a request waits in the queue for a worker to start it (every worker busy, or none "
        "running yet: scaled to zero) before it ends with a 503 (default: %(default)g; 0: as long as its job "
        "is kept, a day)",
    )
    parser.add_argument(
        "--sse-keepalive-s",
        type=float,
        default=DEFAULT_KEEPALIVE_S,
        help="a stream silent this long gets an SSE comment, so that clients and proxies keep it open; a "
        "stream whose first event is slower opens without it (default: %(default)g)",
    )
    parser.add_argument(
        "--model-memory-s",
        type=float,
        default=None,
        help="how long after its last live worker a model still takes requests, which wait for its next "
        f"worker (default: ${MODEL_MEMORY_ENV} or a week; 0: none)",
    )
    parser.add_argument(
        "--declare-model",
        action="append",
        default=[],
        metavar="NAME[=QUEUE]",
        help="a model whose requests are taken with no live worker, even if none ever registered (the first "
        f"start of a fleet that scales from zero); repeatable (default: ${DECLARED_MODELS_ENV})",
    )
    parser.add_argument(
        "--max-body-bytes",
        type=int,
        default=DEFAULT_MAX_BODY_BYTES,
        help="answer 413 to a request body larger than this, before reading it whole (default: %(default)s, 4 MiB)",
    )
    add_max_n_option(parser)
    parser.add_argument(
        "--reject-unknown-fields",
        action="store_true",
        help="answer 400 to a request with a field the gateway does not know, as OpenAI does (default: ignore it "
        "and log its name, as vllm serve does)",
    )
    parser.add_argument(
        "--api-key",
        action="append",
        default=[],
        metavar="KEY",
        help="require 'Authorization: Bearer KEY' on every /v1/* route (repeatable; keys created with "
        "`streamq keys create` are accepted too)",
    )
    parser.add_argument(
        "--api-key-file",
        action="append",
        default=[],
        type=Path,
        metavar="PATH",
        help="a file of API keys, one per line (blank lines and # comments skipped; repeatable)",
    )
    parser.add_argument(
        "--protect-metrics", action="store_true", help="require an API key on /metrics too (default: open)"
    )
    parser.add_argument(
        "--tokenizer-model",
        metavar="MODEL",
        help="the model whose tokenizer answers /tokenize, /detokenize and /tokenizer_info requests that name "
        "none (lm-evaluation-harness's remote tokenizer names none; default: the one model live workers serve)",
    )
    add_batch_api_options(parser)
    parser.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    return parser


def add_batch_api_options(parser: argparse.ArgumentParser) -> None:
    """The Batch API's settings (``BatchApiConfig``): where files live and how batches run."""
    group = parser.add_argument_group("files and batches (/v1/files, /v1/batches)")
    group.add_argument(
        "--files-url",
        default=default_files_url(),
        metavar="DIR|s3://BUCKET/PREFIX",
        help="where uploaded files and batch outputs live: a local directory (every gateway on the machine "
        "sharing it) or an S3-compatible store, with credentials from the usual AWS_* variables "
        f"(default: ${FILES_URL_ENV} or %(default)s)",
    )
    group.add_argument(
        "--s3-endpoint-url", metavar="URL", help="the S3 endpoint of an s3:// --files-url other than AWS's"
    )
    group.add_argument(
        "--batch-max-file-bytes",
        type=int,
        default=DEFAULT_MAX_FILE_BYTES,
        help="answer 413 to an upload larger than this, before reading it whole (default: %(default)s, 200 MB)",
    )
    group.add_argument(
        "--batch-max-lines",
        type=int,
        default=DEFAULT_MAX_LINES,
        help="a batch whose input has more requests than this fails validation (default: %(default)s)",
    )
    group.add_argument(
        "--batch-completion-window",
        action="append",
        default=[],
        metavar="NAME=SECONDS",
        help="a completion_window batches may name besides 24h (repeatable; e.g. 1h=3600)",
    )
    group.add_argument(
        "--batch-output-expiry-s",
        type=int,
        default=DEFAULT_OUTPUT_EXPIRY_S,
        help="how long a batch's output and error files are kept unless it says (default: %(default)s, 30 days)",
    )
    group.add_argument(
        "--batch-priority",
        type=int,
        default=DEFAULT_BATCH_PRIORITY,
        help="the priority batches' requests run at; online requests run at 0, lower runs sooner "
        "(default: %(default)s)",
    )
    group.add_argument(
        "--batch-max-stored-bytes",
        type=int,
        default=DEFAULT_MAX_STORED_BYTES,
        help="bytes one API key's files may hold (inputs and outputs) before uploads get 429 (default: %(default)s)",
    )
    group.add_argument(
        "--batch-max-running",
        type=int,
        default=DEFAULT_MAX_RUNNING_BATCHES,
        help="unfinished batches one API key may have before creating another gets 429 (default: %(default)s)",
    )
    group.add_argument(
        "--batch-online-reserve",
        type=int,
        default=DEFAULT_ONLINE_RESERVE,
        metavar="SLOTS",
        help="slots of each live worker (at most an eighth of its slots) that batches leave free for online "
        "requests, which then start at once "
        "(default: %(default)s; 0: batches fill every slot and an online request waits for a batch line to end)",
    )
    group.add_argument(
        "--batch-lease-ms",
        type=int,
        default=LEASE_MS,
        help="a running batch's lease: a gateway that dies hands its batches to another within it "
        "(default: %(default)s)",
    )
    group.add_argument(
        "--no-run-batches",
        dest="run_batches",
        action="store_false",
        help="take files and batches but leave running them to other gateways (default: every gateway runs them)",
    )


def batch_api_config(args: argparse.Namespace) -> BatchApiConfig:
    """``BatchApiConfig`` from the options of ``add_batch_api_options``; ``ValueError`` for
    a value out of range."""
    windows = dict(COMPLETION_WINDOWS)
    for window in args.batch_completion_window:
        name, _, seconds = window.partition("=")
        if not name or not seconds.isdigit() or int(seconds) < 1:
            raise ValueError(f"--batch-completion-window takes NAME=SECONDS, not {window!r}")
        windows[name] = int(seconds)
    positive = {
        "--batch-max-file-bytes": args.batch_max_file_bytes,
        "--batch-max-lines": args.batch_max_lines,
        "--batch-output-expiry-s": args.batch_output_expiry_s,
        "--batch-max-stored-bytes": args.batch_max_stored_bytes,
        "--batch-max-running": args.batch_max_running,
        "--batch-lease-ms": args.batch_lease_ms,
    }
    for flag, value in positive.items():
        if value < 1:
            raise ValueError(f"{flag} must be >= 1")
    if args.batch_online_reserve < 0:
        raise ValueError("--batch-online-reserve must be >= 0")
    return BatchApiConfig(
        files_url=args.files_url,
        s3_options={"endpoint_url": args.s3_endpoint_url} if args.s3_endpoint_url else {},
        max_file_bytes=args.batch_max_file_bytes,
        max_lines=args.batch_max_lines,
        completion_windows=windows,
        output_expiry_s=args.batch_output_expiry_s,
        batch_priority=args.batch_priority,
        max_stored_bytes=args.batch_max_stored_bytes,
        max_running_batches=args.batch_max_running,
        online_reserve=args.batch_online_reserve,
        lease_ms=args.batch_lease_ms,
        run_batches=args.run_batches,
    )


def main(argv: Sequence[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    if args.max_queue_depth < 0:
        build_parser().error("--max-queue-depth must be >= 0 (0: no limit)")
    if args.max_body_bytes < 1:
        build_parser().error("--max-body-bytes must be >= 1")
    if args.queue_timeout_s < 0 or args.sse_keepalive_s <= 0:
        build_parser().error("--queue-timeout-s must be >= 0 (0: none) and --sse-keepalive-s > 0")
    if args.model_memory_s is not None and args.model_memory_s < 0:
        build_parser().error("--model-memory-s must be >= 0")
    try:
        declared = parse_declared_models(",".join(args.declare_model)) if args.declare_model else None
    except ValueError as exc:
        build_parser().error(f"--declare-model: {exc}")
    try:
        keys = static_keys(args.api_key, args.api_key_file, os.environ.get(API_KEYS_ENV))
    except (OSError, ValueError) as exc:
        build_parser().error(f"API keys: {exc}")
    try:
        batch_api = batch_api_config(args)
    except ValueError as exc:
        build_parser().error(str(exc))
    app = create_app(
        redis_url_from_args(args),
        events_url=events_url_from_args(args),
        max_queue_depth=args.max_queue_depth or None,
        max_body_bytes=args.max_body_bytes,
        limits=RequestLimits(max_n=args.max_n, reject_unknown_fields=args.reject_unknown_fields),
        api_keys=keys,
        protect_metrics=args.protect_metrics,
        tokenizer_model=args.tokenizer_model,
        queue_timeout_s=args.queue_timeout_s or None,
        keepalive_s=args.sse_keepalive_s,
        model_memory_s=args.model_memory_s,
        declared_models=declared,
        batch_api=batch_api,
    )
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, timeout_graceful_shutdown=5)


if __name__ == "__main__":
    main()
