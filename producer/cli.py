"""``python -m producer``: enqueue prompts and print their tokens as they arrive.

    python -m producer "The key to happiness is" "In a galaxy far, far away"
    python -m producer --json --max-tokens 32 "Hello"
    python -m producer tail REQUEST_ID
    python -m producer cancel REQUEST_ID
    python -m producer batch IN.jsonl OUT.jsonl   # OpenAI batch files; see producer/batch.py

Exit status: 0 when every request finished, 1 when any failed (errors on stderr),
2 for bad command-line arguments.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Sequence

from rich.console import Console, Group
from rich.live import Live
from rich.text import Text

from producer.client import RequestError, RequestHandle, StreamqClient, StreamqError
from streamq.broker.connection import add_connection_options
from streamq.protocol import (
    ChunkEvent,
    ErrorEvent,
    FinalEvent,
    InvalidRequest,
    encode_event,
    is_valid_request_id,
)


def _common_options(parser: argparse.ArgumentParser) -> None:
    add_connection_options(parser)
    parser.add_argument("--json", action="store_true", help="print the raw events as JSON lines")


def submit_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m producer",
        description="Enqueue prompts to streamq and stream their responses (Ctrl-C cancels them). "
        "Subcommands: 'tail REQUEST_ID' follows a request already submitted, "
        "'cancel REQUEST_ID' cancels one, 'batch IN.jsonl OUT.jsonl' runs an OpenAI batch file.",
    )
    parser.add_argument("prompts", nargs="+", metavar="PROMPT", help="one job is enqueued per prompt")
    _common_options(parser)
    parser.add_argument(
        "--max-tokens", type=int, default=64, help="tokens to generate per prompt (default: %(default)s)"
    )
    parser.add_argument("--temperature", type=float, default=None, help="sampling temperature (default: vLLM's, 1.0)")
    parser.add_argument("--top-p", type=float, default=None)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument(
        "--request-id", action="append", default=None, help="request id of each prompt, in order (default: random ids)"
    )
    parser.add_argument(
        "--model", default=None, help="send to the queue of the live workers serving this model (default: --queue)"
    )
    parser.add_argument(
        "--max-queue-depth",
        type=int,
        default=None,
        help="fail instead of enqueueing when the queue already holds this many jobs (default: no limit)",
    )
    return parser


def tail_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m producer tail",
        description="Print a request's events from its replay log, then live ones until it ends.",
    )
    parser.add_argument("request_id")
    parser.add_argument("--from-seq", type=int, default=0, help="first event to print (default: %(default)s)")
    _common_options(parser)
    return parser


def cancel_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m producer cancel",
        description="Cancel a request: a running one wherever it runs, a queued one on any model's queue "
        "(--queue is looked at first; it need not be given).",
    )
    parser.add_argument("request_id")
    _common_options(parser)
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

    def show(self, label: str, raw_json: str, event: ChunkEvent | FinalEvent | ErrorEvent) -> None:
        if self.as_json:
            sys.stdout.write(raw_json + "\n")
            sys.stdout.flush()
            return
        if isinstance(event, ChunkEvent):
            self.texts[label].append(event.text)
            if self._live is None:  # one prompt: stream straight to stdout, as the seed does
                sys.stdout.write(event.text)
                sys.stdout.flush()
        elif isinstance(event, FinalEvent) and self._live is not None:
            self.texts[label].append(f"  [{','.join(map(str, event.finish_reasons))}]", style="dim")


async def _follow(handle: RequestHandle, label: str, printer: ResponsePrinter) -> bool:
    """Print one request's events; True if it finished, False if it failed."""
    try:
        async for event in handle:
            printer.show(label, encode_event(event).decode(), event)
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
    sampling = {k: v for k, v in sampling.items() if v is not None}
    ids = args.request_id or [None] * len(args.prompts)
    if args.max_queue_depth is not None and args.max_queue_depth < 0:
        print("error: --max-queue-depth must be >= 0", file=sys.stderr)
        return 2
    async with await StreamqClient.connect(
        args.redis_url, queue=args.queue, max_queue_depth=args.max_queue_depth
    ) as client:
        try:
            handles = [
                await client.submit(prompt, request_id=rid, model=args.model, **sampling)
                for prompt, rid in zip(args.prompts, ids, strict=True)
            ]
        except (InvalidRequest, StreamqError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2 if isinstance(exc, InvalidRequest) else 1
        for handle in handles:
            handle.cancel_on_close = True  # Ctrl-C: nobody will read the rest, stop generating it
        try:
            with ResponsePrinter(args.prompts, as_json=args.json) as printer:
                follows = (_follow(h, p, printer) for h, p in zip(handles, args.prompts, strict=True))
                outcomes = await asyncio.gather(*follows)
        finally:
            for handle in handles:
                await handle.close()  # after Ctrl-C this cancels the unfinished requests
    return 0 if all(outcomes) else 1


async def run_tail(args: argparse.Namespace) -> int:
    if not is_valid_request_id(args.request_id):
        print(f"error: {args.request_id!r} is not a valid request id", file=sys.stderr)
        return 2
    async with await StreamqClient.connect(args.redis_url, queue=args.queue) as client:
        handle = await client.follow(args.request_id, from_seq=args.from_seq)
        with ResponsePrinter([args.request_id], as_json=args.json) as printer:
            ok = await _follow(handle, args.request_id, printer)
    return 0 if ok else 1


async def run_cancel(args: argparse.Namespace) -> int:
    if not is_valid_request_id(args.request_id):
        print(f"error: {args.request_id!r} is not a valid request id", file=sys.stderr)
        return 2
    async with await StreamqClient.connect(args.redis_url, queue=args.queue) as client:
        outcome = await client.cancel(args.request_id)
    messages = {
        "running": "cancelling: the worker running it stops it",
        "queued": "cancelled before it ran",
        "unknown": "nothing to cancel: not queued or running (finished, or never submitted)",
    }
    print(f"{args.request_id}: {messages[outcome]}")
    return 0 if outcome != "unknown" else 1


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["batch"]:
        from producer.batch import main as batch_main  # its own exit statuses and Ctrl-C handling

        return batch_main(argv[1:])
    try:
        if argv[:1] == ["tail"]:
            return asyncio.run(run_tail(tail_parser().parse_args(argv[1:])))
        if argv[:1] == ["cancel"]:
            return asyncio.run(run_cancel(cancel_parser().parse_args(argv[1:])))
        return asyncio.run(run_submit(submit_parser().parse_args(argv)))
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
