"""Every Redis URL kind gets the same retry, timeouts, keepalive and health checks.

The clients are built but never connected: what is checked is what redis-py will use
for each connection it opens."""

from __future__ import annotations

import socket
from typing import Any

import pytest
from redis.asyncio.sentinel import SentinelConnectionPool
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from streamq.broker.connection import (
    CONNECT_TIMEOUT_S,
    HEALTH_CHECK_INTERVAL_S,
    SOCKET_TIMEOUT_S,
    RetryFor,
    redis_client,
    redis_settings_for,
)

URLS = {
    "redis": "redis://localhost:6379/2",
    "rediss": "rediss://cache.example:6380?ssl_ca_certs=/etc/ca.pem&ssl_cert_reqs=none",
    "unix": "unix:///run/redis.sock",
    "sentinel": "redis+sentinel://app:s%40cret@s1.example:26379,s2.example/prod-master",
}
TCP_KINDS = ("redis", "rediss", "sentinel")


def data_connection_options(url: str) -> dict[str, Any]:
    """The keyword arguments each connection to the data (not to a Sentinel) is made with."""
    return dict(redis_client(redis_settings_for(url)).connection_pool.connection_kwargs)


@pytest.mark.parametrize("kind", list(URLS))
def test_every_url_kind_retries_and_times_out_alike(kind: str) -> None:
    options = data_connection_options(URLS[kind])
    assert isinstance(options["retry"], RetryFor)
    assert options["retry_on_timeout"] is True
    assert {RedisConnectionError, RedisTimeoutError, OSError} <= set(options["retry_on_error"])
    assert options["socket_timeout"] == SOCKET_TIMEOUT_S
    assert options["socket_connect_timeout"] == CONNECT_TIMEOUT_S
    assert options["health_check_interval"] == HEALTH_CHECK_INTERVAL_S


@pytest.mark.parametrize("kind", TCP_KINDS)
def test_tcp_connections_keep_alive(kind: str) -> None:
    options = data_connection_options(URLS[kind])
    assert options["socket_keepalive"] is True
    if hasattr(socket, "TCP_KEEPIDLE"):
        assert options["socket_keepalive_options"][socket.TCP_KEEPIDLE] <= 60


def test_plain_url_names_host_port_and_database() -> None:
    options = data_connection_options(URLS["redis"])
    assert (options["host"], options["port"], options["db"]) == ("localhost", 6379, 2)


def test_tls_url_carries_its_ca_and_verification_mode() -> None:
    options = data_connection_options(URLS["rediss"])
    assert (options["host"], options["port"]) == ("cache.example", 6380)
    assert options["ssl_ca_certs"] == "/etc/ca.pem"
    assert options["ssl_cert_reqs"] == "none"


def test_unix_url_names_the_socket() -> None:
    assert data_connection_options(URLS["unix"])["path"] == "/run/redis.sock"


def test_sentinel_url_names_sentinels_master_and_credentials() -> None:
    pool = redis_client(redis_settings_for(URLS["sentinel"])).connection_pool
    assert isinstance(pool, SentinelConnectionPool)
    assert pool.service_name == "prod-master"
    assert (pool.connection_kwargs["username"], pool.connection_kwargs["password"]) == ("app", "s@cret")
    addresses = [
        (s.connection_pool.connection_kwargs["host"], s.connection_pool.connection_kwargs["port"])
        for s in pool.sentinel_manager.sentinels
    ]
    assert addresses == [("s1.example", 26379), ("s2.example", 26379)]


def test_sentinel_master_defaults_to_mymaster() -> None:
    pool = redis_client(redis_settings_for("redis+sentinel://s1.example")).connection_pool
    assert isinstance(pool, SentinelConnectionPool)
    assert pool.service_name == "mymaster"


def test_the_sentinels_themselves_time_out_and_are_health_checked() -> None:
    pool = redis_client(redis_settings_for(URLS["sentinel"])).connection_pool
    assert isinstance(pool, SentinelConnectionPool)
    for sentinel in pool.sentinel_manager.sentinels:
        options = sentinel.connection_pool.connection_kwargs
        assert options["socket_timeout"] == SOCKET_TIMEOUT_S
        assert options["socket_connect_timeout"] == CONNECT_TIMEOUT_S
        assert options["socket_keepalive"] is True
        assert options["health_check_interval"] == HEALTH_CHECK_INTERVAL_S


def test_a_sentinel_url_without_an_address_is_refused() -> None:
    with pytest.raises(ValueError, match="Sentinel address is empty"):
        redis_settings_for("redis+sentinel://s1.example,/m")
