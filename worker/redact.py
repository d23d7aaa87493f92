"""Keep prompts out of the worker's log.

arq's own ``run_job`` (``arq worker.WorkerSettings``; ``python -m worker`` runs its jobs
without it, ``worker/job_runner.py``) logs every job it starts at INFO as ``→
generate(<repr of the arguments>)``, the first 80 characters of the request: its prompt or
messages. Prompts are user data, so the worker's job deserializer hands the job function a
request whose ``repr`` names only its id and size; everything else sees an ordinary dict.
"""

from __future__ import annotations

from typing import Any

from streamq.protocol import deserialize_job


class RedactedRequest(dict[str, Any]):
    """A job argument that logs as its request id and size, never its text."""

    def __repr__(self) -> str:
        chars = len(str(self.get("prompt") or "")) + sum(
            len(str(m.get("content", ""))) for m in self.get("messages") or () if isinstance(m, dict)
        )
        return f"<request {self.get('request_id')!r}, {chars} characters of prompt>"


def deserialize_job_redacted(data: bytes) -> Any:
    """``deserialize_job`` whose object arguments log redacted (arq ``job_deserializer``)."""
    job = deserialize_job(data)
    if isinstance(job, dict) and isinstance(job.get("a"), list):
        job["a"] = [RedactedRequest(arg) if isinstance(arg, dict) else arg for arg in job["a"]]
    return job
