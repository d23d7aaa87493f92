"""How streamq connects to Redis: one URL, riding out short outages.

Used by both sides so that a Redis restart or failover of a few seconds is a pause,
not a crash: every command is retried with exponential backoff (about 20 s in all)
before an error surfaces. ``rediss://`` URLs (TLS) may name their CA and
verification mode in the query: ``rediss://host:6380?ssl_ca_certs=/ca.pem``,
``&ssl_cert_reqs=none|optional|required``. A highly available Redis is reached
through its Sentinels: ``redis+sentinel://[user:password@]host:26379,host2:26379/mymaster``
(the password is the master's; the path names the monitored master, ``mymaster`` if
absent), so workers and producers follow a failover on their own.
"""

from __future__ import annotations

import argparse
import os
from urllib.parse import parse_qs, unquote, urlparse

from arq.connections import RedisSettings
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from producer.protocol import DEFAULT_QUEUE

DEFAULT_REDIS_URL = "redis://localhost:6379"
SENTINEL_SCHEME = "redis+sentinel"
DEFAULT_SENTINEL_PORT = 26379


def add_connection_options(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """``--redis-url`` and ``--queue``, defaulting to ``$REDIS_URL`` and ``$STREAMQ_QUEUE``:
    the same spelling and environment on both sides of the queue."""
    add_redis_url_option(parser)
    parser.add_argument(
        "--queue",
        default=os.environ.get("STREAMQ_QUEUE", DEFAULT_QUEUE),
        help="the queue (default: $STREAMQ_QUEUE or %(default)s)",
    )


def add_redis_url_option(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """``--redis-url``, defaulting to ``$REDIS_URL``: every command that reaches Redis."""
    parser.add_argument(
        "--redis-url",
        default=os.environ.get("REDIS_URL", DEFAULT_REDIS_URL),
        help="Redis of the streamq deployment (default: $REDIS_URL or %(default)s)",
    )


def redis_settings_for(url: str = DEFAULT_REDIS_URL) -> RedisSettings:
    """arq ``RedisSettings`` for ``url``, with retries on connection errors."""
    if url.startswith(SENTINEL_SCHEME + "://"):
        return _sentinel_settings(url)
    settings = RedisSettings.from_dsn(url)
    query = parse_qs(urlparse(url).query)
    if "ssl_ca_certs" in query:
        settings.ssl_ca_certs = query["ssl_ca_certs"][0]
    if "ssl_cert_reqs" in query:
        settings.ssl_cert_reqs = query["ssl_cert_reqs"][0]
    settings.retry = Retry(ExponentialBackoff(cap=2.0, base=0.1), retries=12)
    settings.retry_on_error = [RedisConnectionError, RedisTimeoutError, ConnectionResetError]
    settings.retry_on_timeout = True
    settings.conn_retries = 20  # at start-up: Redis may come up after the worker
    return settings


def _sentinel_settings(url: str) -> RedisSettings:
    """``redis+sentinel://[user:password@]host[:port],host2[:port]/master``."""
    rest = url.removeprefix(SENTINEL_SCHEME + "://")
    netloc, _, path = rest.partition("/")
    credentials, _, hosts = netloc.rpartition("@")
    username, _, password = credentials.partition(":")
    sentinels: list[tuple[str, int]] = []
    for address in hosts.split(","):
        host, _, port = address.partition(":")
        if not host:
            raise ValueError(f"{url!r}: a Sentinel address is empty")
        sentinels.append((host, int(port) if port else DEFAULT_SENTINEL_PORT))
    return RedisSettings(
        host=sentinels,
        sentinel=True,
        sentinel_master=unquote(path.strip("/")) or "mymaster",
        username=unquote(username) or None,
        password=unquote(password) or None,
        conn_retries=20,
    )
