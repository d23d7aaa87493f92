"""streamq's worker: one vLLM AsyncLLM per process, fed by an arq queue.

``arq worker.WorkerSettings`` or ``python -m worker`` runs it.
"""

from worker.settings import WorkerSettings

__all__ = ["WorkerSettings"]
