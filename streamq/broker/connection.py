"""How streamq connects to Redis: one URL of any kind, riding out short outages.

Every URL kind (``redis://``, ``rediss://``, ``unix://``, ``redis+sentinel://``) gets the
same settings: commands retried for ``RETRY_FOR_S``, replies due within
``SOCKET_TIMEOUT_S``, idle connections pinged before use, TCP keepalive. Pub/sub readers,
which wait for as long as there are no messages, ping on their own (``streamq.broker.pubsub``).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import time
from collections.abc import Awaitable, Callable
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any, Final, TypeVar
from urllib.parse import unquote

from arq.connections import ArqRedis, RedisSettings
from arq.constants import default_queue_name, expires_extra_ms
from arq.jobs import Deserializer, Serializer
from redis.asyncio.retry import Retry
from redis.asyncio.sentinel import (
    Sentinel,
    SentinelConnectionPool,
    SentinelManagedConnection,
    SentinelManagedSSLConnection,
)
from redis.backoff import ExponentialBackoff, NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from streamq.broker.tls import apply_tls_query, certificate_refusal, insecure_url, refusal_error
from streamq.env_vars import EVENTS_REDIS_URL_ENV, QUEUE_ENV, REDIS_URL_ENV
from streamq.environment import check_events_url, queue_from_env, redis_url_from_env
from streamq.protocol import DEFAULT_REDIS_URL as DEFAULT_REDIS_URL  # re-exported: the default URL of every command
from streamq.protocol import REQUEST_ID_PATTERN, is_valid_request_id
from streamq.redaction import MASK, redact_url

SENTINEL_SCHEME = "redis+sentinel"
DEFAULT_SENTINEL_PORT = 26379

RETRY_FOR_S = 20.0
"""How long a failing command is retried (a restart, a failover) before its error surfaces."""
CONNECT_TIMEOUT_S = 5.0
"""A TCP connect (or TLS handshake) that takes longer failed."""
SOCKET_TIMEOUT_S = 10.0
"""A reply that takes longer means a dead connection. streamq sends no long script, and Redis
itself answers BUSY after 5 s of script; its one blocking command, an end's ``WAIT`` (and
``WAITAOF``) for its replicas, is bounded below this (``--durable-ends-timeout-s``); pub/sub
readers never wait on the socket longer than this (they wait in steps and ping)."""
HEALTH_CHECK_INTERVAL_S = 5.0
"""A pooled connection idle this long is pinged before its next command; a pub/sub
connection silent this long is pinged by its reader."""
KEEPALIVE_OPTIONS = {
    option: value
    for option, value in (("TCP_KEEPIDLE", 30), ("TCP_KEEPINTVL", 10), ("TCP_KEEPCNT", 3))
    if hasattr(socket, option)
}
"""TCP keepalive: an idle socket whose peer vanished dies within about a minute, not two hours."""
STARTUP_ATTEMPTS = 3
"""At start-up, connection attempts (each retried for ``RETRY_FOR_S``): Redis may come up
after the worker; a wrong URL fails within about a minute."""

_T = TypeVar("_T")


_retry_deadline: ContextVar[float | None] = ContextVar("streamq_retry_deadline", default=None)
"""The deadline of the outermost retrying call in progress in this task."""


class RetryFor(Retry):
    """redis-py's ``Retry`` bounded by time instead of a count.

    redis-py nests retries: connecting retries inside a command's retry, and a fresh
    connection's health-check PING inside the connect, so against a Redis that accepts
    connections but never answers (paused, or stuck) counts multiply without bound. All
    nested calls here share the outermost call's deadline."""

    __slots__ = ("_budget_s",)

    def __init__(self, budget_s: float = RETRY_FOR_S) -> None:
        super().__init__(ExponentialBackoff(cap=2.0, base=0.1), retries=-1)
        self._budget_s = budget_s

    async def call_with_retry(self, do: Callable[[], Awaitable[_T]], fail: Callable[[RedisError], Any]) -> _T:
        deadline = time.monotonic() + self._budget_s
        outer = _retry_deadline.get()
        if outer is not None:
            deadline = min(deadline, outer)
        token = _retry_deadline.set(deadline)
        try:
            failures = 0
            while True:
                try:
                    return await do()
                except self._supported_errors as error:
                    failures += 1
                    await fail(error)
                    if certificate_refusal(error) is not None:
                        raise  # a refused certificate stays refused
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise error
                    await asyncio.sleep(min(self._backoff.compute(failures), left))
        finally:
            _retry_deadline.reset(token)


async def _connect_once(connection: SentinelManagedConnection, address: tuple[str, int]) -> None:
    """Connect ``connection`` to ``address`` in one attempt: the retry around it asks the
    Sentinels again before the next. redis-py retries the address it was handed inside
    that retry, under the same budget, so a connection made as the master died went on
    trying the dead master for the whole ``RETRY_FOR_S`` (20 s) while the Sentinels had
    promoted its replica within about 2."""
    retry = connection.retry
    connection.retry = Retry(NoBackoff(), 0)
    try:
        await SentinelManagedConnection.connect_to(connection, address)
    finally:
        connection.retry = retry


class SentinelFollowingConnection(SentinelManagedConnection):
    """A connection to the master the Sentinels name, asked again at every attempt."""

    async def connect_to(self, address: tuple[str, int]) -> None:
        await _connect_once(self, address)


class SentinelFollowingSSLConnection(SentinelManagedSSLConnection):
    """The same over TLS."""

    async def connect_to(self, address: tuple[str, int]) -> None:
        await _connect_once(self, address)


class SentinelFollowingPool(SentinelConnectionPool):
    """redis-py's pool of Sentinel-managed connections, of the classes above."""

    def __init__(self, service_name: str, sentinel_manager: Sentinel, **kwargs: Any) -> None:
        tls = kwargs.pop("ssl", False)
        kwargs["connection_class"] = SentinelFollowingSSLConnection if tls else SentinelFollowingConnection
        super().__init__(service_name, sentinel_manager, **kwargs)


@dataclass(repr=False)
class StreamqRedisSettings(RedisSettings):
    """arq's ``RedisSettings`` plus the socket options arq does not pass to redis-py
    (it passes none at all to Sentinel-managed connections); ``create_pool`` passes all.
    Its ``repr`` masks the password."""

    socket_timeout: float | None = SOCKET_TIMEOUT_S
    socket_keepalive: bool = True
    socket_keepalive_options: dict[int, int] = field(
        default_factory=lambda: {getattr(socket, name): value for name, value in KEEPALIVE_OPTIONS.items()}
    )
    health_check_interval: float = HEALTH_CHECK_INTERVAL_S

    def __repr__(self) -> str:
        shown = {name: MASK if name == "password" and value else value for name, value in vars(self).items()}
        return f"{type(self).__name__}({', '.join(f'{name}={value!r}' for name, value in shown.items())})"


def request_id_argument(value: str) -> str:
    """An argparse ``type`` for a request id: a bad one is a usage error (exit 2) before
    any connection is made."""
    if not is_valid_request_id(value):
        raise argparse.ArgumentTypeError(
            f"{value!r} is not a valid request id (it must match {REQUEST_ID_PATTERN.pattern})"
        )
    return value


def add_connection_options(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """``--redis-url`` and ``--queue``, defaulting to ``$REDIS_URL`` and ``$STREAMQ_QUEUE``:
    the same spelling and environment on both sides of the queue."""
    add_redis_url_option(parser)
    parser.add_argument(
        "--queue",
        default=queue_from_env(),
        help=f"the queue (default: ${QUEUE_ENV} or %(default)s)",
    )


def add_redis_url_option(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """``--redis-url``, defaulting to ``$REDIS_URL``, and ``--tls-insecure``: every command that
    reaches Redis. Read them back with ``redis_url_from_args``."""
    parser.add_argument(
        "--redis-url",
        default=redis_url_from_env(),
        help=f"Redis of the streamq deployment (default: ${REDIS_URL_ENV} or %(default)s)",
    )
    parser.add_argument(
        "--events-redis-url",
        type=_events_url,
        default=os.environ.get(EVENTS_REDIS_URL_ENV),
        help=f"a Redis Cluster for the data plane (each request's events), redis+cluster://host:port[,host:port...] "
        f"(default: ${EVENTS_REDIS_URL_ENV}, else the Redis of --redis-url carries them too)",
    )
    parser.add_argument(
        "--tls-insecure",
        action="store_true",
        help="for rediss:// URLs: do not verify the server's certificate nor its host name, as "
        "?ssl_cert_reqs=none in the URL does (logged as a warning; anyone on the path can then pose as Redis)",
    )


def redis_url_from_args(args: argparse.Namespace) -> str:
    """The URL that ``add_redis_url_option``'s options name."""
    url: str = args.redis_url
    return insecure_url(url) if getattr(args, "tls_insecure", False) else url


def _events_url(value: str) -> str | None:
    """argparse's check of ``--events-redis-url`` (and of its default, the environment's)."""
    try:
        return check_events_url(value)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def events_url_from_args(args: argparse.Namespace) -> str | None:
    """The data plane's URL that ``add_redis_url_option``'s options name (``None``: the
    control plane's Redis carries it); ``ValueError`` for a URL that is not a cluster's."""
    url = check_events_url(getattr(args, "events_redis_url", None))
    return insecure_url(url) if url is not None and getattr(args, "tls_insecure", False) else url


def redis_settings_for(url: str = DEFAULT_REDIS_URL) -> StreamqRedisSettings:
    """Settings for ``url``, with the timeouts and retries above.

    ``rediss://`` (TLS) verifies the server's certificate and host name; the query may name
    the CA, a client certificate, or (logged as a warning) less checking:
    ``rediss://host:6380?ssl_ca_certs=/ca.pem&ssl_cert_reqs=none&ssl_check_hostname=false``
    (``streamq.broker.tls``).
    ``redis+sentinel://[user:password@]host:26379,host2:26379/mymaster`` reaches the
    master that the Sentinels name, and follows its failovers (the password is the
    master's; the path names the monitored master, ``mymaster`` if absent)."""
    if url.startswith(SENTINEL_SCHEME + "://"):
        settings = _sentinel_settings(url)
    else:
        base = RedisSettings.from_dsn(url)
        settings = StreamqRedisSettings(**vars(base))
        apply_tls_query(settings, url)
    settings.retry = RetryFor(RETRY_FOR_S)
    # OSError: a refused or reset connection while Redis restarts is raised as it is.
    settings.retry_on_error = [RedisConnectionError, RedisTimeoutError, OSError]
    settings.retry_on_timeout = True
    settings.conn_timeout = CONNECT_TIMEOUT_S  # type: ignore[assignment]  # arq says int; redis-py takes float
    settings.conn_retries = STARTUP_ATTEMPTS
    return settings


def _sentinel_settings(url: str) -> StreamqRedisSettings:
    """``redis+sentinel://[user:password@]host[:port],host2[:port]/master``."""
    rest = url.removeprefix(SENTINEL_SCHEME + "://")
    netloc, _, path = rest.partition("/")
    credentials, _, hosts = netloc.rpartition("@")
    username, _, password = credentials.partition(":")
    sentinels: list[tuple[str, int]] = []
    for address in hosts.split(","):
        host, _, port = address.partition(":")
        if not host:
            raise ValueError(f"{redact_url(url)!r}: a Sentinel address is empty")
        sentinels.append((host, int(port) if port else DEFAULT_SENTINEL_PORT))
    return StreamqRedisSettings(
        host=sentinels,
        sentinel=True,
        sentinel_master=unquote(path.strip("/")) or "mymaster",
        username=unquote(username) or None,
        password=unquote(password) or None,
    )


_ADDRESS_SETTINGS: Final = (
    "host",
    "port",
    "unix_socket_path",
    "ssl",
    "ssl_keyfile",
    "ssl_certfile",
    "ssl_cert_reqs",
    "ssl_ca_certs",
    "ssl_ca_data",
    "ssl_check_hostname",
)
"""``RedisSettings`` fields that say where the data is and how to reach it, passed on as they are."""


def connection_options(settings: RedisSettings) -> dict[str, Any]:
    """Keyword arguments for every redis-py connection to the data (not the Sentinels)."""
    options: dict[str, Any] = {
        "db": settings.database,
        "username": settings.username,
        "password": settings.password,
        "encoding": "utf8",
        "socket_connect_timeout": settings.conn_timeout,
        "retry": settings.retry,
        "retry_on_timeout": settings.retry_on_timeout,
        "retry_on_error": list(settings.retry_on_error or ()),  # redis-py appends to it
        "max_connections": settings.max_connections,
    }
    if isinstance(settings, StreamqRedisSettings):
        options |= {
            "socket_timeout": settings.socket_timeout,
            "socket_keepalive": settings.socket_keepalive,
            "socket_keepalive_options": settings.socket_keepalive_options,
            "health_check_interval": settings.health_check_interval,
        }
    return options


def redis_client(settings: RedisSettings) -> ArqRedis:
    """A client for ``settings``, not connected yet, whose every connection gets the
    options of ``connection_options``: to a TCP or TLS host, a Unix socket, or the master
    that the Sentinels name."""
    options = connection_options(settings)
    if settings.sentinel:
        assert not isinstance(settings.host, str), "Sentinel settings list the Sentinels"
        # The Sentinels get the same timeouts, keepalive and health checks: a dead Sentinel
        # must not stall the search for the master. Not the retries: the search moves on
        # to the next Sentinel at the first failure, and the master's connection retries
        # the whole search.
        sentinel_options = {k: v for k, v in options.items() if k.startswith("socket_") or k == "health_check_interval"}
        manager = Sentinel(settings.host, sentinel_kwargs=sentinel_options, ssl=settings.ssl, **options)
        return manager.master_for(  # type: ignore[no-any-return]
            settings.sentinel_master, redis_class=ArqRedis, connection_pool_class=SentinelFollowingPool
        )
    address = {name: getattr(settings, name) for name in _ADDRESS_SETTINGS}
    client = ArqRedis(**address, **options)
    if settings.unix_socket_path:
        # redis-py passes no connect timeout to Unix sockets (it would use the reply timeout).
        client.connection_pool.connection_kwargs["socket_connect_timeout"] = options["socket_connect_timeout"]
    return client


async def create_pool(
    settings: RedisSettings | None = None,
    *,
    job_serializer: Serializer | None = None,
    job_deserializer: Deserializer | None = None,
    default_queue_name: str = default_queue_name,
    expires_extra_ms: int = expires_extra_ms,
) -> ArqRedis:
    """arq's ``create_pool`` (same arguments, same start-up retries), except that every
    connection option reaches redis-py, for every URL kind: arq passes neither socket
    timeouts nor keepalive nor health checks, and to Sentinel-managed connections not
    even the retries."""
    settings = settings or redis_settings_for()
    attempt = 0
    while True:
        redis = redis_client(settings)
        redis.job_serializer = job_serializer
        redis.job_deserializer = job_deserializer
        redis.default_queue_name = default_queue_name
        redis.expires_extra_ms = expires_extra_ms
        try:
            await redis.ping()
            return redis
        except (TimeoutError, OSError, RedisError) as error:
            await close_pool(redis)
            refusal = certificate_refusal(error)
            if refusal is not None:
                raise refusal_error(settings, refusal) from error
            attempt += 1
            if attempt >= settings.conn_retries:
                raise
            await asyncio.sleep(settings.conn_retry_delay)


async def close_pool(redis: ArqRedis) -> None:
    """Close ``redis`` and, through Sentinel, the connections to the Sentinels too
    (closing the master's client leaves those open)."""
    await redis.aclose(close_connection_pool=True)
    for sentinel in getattr(getattr(redis.connection_pool, "sentinel_manager", None), "sentinels", ()):
        await sentinel.aclose()
