"""The command line's way to a client: ``connect`` to what its connection options name."""

from __future__ import annotations

import argparse

from producer.client import Connecting, StreamqClient
from streamq.broker.connection import events_url_from_args, redis_url_from_args


def connect_from_args(args: argparse.Namespace, *, max_queue_depth: int | None = None) -> Connecting[StreamqClient]:
    """``StreamqClient.connect`` to the Redis (and events cluster) and queue that a command
    line's connection options name (``streamq.broker.connection.add_connection_options``)."""
    return StreamqClient.connect(
        redis_url_from_args(args),
        events_url=events_url_from_args(args),
        queue=args.queue,
        max_queue_depth=max_queue_depth,
    )
