"""What one attempt of a job runs with, and what it ends with: typed, built once per job.

The worker's job runner (``worker/job_runner.py``) builds the context straight from its
claim; under arq's own command line (``arq worker.WorkerSettings``) the job function builds
it from the ``ctx`` dict arq hands every job. Either way the request's steps
(``worker/job.py``) see this one object, never arq's dict.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import msgspec
from vllm.outputs import RequestOutput

from worker.admission import UNORDERED, AdmissionTicket
from worker.state import WorkerState, state_of


@dataclass(frozen=True, slots=True)
class JobContext:
    """One attempt of one job."""

    job_id: str
    """arq's job id, as the queue holds it: any string a bare ``ZADD`` put there. Once the
    job's request is read and checked (``parse_request``), it is the request's id; the code
    then says ``request_id``."""
    attempt: int
    """arq's try count: 1, then one more each time a worker claims the job again."""
    queued_at_ms: int
    """The job's score in its queue: Unix ms of Redis's clock when it was enqueued (or came due)."""
    state: WorkerState
    lease_set: bool = False
    """The claim that took the job set its lease (``StreamqWorker``'s): nothing to renew at
    once. arq's own claim writes an hour-long lease that the first renewal must shorten."""
    admission: AdmissionTicket = UNORDERED
    """Its place on the way into the engine (``worker/admission.py``): behind the take-overs
    the worker started before it."""

    @classmethod
    def of_arq(cls, ctx: Mapping[str, Any]) -> JobContext:
        """The context of the job arq runs with ``ctx``."""
        return cls(ctx["job_id"], ctx["job_try"], ctx["score"], state_of(ctx))


class RequestSummary(msgspec.Struct, kw_only=True):
    """The result arq stores for an attempt that ended its request (``arq:result:<id>``'s
    ``r``, which status reads once the replay log is gone)."""

    request_id: str
    finish_reasons: list[str | None]
    prompt_tokens: int
    completion_tokens: int


class Superseded(msgspec.Struct, kw_only=True):
    """The outcome of an attempt that stopped because another attempt owns its request (or
    ended it): the end, arq's bookkeeping and the callback are that attempt's."""

    request_id: str
    superseded: bool = True


JobOutcome = RequestSummary | Superseded
"""How an attempt that did not fail ended."""


class Generation(Protocol):
    """What produces a request's engine outputs: its first run from the prompt, the rest of
    the answer after a take-over (``Continuation``), or the whole answer again with what
    was delivered held back (``Regeneration``)."""

    def generate(
        self, engine: Any, request_id: str, priority: int = 0, **engine_kwargs: Any
    ) -> AsyncIterator[RequestOutput]: ...
