"""``python -m gateway`` as a real process, for the tests and the benchmark."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from devkit.redis_server import free_port
from devkit.worker_process import tail


class GatewayProcess:
    """One gateway on a loopback port (a free one unless given), stopped with SIGTERM."""

    def __init__(
        self,
        redis_url: str,
        log_path: Path,
        *extra_args: str,
        env: dict[str, str] | None = None,
        port: int | None = None,
    ) -> None:
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        command = [sys.executable, "-m", "gateway", "--redis-url", redis_url, "--port", str(self.port)]
        with open(log_path, "ab") as log:
            self.process = subprocess.Popen(
                [*command, *extra_args],
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, **(env or {})},
                start_new_session=True,  # a service of its own, as deployed
            )

    def wait_ready(self, timeout_s: float = 60) -> GatewayProcess:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"gateway did not come up:\n{self.log_tail()}")
            time.sleep(0.1)

    def stop(self) -> int:
        """SIGTERM; the exit code, 0 for a clean shutdown (uvicorn re-raises the signal
        after shutting down, so a clean exit shows as -SIGTERM)."""
        self.process.terminate()
        try:
            code = self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            return self.process.wait()
        return 0 if code == -signal.SIGTERM else code

    def log_tail(self, lines: int = 40) -> str:
        return tail(self.log_path, lines)
