"""``python -m producer batch IN.jsonl OUT.jsonl``: OpenAI batch files through the queue.

Reads what ``vllm run-batch`` reads (``{"custom_id", "method", "url", "body"}`` a line)
and appends its output lines as each request finishes; a re-run skips every ``custom_id``
the output holds. A malformed line becomes an error line and the batch goes on.

The file is read as room frees, never whole: memory holds the requests in flight and the
``custom_id`` of each line read (to refuse duplicates and skip lines already done). By
default as many requests are in flight as keep every live worker's engine full
(``StreamqClient.generate_many``); none of them is streamed (``stream=False``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import sys
import uuid
from collections.abc import AsyncIterator, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from redis.exceptions import RedisError
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, ProgressColumn, Task, TextColumn, TimeElapsedColumn
from rich.text import Text

from producer import tenants_cli
from producer.affinity_args import add_affinity_arguments, affinity_kwargs
from producer.batch_line import parse_request_line
from producer.client import MIN_IN_FLIGHT, Completion, StreamqClient
from producer.connection_args import connect_from_args
from producer.errors import InvalidParameter, RedisFull, RequestError, StreamqError
from producer.openai_api.endpoints import ENDPOINTS, Endpoint
from producer.openai_api.errors import api_error_for
from producer.openai_api.limits import DEFAULT_LIMITS, RequestLimits, add_max_n_option
from producer.openai_api.pooling import PoolingCall
from producer.openai_api.requests import ResponseShape
from streamq.broker.connection import add_connection_options
from streamq.protocol import InvalidRequest
from streamq.protocol.affinity import check_affinity_key

_LINE_KEY = re.compile(r"line (\d+): ")
"""Error lines of input lines without a custom_id start with their line number, so a
re-run can tell they were already reported."""


BATCH_DESCRIPTION = (
    "Run an OpenAI batch file (as `vllm run-batch` reads) through streamq. Results are "
    "appended to OUTPUT as they finish; a re-run skips the custom_ids OUTPUT already holds."
)


def add_batch_arguments(parser: argparse.ArgumentParser) -> None:
    """The batch command's arguments, added to ``parser`` (the ``batch`` subcommand's)."""
    parser.add_argument("input", type=Path, metavar="INPUT.jsonl")
    parser.add_argument("output", type=Path, metavar="OUTPUT.jsonl")
    parser.add_argument(
        "--max-in-flight",
        "--concurrency",
        dest="max_in_flight",
        type=int,
        default=None,
        metavar="N",
        help="at most N requests queued or running at once (default: twice the live workers' slots, so that "
        f"every engine stays full; at least {MIN_IN_FLIGHT})",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar (a summary line still ends)")
    parser.add_argument(
        "--priority",
        type=int,
        default=0,
        help="priority of the lines whose body sets none (lower runs sooner; default: %(default)s)",
    )
    parser.add_argument(
        "--tenant",
        type=tenants_cli.tenant_name,
        default=None,
        help="the batch's tenant, for fair share with other tenants (default: 'default')",
    )
    add_affinity_arguments(parser, scope="the lines whose body sets neither affinity_key nor affinity")
    add_max_n_option(parser)
    add_connection_options(parser)


@dataclass
class BatchLine:
    """One input line: either a request to run or the reason it cannot run."""

    key: str
    """``custom_id``, or ``line N`` for a line without one."""
    custom_id: str | None
    url: str = ""
    body: dict[str, Any] | None = None
    error: str | None = None


def read_batch(lines: Iterable[str]) -> Iterator[BatchLine]:
    """Parse the input file's lines (read one at a time); malformed ones come back with
    ``error`` set."""
    seen: set[str] = set()
    for number, raw in enumerate(lines, start=1):
        if not raw.strip():
            continue
        line = _parse_line(number, raw)
        if line.error is None and line.key in seen:
            # Reported under its line number: the custom_id's output line is the first one's.
            error = f"line {number}: duplicate custom_id {line.custom_id!r}: custom_ids must be unique in a batch"
            line = BatchLine(f"line {number}", None, error=error)
        seen.add(line.key)
        yield line


def _parse_line(number: int, raw: str) -> BatchLine:
    """The line's request, or its problem (``producer.batch_line``, as the gateway's Batch
    API checks it); a line without a string ``custom_id`` is keyed by its number."""
    where = f"line {number}"
    parsed = parse_request_line(raw, ENDPOINTS)
    if parsed.custom_id is None:
        assert parsed.problem is not None, "a line without a custom_id has a problem"
        return BatchLine(where, None, error=f"{where}: {parsed.problem.message}")
    line = BatchLine(parsed.custom_id, parsed.custom_id, url=parsed.url)
    if parsed.problem is not None:
        line.error = parsed.problem.message
    else:
        line.body = parsed.body
    return line


def done_keys(output: Path) -> set[str]:
    """Keys of the lines already in ``output``; a torn last line (a run killed while
    writing it) is cut off so that appending goes on from a whole line."""
    if not output.exists():
        return set()
    data = output.read_bytes()
    if data and not data.endswith(b"\n"):
        data = data[: data.rfind(b"\n") + 1]
        output.write_bytes(data)
    keys: set[str] = set()
    for raw in data.decode(errors="replace").splitlines():
        try:
            obj = json.loads(raw)
        except json.JSONDecodeError:
            continue
        if isinstance(obj, dict) and isinstance(obj.get("custom_id"), str):
            keys.add(obj["custom_id"])
        elif isinstance(obj, dict) and (match := _LINE_KEY.match(str(obj.get("error")))):
            keys.add(f"line {match.group(1)}")
    return keys


def output_line(
    custom_id: str | None, request_id: str, *, status: int, body: dict[str, Any] | None, error: str | None
) -> dict[str, Any]:
    """One output line, in ``vllm run-batch``'s shape."""
    return {
        "id": f"batch-{request_id}",
        "custom_id": custom_id,
        "response": {"status_code": status, "request_id": request_id, "body": body},
        "error": error,
    }


class _TokensPerSecond(ProgressColumn):
    """Completion tokens per second of the requests finished so far."""

    def render(self, task: Task) -> Text:
        elapsed = task.finished_time if task.finished else task.elapsed
        tokens = task.fields.get("tokens", 0)
        rate = tokens / elapsed if elapsed else 0.0
        return Text(f"{rate:,.0f} tok/s", style="progress.data.speed")


@dataclass(frozen=True)
class _Running:
    """What a line's output needs once its request ends."""

    custom_id: str | None
    endpoint: Endpoint
    model: str | None
    shape: ResponseShape | PoolingCall


STALL_CHECK_S = 5.0
"""How long a batch waits without a line answered before it says why."""


class BatchRun:
    """Runs the lines of one batch through ``generate_many``, writing each output line as
    its request ends."""

    def __init__(
        self,
        client: StreamqClient,
        out: TextIO,
        progress: Progress,
        task_id: Any,
        *,
        limits: RequestLimits = DEFAULT_LIMITS,
        priority: int = 0,
        tenant: str | None = None,
        affinity: dict[str, Any] | None = None,
        max_in_flight: int | None = None,
    ) -> None:
        self.client = client
        self.limits = limits
        self.priority, self.tenant = priority, tenant
        """A body's own ``priority`` wins over ``priority``; every line is ``tenant``'s."""
        self.affinity = affinity or {}
        """``submit``'s affinity arguments for a body that sets neither ``affinity_key``
        nor ``affinity`` (from ``--affinity-key``/``--no-affinity``)."""
        self.max_in_flight = max_in_flight
        self.out = out
        self.progress = progress
        self.task_id = task_id
        self.succeeded = 0
        self.failed = 0
        self.tokens = 0
        self._running: dict[str, _Running] = {}
        """Request id -> its line, while the request is in flight."""
        self.refused: RedisFull | None = None
        """Set when Redis refused an enqueue for want of memory: no more lines are read."""

    def write(self, line: dict[str, Any], *, ok: bool, tokens: int = 0) -> None:
        self.out.write(json.dumps(line, ensure_ascii=False) + "\n")
        self.out.flush()
        if ok:
            self.succeeded += 1
        else:
            self.failed += 1
        self.tokens += tokens
        self.progress.update(self.task_id, advance=1, tokens=self.tokens)

    async def run(self, lines: Iterable[BatchLine]) -> None:
        """Run ``lines``: each valid one a request, at most ``max_in_flight`` at once; a line
        that cannot run gets its error line at once. Returns once every line is answered.

        Raises ``RedisFull`` once the requests in flight have ended, when Redis refused an
        enqueue for want of memory: the lines after it are neither read nor answered (every
        one would be refused alike), so that a rerun, once memory is freed, does them."""
        results = self.client.generate_many(
            self._requests(lines), max_in_flight=self.max_in_flight, return_exceptions=True
        )
        watch = asyncio.create_task(self._say_why_it_waits(), name="batch-stall-watch")
        try:
            await self._collect(results)
        finally:
            watch.cancel()
        if self.refused is not None:
            raise self.refused

    async def _collect(self, results: AsyncIterator[Completion | StreamqError]) -> None:
        async for result in results:
            if isinstance(result, RedisFull):  # not enqueued: left to the rerun
                assert result.request_id is not None, "generate_many names the request of every error"
                self._running.pop(result.request_id)
                if self.refused is None:
                    self.refused = result
                    self.progress.console.print(
                        f"{result}. No more lines are sent; the {len(self._running)} requests in flight "
                        "finish, then the batch stops",
                        soft_wrap=True,
                    )
            elif isinstance(result, StreamqError):  # InvalidRequest too: this request only
                self._write_failure(result)
            else:
                self._write_completion(result)

    async def _say_why_it_waits(self) -> None:
        """While no line is answered for ``STALL_CHECK_S``, say why, once a reason: Redis
        full (the requests in flight cannot log their events, nor new ones be queued), or
        no worker alive to take them."""
        answered, said = -1, None
        while True:
            await asyncio.sleep(STALL_CHECK_S)
            if self.succeeded + self.failed != answered or not self._running:
                answered, said = self.succeeded + self.failed, None
                continue
            try:
                reason = await self.client.redis_full()
                if reason is not None:
                    reason += f"; the {len(self._running)} requests in flight wait until it takes writes again"
                elif not await self.client.live_models():
                    reason = (
                        f"no worker is alive; the {len(self._running)} requests in flight wait in the queue for one"
                    )
            except StreamqError:  # Redis away: the requests' own watchdogs say so
                continue
            if reason is not None and reason != said:
                self.progress.console.print(f"waiting: {reason}", soft_wrap=True)
            said = reason

    async def _requests(self, lines: Iterable[BatchLine]) -> AsyncIterator[dict[str, Any]]:
        """``generate_many``'s items: the arguments of each line that can run."""
        for line in lines:
            if self.refused is not None:
                return
            request_id = uuid.uuid4().hex
            try:
                kwargs = self._generate_kwargs(line)
            except StreamqError as exc:
                status = api_error_for(exc).status
                self.write(output_line(line.custom_id, request_id, status=status, body=None, error=str(exc)), ok=False)
                continue
            model = kwargs.get("model")
            endpoint = ENDPOINTS[line.url]
            assert line.body is not None, "a line that can run has a body"
            self._running[request_id] = _Running(line.custom_id, endpoint, model, endpoint.shape(line.body))
            yield {"request_id": request_id, **kwargs}

    def _generate_kwargs(self, line: BatchLine) -> dict[str, Any]:
        """``generate``'s arguments for ``line``; raises ``InvalidRequest`` for a line that cannot run."""
        return line_submit_kwargs(
            line, limits=self.limits, priority=self.priority, tenant=self.tenant, affinity=self.affinity
        )

    def _write_completion(self, completion: Completion) -> None:
        running = self._running.pop(completion.request_id)
        body = running.endpoint.to_response([completion], model=running.model or "streamq", shape=running.shape)
        line = output_line(running.custom_id, completion.request_id, status=200, body=body, error=None)
        self.write(line, ok=True, tokens=completion.completion_tokens)

    def _write_failure(self, exc: StreamqError) -> None:
        assert exc.request_id is not None, "generate_many names the request of every error"
        running = self._running.pop(exc.request_id)
        status = api_error_for(exc).status  # the status the gateway would answer with
        error = f"{exc.code}: {exc.message}" if isinstance(exc, RequestError) else str(exc)
        self.write(output_line(running.custom_id, exc.request_id, status=status, body=None, error=error), ok=False)


def line_submit_kwargs(
    line: BatchLine,
    *,
    limits: RequestLimits,
    priority: int,
    tenant: str | None,
    affinity: dict[str, Any],
) -> dict[str, Any]:
    """``submit``'s arguments for a batch line (the gateway's Batch API runs its lines with
    these too): ``priority`` where the body sets none, ``affinity`` where it sets neither
    ``affinity_key`` nor ``affinity``. Raises ``InvalidRequest`` (``InvalidParameter``) for
    a line that cannot run: that line's 400."""
    if line.error is not None or line.body is None:
        raise InvalidRequest(line.error or "no body")
    endpoint = ENDPOINTS[line.url]
    body = dict(line.body)
    model = body.get("model")
    callback = body.pop("callback", None)  # streamq's extension: POST the summary when it ends
    affinity = _body_affinity(body) or affinity  # streamq's extension too
    kwargs = {"priority": priority, **endpoint.to_submit_kwargs(body, limits=limits), **affinity}
    if model is not None and not isinstance(model, str):
        raise InvalidRequest(f"model must be a string, got {model!r}")
    # Routed by model, as the gateway does; a body without one goes to --queue.
    return {"model": model, "tenant": tenant, "callback": callback, **kwargs}


def _body_affinity(body: dict[str, Any]) -> dict[str, Any]:
    """Take ``affinity_key`` (a string) and ``affinity`` (a boolean) out of ``body`` (the
    OpenAI parser refuses fields it does not know) as ``submit``'s arguments; empty when
    the body sets neither, so that the command line's apply. A bad value is this line's
    400, as the library would refuse it."""
    kwargs: dict[str, Any] = {}
    if "affinity_key" in body:
        try:
            kwargs["affinity_key"] = check_affinity_key(body.pop("affinity_key"))
        except ValueError as exc:
            raise InvalidParameter(str(exc), param="affinity_key") from None
    if "affinity" in body:
        affinity = body.pop("affinity")
        if not isinstance(affinity, bool):
            raise InvalidParameter(f"affinity must be true or false, got {affinity!r}", param="affinity")
        kwargs["affinity"] = affinity
    return kwargs


async def run_batch(args: argparse.Namespace) -> int:
    if args.max_in_flight is not None and args.max_in_flight < 1:
        print("error: --max-in-flight must be at least 1", file=sys.stderr)
        return 2
    try:
        total = _count_lines(args.input)
    except OSError as exc:
        print(f"error: cannot read {args.input}: {exc}", file=sys.stderr)
        return 2
    done = done_keys(args.output)
    console = Console(stderr=True)
    if done:
        console.print(f"{len(done)} requests already in {args.output}; skipping them")
    progress = Progress(
        TextColumn("batch"),
        BarColumn(),
        MofNCompleteColumn(),
        _TokensPerSecond(),
        TimeElapsedColumn(),
        console=console,
        disable=args.no_progress,
    )
    skipped = 0

    def todo(lines: Iterable[BatchLine]) -> Iterator[BatchLine]:
        nonlocal skipped
        for line in lines:
            if line.key in done:
                skipped += 1
                progress.update(task_id, total=max(0, total - skipped))
            else:
                yield line

    async with connect_from_args(args) as client:
        with args.input.open(encoding="utf-8") as source, args.output.open("a", encoding="utf-8") as out, progress:
            task_id = progress.add_task("batch", total=total, tokens=0)
            run = BatchRun(
                client,
                out,
                progress,
                task_id,
                limits=RequestLimits(max_n=args.max_n),
                priority=args.priority,
                tenant=args.tenant,
                affinity=affinity_kwargs(args),
                max_in_flight=args.max_in_flight,
            )
            await run.run(todo(read_batch(source)))
    console.print(
        f"{run.succeeded} succeeded, {run.failed} failed, {skipped} skipped; "
        f"{run.tokens} completion tokens; results in {args.output}"
    )
    return 0 if run.failed == 0 else 1


def _count_lines(path: Path) -> int:
    """The lines of ``path`` that hold something: the progress bar's total (one pass over the
    file, a line at a time, before the run reads it again as room frees)."""
    count = 0
    with path.open("rb") as source:
        for raw in source:
            count += bool(raw.strip())
    return count


def main(args: argparse.Namespace) -> int:
    """Run the batch the parsed arguments name; its own exit statuses and Ctrl-C message."""
    try:
        return asyncio.run(run_batch(args))
    except RedisFull:
        print(
            "error: stopped, Redis being full: the output holds every line answered; run again to do the rest",
            file=sys.stderr,
        )
        return 1
    except (StreamqError, RedisError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted: finished requests are in the output; run again to do the rest", file=sys.stderr)
        return 130
