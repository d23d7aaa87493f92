"""``rediss://`` (TLS) end to end, and TLS that checks whom it talks to.

Requests stream producer → Redis over TLS → worker → subscriber; every component refuses
a server whose certificate does not name the host it connects to, and connects anyway
only when told to (``--tls-insecure``, ``?ssl_cert_reqs=none``), with a warning.

Needs a Redis built with TLS: Debian's ``redis-server`` is (CI installs it); the
``valkey-server`` the project installs is not, so without Debian's this skips
locally and fails in CI. The worker runs the scripted engine: what is under test
is every Redis connection, not the model.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis

from devkit.gateway_process import GatewayProcess
from devkit.redis_server import free_port
from devkit.worker_process import SCRIPTED_ENGINE, WorkerProcess, scripted_worker, worker_env
from producer.client import StreamqClient
from producer.errors import ConnectionFailed
from producer.internal_client import InternalClient
from streamq.broker.tls import TlsVerificationError

REFUSED = "the server's certificate was refused"
NOT_VERIFIED = "does not verify the server's certificate"


def make_certificates(directory: Path) -> None:
    """A throwaway CA and a server certificate for 127.0.0.1 (and no host name), signed by it."""

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


@dataclass(frozen=True)
class TlsRedis:
    """One Redis over TLS whose certificate names 127.0.0.1 only: reached as ``localhost``,
    the same server presents a certificate for another host."""

    port: int
    ca: Path

    @property
    def url(self) -> str:
        return f"rediss://127.0.0.1:{self.port}?ssl_ca_certs={self.ca}"

    @property
    def wrong_host_url(self) -> str:
        return f"rediss://localhost:{self.port}?ssl_ca_certs={self.ca}"


@pytest.fixture(scope="module")
def tls_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TlsRedis]:
    binary = shutil.which("redis-server")
    if binary is None:
        if os.environ.get("CI"):
            pytest.fail("redis-server (built with TLS) is not installed; .ci/run installs it")
        pytest.skip("no redis-server built with TLS")
    directory = tmp_path_factory.mktemp("tls")
    make_certificates(directory)
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
            str(directory),
        ],
        cwd=directory,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    tls = TlsRedis(port, directory / "ca.pem")
    try:
        wait_until_serving(tls.url)
        yield tls
    finally:
        server.terminate()
        server.wait(timeout=10)


@pytest.fixture(scope="module")
def tls_worker(tls_redis: TlsRedis, tmp_path_factory: pytest.TempPathFactory) -> Iterator[WorkerProcess]:
    """A worker that reaches Redis over verified TLS."""
    worker = scripted_worker(tls_redis.url, tmp_path_factory.mktemp("worker") / "worker.log", tokens_per_s=1000)
    worker.start().wait_ready(timeout_s=120)
    yield worker
    assert worker.stop() == 0, worker.log_tail()


async def test_requests_stream_over_tls(tls_worker: WorkerProcess, tls_redis: TlsRedis) -> None:
    async with await StreamqClient.connect(tls_redis.url) as client:
        completion = await (await client.submit("over TLS", max_tokens=12)).result()
    assert completion.completion_tokens == 12
    assert completion.finish_reasons == ["length"]
    assert NOT_VERIFIED not in tls_worker.log_tail(200)


@pytest.mark.parametrize(
    ("which", "reason"),
    [("wrong_host", "Hostname mismatch"), ("unknown_ca", "self.signed|local issuer")],
)
async def test_the_client_refuses_a_certificate_at_once(tls_redis: TlsRedis, which: str, reason: str) -> None:
    url = tls_redis.wrong_host_url if which == "wrong_host" else f"rediss://127.0.0.1:{tls_redis.port}"
    started = time.monotonic()
    with pytest.raises(ConnectionFailed, match=reason) as refused:
        await StreamqClient.connect(url)
    assert isinstance(refused.value.__cause__, TlsVerificationError), "the certificate's refusal is chained"
    assert REFUSED in str(refused.value)
    assert refused.value.url == url
    assert time.monotonic() - started < 5, "a refused certificate is not retried"


def test_every_command_refuses_a_certificate_for_another_host(tls_redis: TlsRedis, tmp_path: Path) -> None:
    url = tls_redis.wrong_host_url
    commands = {
        "producer": [sys.executable, "-m", "producer", "--redis-url", url, "hello"],
        "gateway": [sys.executable, "-m", "gateway", "--redis-url", url, "--port", str(free_port())],
        "worker": [sys.executable, "-m", "worker", "--redis-url", url, "--engine-factory", SCRIPTED_ENGINE],
    }
    runs = {
        name: subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=worker_env(), text=True)
        for name, command in commands.items()
    }
    for name, run in runs.items():
        output, _ = run.communicate(timeout=120)
        assert run.returncode != 0, f"{name} connected to a server whose certificate names another host:\n{output}"
        assert REFUSED in output and "Hostname mismatch" in output, f"{name}:\n{output}"


async def test_the_insecure_opt_out_connects_and_warns(
    tls_worker: WorkerProcess, tls_redis: TlsRedis, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    url = tls_redis.wrong_host_url
    with caplog.at_level(logging.WARNING, logger="streamq.tls"):
        async with await InternalClient.connect(url + "&ssl_check_hostname=false") as client:
            assert await client.redis.ping()
    assert "does not check the certificate's host name" in caplog.text

    producer = subprocess.run(
        [sys.executable, "-m", "producer", "--tls-insecure", "--redis-url", url, "--max-tokens", "4", "hello"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert producer.returncode == 0, producer.stderr
    assert NOT_VERIFIED in producer.stderr

    gateway = GatewayProcess(url, tmp_path / "gateway.log", "--tls-insecure").wait_ready()
    try:
        assert NOT_VERIFIED in gateway.log_tail()
    finally:
        assert gateway.stop() == 0, gateway.log_tail()

    # A queue of its own: the health check awaited is this worker's, not the module worker's.
    worker = scripted_worker(
        url, tmp_path / "worker.log", "--tls-insecure", ready_url=tls_redis.url, queue="streamq:tls-insecure"
    )
    worker.start().wait_ready(timeout_s=120)
    try:
        assert NOT_VERIFIED in worker.log_tail()
    finally:
        assert worker.stop() == 0, worker.log_tail()
