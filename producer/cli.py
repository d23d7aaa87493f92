"""``python -m producer`` (or ``streamq``): enqueue prompts and print their tokens as they arrive.

Subcommands: ``submit`` (the default: ``python -m producer "Hello"``), ``follow``, ``cancel``, ``status``,
``batch``, ``keys``, ``tenants``.
A prompt spelled like a subcommand goes after ``submit`` or ``--``. Exit status: 0 when every
request finished, 1 when any failed (errors on stderr), 2 for bad command-line arguments.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Callable, Coroutine, Sequence
from pathlib import Path
from typing import Any

from redis.exceptions import ConnectionError as RedisConnectionError
from rich.console import Console, Group
from rich.live import Live
from rich.text import Text

from producer import batch, keys_cli, status_cli, tenants_cli
from producer.affinity_args import add_affinity_arguments, affinity_kwargs
from producer.client import RequestHandle
from producer.connection_args import connect_from_args
from producer.errors import RequestError, StreamqError
from producer.structured_args import add_structured_output_arguments, structured_outputs_from_args
from streamq.broker.connection import (
    add_connection_options,
    request_id_argument,
)
from streamq.protocol import (
    ChunkEvent,
    ErrorEvent,
    Event,
    FinalEvent,
    InvalidRequest,
    event_json,
)

SUBCOMMANDS = ("submit", "follow", "cancel", "status", "batch", "keys", "tenants")
DEFAULT_SUBCOMMAND = "submit"
RENAMED_SUBCOMMANDS = {"tail": "follow"}
"""Old name -> new: an old name still runs its successor, with a warning, for a release."""

_EPILOG = """\
examples:
  %(prog)s "The key to happiness is" "In a galaxy far, far away"
  %(prog)s --json --max-tokens 32 --request-id req-1 "Hello"
  %(prog)s --choice yes --choice no "Is the sky blue?"
  %(prog)s follow req-1
  %(prog)s cancel req-1
  %(prog)s status req-1
  %(prog)s --callback-url https://example.com/done "Hello"
  %(prog)s batch requests.jsonl results.jsonl
  %(prog)s keys create team-a --rpm 600 --max-streams 16
  %(prog)s --priority -1 --tenant team-a "Urgent question"
  %(prog)s --affinity-key chat-42 "And what about the second chapter?"
  %(prog)s tenants set team-a --weight 3

Arguments that do not start with a subcommand are submit's. A prompt spelled
like a subcommand goes after submit or --:
  %(prog)s submit follow
  %(prog)s -- follow
"""


def _common_options(parser: argparse.ArgumentParser) -> None:
    add_connection_options(parser)
    parser.add_argument("--json", action="store_true", help="print the raw events as JSON lines")


def add_submit_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("prompts", nargs="+", metavar="PROMPT", help="one job is enqueued per prompt")
    _common_options(parser)
    parser.add_argument(
        "--max-tokens", type=int, default=None, help="tokens to generate per prompt (default: vLLM's, 16)"
    )
    parser.add_argument("--temperature", type=float, default=None, help="sampling temperature (default: vLLM's, 1.0)")
    parser.add_argument("--top-p", type=float, default=None)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument(
        "--logprobs",
        type=int,
        default=None,
        metavar="N",
        help="log probabilities of each generated token and of the N most likely (0: the token's only); "
        "they are in the chunk events --json prints",
    )
    parser.add_argument(
        "--prompt-logprobs",
        type=int,
        default=None,
        metavar="N",
        help="log probabilities of the prompt's tokens and of the N most likely at each (in the first chunk event)",
    )
    parser.add_argument(
        "--request-id", action="append", default=None, help="request id of each prompt, in order (default: random ids)"
    )
    parser.add_argument(
        "--model", default=None, help="send to the queue of the live workers serving this model (default: --queue)"
    )
    parser.add_argument(
        "--priority",
        type=int,
        default=0,
        help="lower runs sooner, as in vLLM: workers take the most urgent waiting job first (default: %(default)s)",
    )
    parser.add_argument(
        "--tenant",
        default=None,
        help="whose requests these are: within a priority, workers take turns between tenants (default: 'default')",
    )
    parser.add_argument(
        "--max-queue-depth",
        type=int,
        default=None,
        help="fail instead of enqueueing when the queue already holds this many jobs (default: no limit)",
    )
    parser.add_argument(
        "--callback-url",
        default=None,
        metavar="URL",
        help="POST each request's summary here when it ends (signed by the workers; docs/features/callbacks.md)",
    )
    parser.add_argument(
        "--callback-no-text",
        dest="callback_text",
        action="store_false",
        help="leave the generated text out of the callback's summary",
    )
    add_affinity_arguments(parser, scope="these prompts")
    add_structured_output_arguments(parser)


def add_follow_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("request_id", type=request_id_argument)
    parser.add_argument("--from-seq", type=int, default=0, help="first event to print (default: %(default)s)")
    _common_options(parser)


def add_cancel_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("request_id", type=request_id_argument)
    _common_options(parser)


def build_parser(prog: str = "python -m producer") -> argparse.ArgumentParser:
    """The command line; each subcommand leaves its runner in ``args.run``."""
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Enqueue prompts to streamq and stream their responses (Ctrl-C cancels them).",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    subparsers = parser.add_subparsers(title="subcommands")
    commands: list[tuple[str, str, str, Callable[[argparse.ArgumentParser], None], Callable[..., int]]] = [
        (
            "submit",
            "enqueue prompts and print their responses (the default)",
            "Enqueue prompts and stream their responses (Ctrl-C cancels them).",
            add_submit_arguments,
            submit_command,
        ),
        (
            "follow",
            "follow a request already submitted",
            "Print a request's events from its replay log, then live ones until it ends.",
            add_follow_arguments,
            follow_command,
        ),
        (
            "cancel",
            "cancel a request, running or queued",
            "Cancel a request: a running one wherever it runs, a queued one on any model's queue "
            "(--queue is looked at first; it need not be given).",
            add_cancel_arguments,
            cancel_command,
        ),
        (
            "status",
            "say where a request is",
            status_cli.STATUS_DESCRIPTION,
            status_cli.add_status_arguments,
            status_cli.main,
        ),
        ("batch", "run an OpenAI batch file", batch.BATCH_DESCRIPTION, batch.add_batch_arguments, batch.main),
        (
            "keys",
            "manage the gateway's API keys",
            keys_cli.KEYS_DESCRIPTION,
            keys_cli.add_keys_arguments,
            keys_cli.main,
        ),
        (
            "tenants",
            "set the weights of fair share between tenants",
            tenants_cli.TENANTS_DESCRIPTION,
            tenants_cli.add_tenants_arguments,
            tenants_cli.main,
        ),
    ]
    for name, summary, description, add_arguments, run in commands:
        subparser = subparsers.add_parser(name, help=summary, description=description)
        add_arguments(subparser)
        subparser.set_defaults(run=run)
    return parser


class ResponsePrinter:
    """Shows each request's text as its tokens arrive (or raw events with ``--json``)."""

    def __init__(self, labels: Sequence[str], *, as_json: bool) -> None:
        self.as_json = as_json
        self.labels = list(labels)
        self.texts = {label: Text() for label in labels}
        self.console = Console(highlight=False)
        self._live: Live | None = None

    def __enter__(self) -> ResponsePrinter:
        if not self.as_json and len(self.labels) > 1:
            self._live = Live(self._render(), console=self.console, auto_refresh=True, refresh_per_second=12)
            self._live.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._live is not None:
            self._live.update(self._render())
            self._live.__exit__(None, None, None)
        elif not self.as_json:
            sys.stdout.write("\n")
            sys.stdout.flush()

    def _render(self) -> Group:
        parts: list[Text] = []
        for label in self.labels:
            parts.append(Text(f"Prompt: {label!r}", style="bold"))
            parts.append(self.texts[label])
            parts.append(Text(""))
        return Group(*parts)

    def show(self, label: str, raw_json: str, event: Event) -> None:
        if self.as_json:
            sys.stdout.write(raw_json + "\n")
            sys.stdout.flush()
            return
        if isinstance(event, ChunkEvent):
            self.texts[label].append(event.text)
            if self._live is None:  # one prompt: straight to stdout, as it arrives
                sys.stdout.write(event.text)
                sys.stdout.flush()
        elif isinstance(event, FinalEvent) and self._live is not None:
            self.texts[label].append(f"  [{','.join(map(str, event.finish_reasons))}]", style="dim")


async def _print_events(handle: RequestHandle, label: str, printer: ResponsePrinter) -> bool:
    """Print one request's events; True if it finished, False if it failed."""
    try:
        async for event in handle:
            printer.show(label, event_json(event), event)
            if isinstance(event, ErrorEvent):
                raise RequestError(handle.request_id, event.code, event.message)
    except StreamqError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return False
    return True


async def run_submit(args: argparse.Namespace) -> int:
    if args.request_id is not None and len(args.request_id) != len(args.prompts):
        print("error: give one --request-id per prompt", file=sys.stderr)
        return 2
    sampling = {"max_tokens": args.max_tokens, "temperature": args.temperature, "top_p": args.top_p, "seed": args.seed}
    sampling.update(logprobs=args.logprobs, prompt_logprobs=args.prompt_logprobs)
    sampling = {k: v for k, v in sampling.items() if v is not None}
    ids = args.request_id or [None] * len(args.prompts)
    callback = None if args.callback_url is None else {"url": args.callback_url, "include_text": args.callback_text}
    structured = structured_outputs_from_args(args)
    if args.max_queue_depth is not None and args.max_queue_depth < 0:
        print("error: --max-queue-depth must be >= 0", file=sys.stderr)
        return 2
    async with connect_from_args(args, max_queue_depth=args.max_queue_depth) as client:
        try:
            handles = [
                await client.submit(
                    prompt,
                    request_id=rid,
                    model=args.model,
                    priority=args.priority,
                    tenant=args.tenant,
                    callback=callback,
                    structured_outputs=structured,
                    **affinity_kwargs(args),
                    **sampling,
                )
                for prompt, rid in zip(args.prompts, ids, strict=True)
            ]
        except StreamqError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2 if isinstance(exc, InvalidRequest) else 1
        for handle in handles:
            handle.cancel_on_close = True  # Ctrl-C: nobody will read the rest, stop generating it
        try:
            with ResponsePrinter(args.prompts, as_json=args.json) as printer:
                follows = (_print_events(h, p, printer) for h, p in zip(handles, args.prompts, strict=True))
                outcomes = await asyncio.gather(*follows)
        finally:
            for handle in handles:
                await handle.close()  # after Ctrl-C this cancels the unfinished requests
    return 0 if all(outcomes) else 1


async def run_follow(args: argparse.Namespace) -> int:
    async with connect_from_args(args) as client:
        handle = await client.follow(args.request_id, from_seq=args.from_seq)
        with ResponsePrinter([args.request_id], as_json=args.json) as printer:
            ok = await _print_events(handle, args.request_id, printer)
    return 0 if ok else 1


async def run_cancel(args: argparse.Namespace) -> int:
    async with connect_from_args(args) as client:
        outcome = await client.cancel(args.request_id)
    messages = {
        "running": "cancelling: the worker running it stops it",
        "queued": "cancelled before it ran",
        "unknown": "nothing to cancel: not queued or running (finished, or never submitted)",
    }
    print(f"{args.request_id}: {messages[outcome]}")
    return 0 if outcome != "unknown" else 1


def _run_until_interrupted(command: Coroutine[Any, Any, int]) -> int:
    try:
        return asyncio.run(command)
    except (RedisConnectionError, ConnectionError) as exc:  # Redis unreachable, or its TLS certificate refused
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


def submit_command(args: argparse.Namespace) -> int:
    return _run_until_interrupted(run_submit(args))


def follow_command(args: argparse.Namespace) -> int:
    return _run_until_interrupted(run_follow(args))


def cancel_command(args: argparse.Namespace) -> int:
    return _run_until_interrupted(run_cancel(args))


def with_default_subcommand(argv: Sequence[str]) -> list[str]:
    """``argv`` with ``submit`` in front unless it starts with a subcommand or asks for the
    overall help; a renamed subcommand's old name becomes its new one, with a warning."""
    if argv and (successor := RENAMED_SUBCOMMANDS.get(argv[0])) is not None:
        print(
            f"warning: '{argv[0]}' is now '{successor}'; the old name goes in a later release",
            file=sys.stderr,
        )
        return [successor, *argv[1:]]
    if argv and argv[0] in (*SUBCOMMANDS, "-h", "--help"):
        return list(argv)
    return [DEFAULT_SUBCOMMAND, *argv]


def _program_name() -> str:
    """``streamq`` when run as the console script, else how ``-m`` runs it."""
    name = Path(sys.argv[0]).name
    return name if name.startswith("streamq") else "python -m producer"


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser(_program_name())
    if not argv:
        parser.error("give one or more prompts, or a subcommand")
    args = parser.parse_args(with_default_subcommand(argv))
    run: Callable[[argparse.Namespace], int] = args.run
    return run(args)
