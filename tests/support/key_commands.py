"""API keys made as an operator makes them: ``python -m producer keys ...`` in a process."""

from __future__ import annotations

import subprocess
import sys
import uuid


def streamq_keys(redis_url: str, *args: str) -> subprocess.CompletedProcess[str]:
    """``python -m producer keys ...`` as an operator runs it."""
    command = [sys.executable, "-m", "producer", "keys", *args, "--redis-url", redis_url]
    return subprocess.run(command, capture_output=True, text=True, timeout=60)


def create_key(redis_url: str, *limits: str) -> tuple[str, str]:
    """A new stored key with ``limits``: its name and its secret."""
    name = f"team-{uuid.uuid4().hex[:8]}"
    created = streamq_keys(redis_url, "create", name, *limits)
    assert created.returncode == 0, created.stderr
    return name, created.stdout.strip()
