"""streamq's worker: one vLLM AsyncLLM per process, fed by an arq queue.

``arq worker.WorkerSettings`` or ``python -m worker`` runs it. ``WorkerSettings`` is built
lazily, when arq asks for it: the environment is read then (``worker.settings.settings_from_env``),
not when the package is imported, and the pieces that do not need vLLM (the publisher) can be
imported without loading it.
"""

from typing import Any

__all__ = ["WorkerSettings"]


def __getattr__(name: str) -> Any:
    if name == "WorkerSettings":
        from worker.settings import settings_from_env

        return settings_from_env()
    raise AttributeError(f"module 'worker' has no attribute {name!r}")
