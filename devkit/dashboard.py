"""``make dashboard``: the live dashboard on a running queue, until Ctrl-C.

A throwaway Redis (unless ``$REDIS_URL`` is set), one worker on the demo's model (see
``devkit.demo``), and a gateway on port 8000 (``$STREAMQ_DASHBOARD_PORT``; a free port
when that one is taken) serving ``/dashboard``. Ctrl-C stops the gateway, the worker and
Redis, in that order (and so does SIGTERM or SIGHUP).
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import sys
import time
import webbrowser
from pathlib import Path

from devkit.demo import choose_engine_flags, redis_url_or_throwaway
from devkit.gateway_process import GatewayProcess
from devkit.redis_server import free_port
from devkit.worker_process import WorkerProcess
from streamq.env_vars import DASHBOARD_PORT_ENV

DEFAULT_PORT = 8000
LOGS = Path(".cache")


def choose_port() -> int:
    """``$STREAMQ_DASHBOARD_PORT`` or 8000, unless something listens there: then a free one."""
    wanted = int(os.environ.get(DASHBOARD_PORT_ENV) or DEFAULT_PORT)
    with socket.socket() as probe:
        try:
            probe.bind(("127.0.0.1", wanted))
        except OSError:
            port = free_port()
            print(f"dashboard: port {wanted} is taken; using {port}", flush=True)
            return port
    return wanted


def open_browser(url: str) -> None:
    """Open ``url`` where a graphical browser can be (never a text one in this terminal)."""
    if os.environ.get("DISPLAY") or os.environ.get("WAYLAND_DISPLAY") or sys.platform in ("darwin", "win32"):
        with contextlib.suppress(Exception):
            webbrowser.open(url)


def serve(redis_url: str) -> int:
    LOGS.mkdir(parents=True, exist_ok=True)
    gateway = GatewayProcess(redis_url, LOGS / "dashboard-gateway.log", port=choose_port())
    worker: WorkerProcess | None = None
    try:
        gateway.wait_ready()
        url = f"{gateway.url}/dashboard"
        print(f"dashboard: {url}", flush=True)
        open_browser(url)
        flags, env = choose_engine_flags(say="dashboard")
        worker_log = LOGS / "dashboard-worker.log"
        worker_log.write_text("")
        worker = WorkerProcess(redis_url, flags, log_path=worker_log, env=env)
        print(f"dashboard: starting a worker (log: {worker_log}) ...", flush=True)
        worker.start().wait_ready()
        print(f"dashboard: worker ready; try the Playground at {url}. Ctrl-C stops everything.", flush=True)
        while True:
            for name, process in (("gateway", gateway.process), ("worker", worker.process)):
                if process is not None and process.poll() is not None:
                    print(f"dashboard: the {name} exited with {process.returncode}; stopping", flush=True)
                    return 1
            time.sleep(0.5)
    except KeyboardInterrupt:
        print("\ndashboard: stopping", flush=True)
        return 0
    finally:
        # A second Ctrl-C must not leave processes behind while these stop.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        print(f"dashboard: gateway stopped (exit code {gateway.stop()})", flush=True)
        if worker is not None:
            print(f"dashboard: worker stopped (exit code {worker.stop()})", flush=True)


def _stop_as_ctrl_c(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def main() -> int:
    # Stopped by a service manager, or its terminal closed: clean up as for Ctrl-C (the
    # worker and gateway run in sessions of their own, so nothing else stops them).
    signal.signal(signal.SIGTERM, _stop_as_ctrl_c)
    signal.signal(signal.SIGHUP, _stop_as_ctrl_c)
    with contextlib.ExitStack() as stack:
        return serve(redis_url_or_throwaway(stack, say="dashboard"))


if __name__ == "__main__":
    sys.exit(main())
