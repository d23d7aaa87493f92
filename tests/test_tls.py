"""``rediss://`` (TLS) end to end: producer → Redis over TLS → worker → subscriber.

Needs a Redis built with TLS: Debian's ``redis-server`` is (CI installs it); the
``valkey-server`` the project installs is not, so without Debian's this skips
locally and fails in CI. The worker runs the scripted engine: what is under test
is every Redis connection, not the model.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from devkit.redis_server import free_port
from devkit.worker_process import scripted_worker
from producer.client import StreamqClient


def make_certificates(directory: Path) -> None:
    """A throwaway CA and a server certificate for 127.0.0.1, signed by it."""

    def openssl(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=directory, check=True, capture_output=True)

    openssl(
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-days",
        "1",
        "-subj",
        "/CN=streamq test CA",
        "-keyout",
        "ca.key",
        "-out",
        "ca.pem",
    )
    openssl(
        "req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=127.0.0.1", "-keyout", "server.key", "-out", "server.csr"
    )
    (directory / "san.cnf").write_text("subjectAltName=IP:127.0.0.1\n")
    openssl(
        "x509",
        "-req",
        "-in",
        "server.csr",
        "-CA",
        "ca.pem",
        "-CAkey",
        "ca.key",
        "-CAcreateserial",
        "-days",
        "1",
        "-extfile",
        "san.cnf",
        "-out",
        "server.pem",
    )


def wait_until_serving(url: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    client = redis.Redis.from_url(url)
    try:
        while True:
            try:
                client.ping()
                return
            except redis.ConnectionError:
                assert time.monotonic() < deadline, "the TLS Redis did not start"
                time.sleep(0.05)
    finally:
        client.close()


@pytest.fixture
def tls_redis_url(tmp_path: Path) -> Iterator[str]:
    binary = shutil.which("redis-server")
    if binary is None:
        if os.environ.get("CI"):
            pytest.fail("redis-server (built with TLS) is not installed; .ci/run installs it")
        pytest.skip("no redis-server built with TLS")
    make_certificates(tmp_path)
    port = free_port()
    server = subprocess.Popen(
        [
            binary,
            "--port",
            "0",
            "--tls-port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--tls-cert-file",
            "server.pem",
            "--tls-key-file",
            "server.key",
            "--tls-ca-cert-file",
            "ca.pem",
            "--tls-auth-clients",
            "no",
            "--dir",
            str(tmp_path),
        ],
        cwd=tmp_path,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"rediss://127.0.0.1:{port}?ssl_ca_certs={tmp_path / 'ca.pem'}"
    try:
        wait_until_serving(url)
        yield url
    finally:
        server.terminate()
        server.wait(timeout=10)


async def test_requests_stream_over_tls(tls_redis_url: str, tmp_path: Path) -> None:
    worker = scripted_worker(tls_redis_url, tmp_path / "worker.log", tokens_per_s=1000)
    worker.start().wait_ready(timeout_s=120)
    try:
        async with await StreamqClient.connect(tls_redis_url) as client:
            completion = await (await client.submit("over TLS", max_tokens=12)).result()
        assert completion.completion_tokens == 12
        assert completion.finish_reasons == ["length"]
    finally:
        assert worker.stop() == 0, worker.log_tail()
