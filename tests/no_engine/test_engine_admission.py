"""The order in which a worker's jobs enter its engine (``worker/admission.py``): a job
started after a take-over enters only once the take-over has."""

from __future__ import annotations

import asyncio

from worker.admission import EngineAdmission


async def test_a_job_started_after_a_take_over_waits_until_the_take_over_entered() -> None:
    admission = EngineAdmission()
    take_over = admission.ticket(taken_over=True)
    fresh = admission.ticket(taken_over=False)
    waiting = asyncio.create_task(fresh.wait())
    await asyncio.sleep(0.01)
    assert not waiting.done(), "entered the engine before the take-over started ahead of it"
    take_over.entered()
    await asyncio.wait_for(waiting, 1)


async def test_jobs_started_before_a_take_over_and_take_overs_themselves_wait_for_nothing() -> None:
    admission = EngineAdmission()
    before = admission.ticket(taken_over=False)
    first = admission.ticket(taken_over=True)
    second = admission.ticket(taken_over=True)
    for ticket in (before, first, second):
        await asyncio.wait_for(ticket.wait(), 1)
    assert admission.take_overs_pending == 2


async def test_a_take_over_that_ends_without_entering_lets_the_others_in() -> None:
    """Its run ended before the engine (superseded, already ended, failed): the runner gives
    its ticket up all the same, and nobody behind it waits forever."""
    admission = EngineAdmission()
    take_over = admission.ticket(taken_over=True)
    behind = [admission.ticket(taken_over=False) for _ in range(3)]
    take_over.entered()
    take_over.entered()  # at its first output, then again as its run ends
    await asyncio.wait_for(asyncio.gather(*(ticket.wait() for ticket in behind)), 1)
    assert admission.take_overs_pending == 0


async def test_a_job_waits_for_each_take_over_started_before_it_and_no_later_one() -> None:
    admission = EngineAdmission()
    early, late_started = admission.ticket(taken_over=True), admission.ticket(taken_over=True)
    fresh = admission.ticket(taken_over=False)
    after = admission.ticket(taken_over=True)
    waiting = asyncio.create_task(fresh.wait())
    early.entered()
    await asyncio.sleep(0.01)
    assert not waiting.done(), "entered while a take-over started before it was still outside"
    late_started.entered()
    await asyncio.wait_for(waiting, 1)
    assert admission.take_overs_pending == 1  # ``after``, which ``fresh`` never waited for
    after.entered()


async def test_a_waiting_job_cancelled_leaves_the_take_over_untouched() -> None:
    """A cancel (or the deadline) of a job in line ends its wait, not the take-over's run."""
    admission = EngineAdmission()
    take_over = admission.ticket(taken_over=True)
    waiting = asyncio.create_task(admission.ticket(taken_over=False).wait())
    await asyncio.sleep(0.01)
    waiting.cancel()
    await asyncio.gather(waiting, return_exceptions=True)
    assert admission.take_overs_pending == 1
    take_over.entered()
    assert admission.take_overs_pending == 0
