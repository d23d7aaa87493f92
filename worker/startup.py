"""The worker's start-up, shared by ``python -m worker`` and each front end of
``--front-ends N``: the command line (worker options first, then vLLM's engine flags as
``vllm serve`` spells them), logging, and running one arq worker until it stops.
"""

from __future__ import annotations

import argparse
import logging
import os
import shlex
import sys
from collections.abc import Mapping

from vllm.engine.arg_utils import optional_type
from vllm.entrypoints.launchers.cli_args import LoRAParserAction
from vllm.entrypoints.openai.models.protocol import LoRAModulePath
from vllm.utils.argparse_utils import FlexibleArgumentParser

from streamq.broker.connection import (
    SOCKET_TIMEOUT_S,
    add_connection_options,
    events_url_from_args,
    redis_url_from_args,
)
from streamq.broker.durability import DurabilitySpec, durable_ends_from_env
from streamq.broker.memory_policy import allow_evicting_from_env
from streamq.broker.replay_log import log_limits_from_env
from streamq.env_vars import (
    CALLBACK_SECRET_ENV,
    CHECKPOINT_TOKENS_ENV,
    COALESCE_ENV,
    DRAIN_SECONDS_ENV,
    DURABLE_ENDS_ENV,
    ENGINE_ARGS_ENV,
    FRONT_ENDS_ENV,
    KEEP_RESULT_ENV,
    LOG_MAXLEN_ENV,
    LOG_TTL_ENV,
)
from streamq.environment import drain_seconds_from_env
from streamq.protocol.names import DEFAULT_DURABLE_ENDS_TIMEOUT_S
from worker.arq_worker import StreamqWorker
from worker.callbacks import CallbackPolicy, secret_from_env
from worker.chat_parsing import ParserFlags
from worker.config import (
    DEFAULT_JOB_TIMEOUT_S,
    FrontEndSeat,
    WorkerConfig,
    engine_factory_from_env,
    keep_result_from_env,
)
from worker.delivery import checkpoint_tokens_from_env
from worker.engine import add_engine_args, engine_args_from_namespace
from worker.metrics import metrics_port_from_env
from worker.publisher import coalesce_from_env
from worker.scheduling import cpu_nice_from_env
from worker.state import ENGINE_DEAD_EXIT_CODE, STATE_KEY, WorkerState


def front_ends_from_env(environ: Mapping[str, str] = os.environ) -> int:
    """``$STREAMQ_FRONT_ENDS`` or 1: one process, the engine core its own child."""
    return int(environ.get(FRONT_ENDS_ENV, "1"))


def _positive_int(value: str) -> int:
    number = int(value)
    if number < 1:
        raise argparse.ArgumentTypeError(f"must be 1 or more, not {number}")
    return number


def _non_negative_int(value: str) -> int:
    number = int(value)
    if number < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, not {number}")
    return number


def _durable_ends(value: str) -> str:
    """A ``--durable-ends`` spec, checked (kept as given: the start-up hook parses it)."""
    try:
        DurabilitySpec.parse(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return value


def _wait_bound(value: str) -> float:
    seconds = float(value)
    if not 0 < seconds < SOCKET_TIMEOUT_S:
        raise argparse.ArgumentTypeError(
            f"must be above 0 and below a connection's reply timeout ({SOCKET_TIMEOUT_S:g} s), not {seconds:g}"
        )
    return seconds


def build_parser() -> FlexibleArgumentParser:
    """The command line; each worker option's default is its variable's reader (the
    environment read here, once, as the worker starts), so a flag given wins."""
    parser = FlexibleArgumentParser(
        prog="python -m worker",
        description="streamq worker: pulls prompts from Redis, streams tokens to pub/sub.",
        epilog=f"Engine flags may also come from ${ENGINE_ARGS_ENV}; flags given here win.",
    )
    group = parser.add_argument_group("worker")
    add_connection_options(group)
    group.add_argument(
        "--max-jobs", type=int, default=None, help="requests run at once (default: the engine's max_num_seqs)"
    )
    group.add_argument(
        "--allow-evicting-redis",
        action="store_true",
        default=allow_evicting_from_env(),
        help="start even where Redis's maxmemory-policy is allkeys-* (a full Redis then deletes any key: "
        "queued jobs, leases, replay logs, registrations); a volatile-* policy is warned of only "
        "(default: $STREAMQ_ALLOW_EVICTING_REDIS, else refuse)",
    )
    group.add_argument(
        "--engine-queue",
        type=_non_negative_int,
        default=None,
        metavar="N",
        help="requests claimed beyond those, to wait inside the engine and start in the step a slot frees, "
        "as offline LLM.generate keeps its requests; claimed only where no other worker has room for them "
        "(default: as many as max_num_seqs; 0 with --max-jobs; 0 turns it off)",
    )
    group.add_argument(
        "--front-ends",
        type=_positive_int,
        default=front_ends_from_env(),
        metavar="N",
        help="feed one engine core from N worker processes, as vllm serve --api-server-count N does: each "
        "claims jobs and streams their tokens, together never more than the engine runs at once; more than "
        f"one when a single process cannot keep up with the GPU (default: ${FRONT_ENDS_ENV} or %(default)s)",
    )
    group.add_argument(
        "--drain-seconds",
        type=int,
        default=drain_seconds_from_env(),
        help="on SIGTERM, time running requests get to finish before they are handed back "
        f"to the queue (default: ${DRAIN_SECONDS_ENV} or %(default)s)",
    )
    group.add_argument(
        "--job-timeout",
        type=float,
        default=DEFAULT_JOB_TIMEOUT_S,
        help="hard limit on one job's run, in seconds: past it the request ends with an error event "
        "(code timeout); a request's own deadline is its deadline_s (default: %(default)s)",
    )
    group.add_argument(
        "--engine-factory",
        default=engine_factory_from_env(),
        metavar="MODULE:CALLABLE",
        help="build the engine with this callable instead of vLLM's AsyncLLM "
        "(a scripted engine for load tests; default: $STREAMQ_ENGINE_FACTORY or none)",
    )
    group.add_argument(
        "--metrics-port",
        type=int,
        default=metrics_port_from_env(),
        help="serve Prometheus metrics on http://0.0.0.0:PORT/metrics, and the probes /ready and /health "
        "(docs/operations/worker.md#probes); 0 turns them off (default: $STREAMQ_METRICS_PORT or %(default)s)",
    )
    group.add_argument(
        "--cpu-nice",
        type=int,
        default=cpu_nice_from_env(),
        help="lower the CPU weight of the worker and its engine processes (and of their session or cgroup) by "
        "this nice value, so that Redis and clients on the same host are never starved by the busy engine; "
        "0 leaves it alone (default: $STREAMQ_CPU_NICE or %(default)s)",
    )
    log_maxlen, log_ttl_ms = log_limits_from_env()
    group.add_argument(
        "--log-ttl-s",
        type=float,
        default=log_ttl_ms / 1000,
        help=f"how long a request's replay log (its events, for late and reconnecting subscribers and for "
        f"a take-over elsewhere) outlives its last event (default: ${LOG_TTL_ENV} or %(default)g)",
    )
    group.add_argument(
        "--log-maxlen",
        type=int,
        default=log_maxlen,
        help=f"events kept in a request's replay log; a longer request's oldest events are trimmed "
        f"(default: ${LOG_MAXLEN_ENV} or %(default)s)",
    )
    group.add_argument(
        "--no-coalesce",
        dest="coalesce",
        action="store_false",
        default=coalesce_from_env(),
        help="send every engine DELTA as a chunk event of its own, even under load; by default a request's "
        "DELTAs that wait behind a batch in flight to Redis go out merged into one chunk "
        f"(default: merge, unless ${COALESCE_ENV}=0)",
    )
    group.add_argument(
        "--checkpoint-tokens",
        type=_positive_int,
        default=checkpoint_tokens_from_env(),
        metavar="N",
        help="a request that is not streamed (a batch line, stream: false) is asked of the engine and written "
        "to Redis every N tokens (a checkpoint) instead of every token: a worker's death costs at most N tokens "
        f"per completion generated again (default: ${CHECKPOINT_TOKENS_ENV} or %(default)s)",
    )
    group.add_argument(
        "--durable-ends",
        type=_durable_ends,
        default=durable_ends_from_env(),
        metavar="SPEC",
        help="what a request's end (its final or error event, a callback's claim) waits for before anyone is "
        "told, so that a failover cannot take it back: auto waits for every replica the primary reports online "
        "(WAIT; none: no wait); off waits for nothing; or replicas=N|all,fsync=none|local (fsync=local adds the "
        "primary's own AOF fsync, WAITAOF, where the server has it) (docs/reliability.md; default: "
        f"${DURABLE_ENDS_ENV} or %(default)s)",
    )
    group.add_argument(
        "--durable-ends-timeout-s",
        type=_wait_bound,
        default=DEFAULT_DURABLE_ENDS_TIMEOUT_S,
        metavar="S",
        help="how long one wait for an end's replicas blocks; an end they have not acknowledged by then is held "
        "and confirmed again (on whichever primary then holds its request) until they do, the primary drops a "
        "replica it cannot reach (its repl-timeout) or another primary takes over; the shortfall is logged and "
        "counted. A callback's claim, a cancel and an end written outside a job are told after one wait "
        "(default: %(default)g)",
    )
    group.add_argument(
        "--keep-result-s",
        type=float,
        default=keep_result_from_env(),
        help="how long arq keeps a finished job's result; status tells how a request ended while its result "
        f"or its replay log (--log-ttl-s) is kept (default: ${KEEP_RESULT_ENV} or %(default)g)",
    )
    policy = CallbackPolicy()
    group.add_argument(
        "--callback-tries",
        type=int,
        default=policy.tries,
        help="tries of a completion callback's delivery, in all (default: %(default)s)",
    )
    group.add_argument(
        "--callback-backoff-s",
        type=float,
        default=policy.backoff_s,
        help="wait before a callback's first retry; each next one waits twice as long (default: %(default)g)",
    )
    group.add_argument(
        "--callback-timeout-s",
        type=float,
        default=policy.timeout_s,
        help=f"time one callback try may take; deliveries are signed with ${CALLBACK_SECRET_ENV} "
        "(default: %(default)g)",
    )
    _add_tool_args(parser)
    lora = parser.add_argument_group("LoRA adapters (as vllm serve; --enable-lora, --max-loras, ... are engine flags)")
    lora.add_argument(
        "--lora-modules",
        type=optional_type(str),
        default=None,
        nargs="+",
        action=LoRAParserAction,
        help="adapters served as models beside the base model, loaded at start-up: NAME=PATH, or vLLM's JSON "
        '\'{"name": "NAME", "path": "PATH", "base_model_name": "BASE"}\'; adapters not listed are loaded at run '
        "time by vLLM's LoRA resolvers where one is set up (e.g. $VLLM_LORA_RESOLVER_CACHE_DIR)",
    )
    add_engine_args(parser)
    return parser


def lora_modules_from_args(args: argparse.Namespace) -> list[LoRAModulePath] | None:
    """``--lora-modules`` as given; refused without ``--enable-lora`` (the engine could not load them)."""
    modules: list[LoRAModulePath] | None = args.lora_modules
    if modules and not getattr(args, "enable_lora", False):
        raise SystemExit("python -m worker: --lora-modules needs --enable-lora")
    return modules or None


def _add_tool_args(parser: FlexibleArgumentParser) -> None:
    """``vllm serve``'s tool-call flags, spelled and meant as there (``--reasoning-parser``
    is an engine argument: it comes with them)."""
    group = parser.add_argument_group("tool calls (as vllm serve)")
    group.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help="parse tool calls out of the output of requests with tool_choice auto (needs --tool-call-parser)",
    )
    group.add_argument(
        "--tool-call-parser",
        default=None,
        help="vLLM's tool parser for the model (hermes, llama3_json, pythonic, ...); named and required tool "
        "choices need it",
    )
    group.add_argument(
        "--tool-parser-plugin",
        default="",
        help="a Python file that registers more tool parsers, by the names --tool-call-parser takes",
    )
    group.add_argument(
        "--tool-strict-level",
        choices=["auto", "function", "parameter"],
        default="auto",
        help="how far vLLM's grammar constrains tool calls beyond what each request asks (default: %(default)s)",
    )


def parser_flags_from_args(args: argparse.Namespace) -> ParserFlags | None:
    """The tool-call flags given; ``None`` when none was."""
    try:
        flags = ParserFlags(
            enable_auto_tool_choice=args.enable_auto_tool_choice,
            tool_call_parser=args.tool_call_parser,
            tool_parser_plugin=args.tool_parser_plugin,
            tool_strict_level=args.tool_strict_level,
        )
    except ValueError as exc:
        raise SystemExit(f"python -m worker: {exc}") from None
    return None if flags == ParserFlags() else flags


def parse_args(argv: list[str]) -> argparse.Namespace:
    """``argv`` after the flags in ``$STREAMQ_ENGINE_ARGS`` (those given win), parsed. A
    variable the parser's defaults cannot read stops it as a bad flag does (exit 2)."""
    try:
        parser = build_parser()
    except ValueError as exc:
        print(f"python -m worker: error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    args: argparse.Namespace = parser.parse_args(shlex.split(os.environ.get(ENGINE_ARGS_ENV, "")) + argv)
    return args


def configure_logging(args: argparse.Namespace, *, front_ends: bool = False) -> None:
    """Log at vLLM's ``--log-level``; with several front ends, each line names its process."""
    log_level = str(getattr(args, "log_level", "info")).upper()
    where = " %(processName)s" if front_ends else ""
    logging.basicConfig(level=log_level, format=f"%(asctime)s %(levelname)s{where} %(name)s: %(message)s")


def config_from_args(args: argparse.Namespace, seat: FrontEndSeat | None = None) -> WorkerConfig:
    """The worker's configuration from its parsed command line (whose defaults are the
    environment's), as front end ``seat`` of ``--front-ends N`` where it is one."""
    return WorkerConfig(
        redis_url=redis_url_from_args(args),
        events_redis_url=events_url_from_args(args),
        queue=args.queue,
        drain_seconds=args.drain_seconds,
        job_timeout_s=args.job_timeout,
        keep_result_s=args.keep_result_s,
        max_jobs=args.max_jobs,
        engine_queue=args.engine_queue,
        # With a scripted engine vLLM's arguments are unused (and would name a hub model).
        engine_args=None if args.engine_factory else engine_args_from_namespace(args),
        engine_factory=args.engine_factory,
        metrics_port=args.metrics_port,
        cpu_nice=args.cpu_nice,
        allow_evicting_redis=args.allow_evicting_redis,
        log_ttl_ms=round(args.log_ttl_s * 1000),
        log_maxlen=args.log_maxlen,
        coalesce=args.coalesce,
        checkpoint_tokens=args.checkpoint_tokens,
        durable_ends=args.durable_ends,
        durable_ends_timeout_s=args.durable_ends_timeout_s,
        callback_tries=args.callback_tries,
        callback_backoff_s=args.callback_backoff_s,
        callback_timeout_s=args.callback_timeout_s,
        callback_secret=secret_from_env(),
        front_end=seat,
        parsers=parser_flags_from_args(args),
        lora_modules=lora_modules_from_args(args),
    )


def run_worker(config: WorkerConfig) -> int:
    """Run one worker (or one front end of ``--front-ends N``) until it stops; its exit code."""
    worker = StreamqWorker(config)
    worker.run()
    state = worker.ctx.get(STATE_KEY)
    if isinstance(state, WorkerState) and state.engine_dead:
        return ENGINE_DEAD_EXIT_CODE  # make supervisors (and compose) restart us
    return 0
