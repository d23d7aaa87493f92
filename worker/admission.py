"""The order in which a worker's jobs reach its engine: none before a take-over started
ahead of it.

A claim returns a taken-over request first (its subscriber waits mid-stream, and the engine
is told to run it ahead of everything: ``TAKE_OVER_PRIORITY``). But its start reads what the
earlier attempt logged, a Redis round trip the jobs claimed beside it do not make, and every
request's way into the engine (``AsyncLLM.add_request``) passes through a thread: started
together, the others could reach the engine first and fill the slots that were free, and
vLLM's priority scheduling never preempts a running request for a waiting one, so the
take-over would wait for the longest of them. Here a job enters the engine only once each
take-over started before it has entered (its first output, or its end).

Take-overs wait for nothing (the engine orders them among themselves); the jobs claimed in
one pass other than take-overs need no order of their own beyond the engine's priorities.
"""

from __future__ import annotations

import asyncio


class EngineAdmission:
    """Hands each job, in the order the worker starts them, the ticket it enters the
    engine with."""

    def __init__(self) -> None:
        self._take_overs: list[asyncio.Future[None]] = []
        """Take-overs started and not in the engine yet."""

    def ticket(self, *, taken_over: bool) -> AdmissionTicket:
        """The ticket of the job started now; call in the order jobs start."""
        self._take_overs = [entered for entered in self._take_overs if not entered.done()]
        if taken_over:
            own = asyncio.get_running_loop().create_future()
            self._take_overs.append(own)
            return AdmissionTicket((), own)
        return AdmissionTicket(tuple(self._take_overs), None)

    @property
    def take_overs_pending(self) -> int:
        """Take-overs started that have not entered the engine yet."""
        return sum(1 for entered in self._take_overs if not entered.done())


class AdmissionTicket:
    """One job's place: ``wait`` before it enters the engine, ``entered`` once it has (or
    once it ends without entering: never leave a job behind it waiting)."""

    __slots__ = ("_ahead", "_own")

    def __init__(self, ahead: tuple[asyncio.Future[None], ...], own: asyncio.Future[None] | None) -> None:
        self._ahead = ahead
        self._own = own

    async def wait(self) -> None:
        """Until every take-over started before this job has entered the engine."""
        pending = [entered for entered in self._ahead if not entered.done()]
        if pending:
            await asyncio.wait(pending)
        self._ahead = ()

    def entered(self) -> None:
        """This job is in the engine (its first output came) or has ended; idempotent."""
        if self._own is not None and not self._own.done():
            self._own.set_result(None)


UNORDERED = AdmissionTicket((), None)
"""The ticket of a job nobody orders (arq's own job runner): it waits for nothing."""
