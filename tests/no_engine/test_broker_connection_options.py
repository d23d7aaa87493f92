"""Every Redis URL kind gets the same retry, timeouts, keepalive and health checks.

The clients are built but never connected: what is checked is what redis-py will use
for each connection it opens."""

from __future__ import annotations

import argparse
import asyncio
import logging
import socket
import ssl
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
    add_redis_url_option,
    redis_client,
    redis_settings_for,
    redis_url_from_args,
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
    assert options["ssl_check_hostname"] is False


def test_tls_verifies_the_certificate_and_host_name_by_default() -> None:
    options = data_connection_options("rediss://cache.example:6380")
    assert options["ssl_cert_reqs"] == "required"
    assert options["ssl_check_hostname"] is True


@pytest.mark.parametrize(
    ("query", "unchecked"),
    [("ssl_cert_reqs=none", "does not verify the server's certificate"), ("ssl_check_hostname=false", "host name")],
)
def test_turning_verification_off_is_logged(query: str, unchecked: str, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="streamq.tls"):
        redis_settings_for(f"rediss://warned-{len(query)}.example:6380?{query}")
    assert unchecked in caplog.text
    assert f"warned-{len(query)}.example:6380" in caplog.text


@pytest.mark.parametrize(
    "query", ["ssl_cert_reqs=maybe", "ssl_check_hostname=perhaps", "ssl_cert_reqs=none&ssl_check_hostname=true"]
)
def test_unclear_verification_settings_are_refused(query: str) -> None:
    with pytest.raises(ValueError, match="ssl_"):
        redis_settings_for(f"rediss://cache.example:6380?{query}")


def test_tls_insecure_option_turns_verification_off() -> None:
    parser = argparse.ArgumentParser()
    add_redis_url_option(parser)
    url = "rediss://cache.example:6380/2?ssl_ca_certs=/etc/ca.pem&ssl_check_hostname=true"
    checked = redis_url_from_args(parser.parse_args(["--redis-url", url]))
    insecure = redis_url_from_args(parser.parse_args(["--redis-url", url, "--tls-insecure"]))
    assert checked == url
    options = data_connection_options(insecure)
    assert (options["ssl_cert_reqs"], options["ssl_check_hostname"]) == ("none", False)
    assert (options["ssl_ca_certs"], options["db"]) == ("/etc/ca.pem", 2)


def test_a_refused_certificate_is_not_retried() -> None:
    refusal = ssl.SSLCertVerificationError(1, "certificate verify failed")
    attempts = 0

    async def connect() -> None:
        nonlocal attempts
        attempts += 1
        try:
            raise refusal
        except ssl.SSLError as error:
            raise RedisConnectionError("Error connecting") from error

    async def ignore(error: Exception) -> None:
        pass

    with pytest.raises(RedisConnectionError):
        asyncio.run(RetryFor(5.0).call_with_retry(connect, ignore))
    assert attempts == 1


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
