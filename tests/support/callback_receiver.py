"""A local HTTP endpoint for completion callbacks: records each POST (headers, body) and
answers with the statuses it is told, per path, in order (then 200)."""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

CALLBACK_SECRET = "test-callback-secret"
"""The secret the tests' workers sign callbacks with (``$STREAMQ_CALLBACK_SECRET``)."""


@dataclass(frozen=True)
class Delivery:
    path: str
    headers: dict[str, str]
    body: bytes


class CallbackReceiver:
    """``with CallbackReceiver() as receiver``: ``receiver.url(path)`` to give requests,
    ``receiver.answer(path, 500, 500)`` to fail the first tries, ``receiver.wait(path, n)``."""

    def __init__(self) -> None:
        self.deliveries: dict[str, list[Delivery]] = defaultdict(list)
        self._answers: dict[str, list[int]] = defaultdict(list)
        self._lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                with receiver._lock:
                    receiver.deliveries[self.path].append(Delivery(self.path, dict(self.headers.items()), body))
                    answers = receiver._answers[self.path]
                    status = answers.pop(0) if answers else 200
                self.send_response(status)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, format: str, *args: object) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def __enter__(self) -> CallbackReceiver:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}{path}"

    def answer(self, path: str, *statuses: int) -> None:
        """Answer the next POSTs to ``path`` with ``statuses``, then 200."""
        with self._lock:
            self._answers[path].extend(statuses)

    def received(self, path: str) -> list[Delivery]:
        with self._lock:
            return list(self.deliveries[path])

    def wait(self, path: str, count: int = 1, timeout_s: float = 90.0) -> list[Delivery]:
        deadline = time.monotonic() + timeout_s
        while len(self.received(path)) < count:
            if time.monotonic() > deadline:
                raise AssertionError(f"{path}: {len(self.received(path))} deliveries, expected {count}")
            time.sleep(0.05)
        return self.received(path)
