"""The ``status`` subcommand: where a request is (``StreamqClient.status``), as text or JSON.

Exit status 0 when the request is known, 1 when it is ``unknown``, 2 for a bad request id.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time

from redis.exceptions import ConnectionError as RedisConnectionError

from producer.connection_args import connect_from_args
from streamq.broker.connection import (
    add_connection_options,
    request_id_argument,
)
from streamq.protocol.status import RequestStatus, encode_status

STATUS_DESCRIPTION = (
    "Say where a request is: queued (its position among the waiting requests of its priority), "
    "running (on which worker, tokens so far), finished, failed or unknown; and its callback's delivery."
)


def add_status_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("request_id", type=request_id_argument)
    add_connection_options(parser)
    parser.add_argument("--json", action="store_true", help="print the status as one JSON object")


def describe(status: RequestStatus) -> str:
    """The status as a few lines for a person."""
    lines = [f"{status.request_id}: {status.state}"]
    if status.state == "queued":
        if status.run_at_ms is not None:
            lines.append(f"  deferred until {_when(status.run_at_ms)}")
        else:
            lines.append(f"  position {status.position} among priority {status.priority} on {status.queue}")
            lines.append(f"  waiting for {status.waited_s:.1f}s")
    elif status.state == "running":
        lines.append(f"  on worker {status.worker_id}, attempt {status.attempt}")
        lines.append(f"  {status.completion_tokens} tokens so far")
    elif status.state == "finished":
        reasons = ",".join(status.finish_reasons or ())
        lines.append(f"  finish reasons: {reasons}")
        lines.append(f"  {status.prompt_tokens} prompt + {status.completion_tokens} completion tokens")
    elif status.state == "failed":
        lines.append(f"  {status.error_code}: {status.error_message}")
    if status.ended_ms is not None:
        lines.append(f"  ended {_when(status.ended_ms)}")
    if status.callback is not None:
        callback = status.callback
        outcome = f"callback to {callback.url}: {callback.state} after {callback.attempts} tries"
        if callback.http_status is not None:
            outcome += f" (HTTP {callback.http_status})"
        if callback.last_error and callback.state != "delivered":
            outcome += f"; last error: {callback.last_error}"
        lines.append("  " + outcome)
    return "\n".join(lines)


def _when(ms: int) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(ms / 1000))


async def run_status(args: argparse.Namespace) -> int:
    async with connect_from_args(args) as client:
        status = await client.status(args.request_id)
    print(encode_status(status).decode() if args.json else describe(status))
    return 1 if status.state == "unknown" else 0


def main(args: argparse.Namespace) -> int:
    try:
        return asyncio.run(run_status(args))
    except (RedisConnectionError, ConnectionError) as exc:  # Redis unreachable, or its TLS certificate refused
        print(f"error: {exc}", file=sys.stderr)
        return 1
