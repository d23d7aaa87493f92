"""The end confirmer: a request's end is told only once it is as durable as the deployment
asks (``--durable-ends``).

Where an end waits for its replicas (the log's ``durability``), the flusher hands each
request whose terminal event it takes, with that request's events of the same buffer, to
this task, on a connection of its own: it logs them and waits in one pipeline
(``ReplayLog.confirm``), publishes them, and only then resolves their waiters, so the job's
settling, its callback and arq's acknowledgement come after. The other requests' events
never wait for it. One confirmation is in flight at a time, with every end handed over
while the last one waited: they batch.

An end its replicas did not acknowledge within the bound is not an end yet: it is held
(``NotYetDurable``) and confirmed again, on whichever primary then holds its request,
until its replicas acknowledge it, its primary stops counting a replica it cannot reach
(``repl-timeout``: then nothing is left to wait for), or a failover promotes a replica
(whose own replicas, often none, it waits for; a promoted replica that lacks the request's
events refuses the end as out of step, and the job is handed back to go on from what the
new primary holds). Redis away or refusing for a moment is retried within the request's
retry budget (``worker/retry_budget.py``); a wait that Redis answered spends none of it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass

from streamq.broker.durability import NotYetDurable
from streamq.broker.replay_log import Appended, LogEvent, ReplayLog
from streamq.tasks import stop_task
from worker import metrics
from worker.retry_budget import RetryBudgets

logger = logging.getLogger("streamq.worker")


class PublishFailed(RuntimeError):
    """Events could not be logged: Redis stayed unreachable for longer than the retry
    budget, or refused them for good (a permission, a wrong key type)."""


@dataclass(frozen=True, eq=False)
class Waiter:
    """A caller of ``EventPublisher.flushed``: the request it waits for (``None``: every
    one), its future."""

    request_id: str | None
    future: asyncio.Future[None]


def settle(waiters: list[Waiter], failure: PublishFailed | None = None) -> None:
    """Resolve ``waiters`` (fail them with ``failure``, if given)."""
    for waiter in waiters:
        if waiter.future.done():
            continue
        if failure is None:
            waiter.future.set_result(None)
        else:
            waiter.future.set_exception(failure)


@dataclass(eq=False)
class _Confirmation:
    """One request's end handed over: its events of the buffer the flusher took (the
    terminal one last), its waiters, and the outcome (the failure, or ``None``) that waiters
    of every request also wait for."""

    request_id: str
    events: list[LogEvent]
    waiters: list[Waiter]
    outcome: asyncio.Future[PublishFailed | None]


Refused = Callable[[list[LogEvent], Appended], None]
"""Told of events the log refused (a superseded attempt's, an out-of-step one's)."""
IsTransient = Callable[[BaseException], bool]


class EndConfirmer:
    """Confirms the ends handed to it, one round at a time.

    :param budgets: the requests' retry budgets, shared with the flusher.
    :param on_refused: told of each round's refused events.
    :param is_transient: whether a failure passes on its own (sent again).
    """

    def __init__(
        self,
        log: ReplayLog,
        *,
        budgets: RetryBudgets,
        retry_delay_s: float,
        on_refused: Refused,
        is_transient: IsTransient,
    ) -> None:
        self._log = log
        self._budgets = budgets
        self._retry_delay_s = retry_delay_s
        self._on_refused = on_refused
        self._is_transient = is_transient
        self._to_confirm: list[_Confirmation] = []
        """Ends handed over, not yet taken by a round."""
        self._confirming: list[_Confirmation] = []
        """Ends handed over and not yet confirmed (queued or in flight)."""
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    @property
    def waits(self) -> bool:
        """Ends wait for something now (else they go the flusher's way, as any event)."""
        durability = self._log.durability
        return self._task is not None and durability is not None and durability.waits

    @property
    def busy(self) -> bool:
        return bool(self._confirming)

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._confirm_forever(), name="end-confirmer")

    async def close(self) -> None:
        await stop_task(self._task)
        self._task = None

    def hand_over(self, batch: list[LogEvent], waiters: list[Waiter]) -> tuple[list[LogEvent], list[Waiter]]:
        """Take the requests of ``batch`` that end in it (their events of the batch, their
        waiters); ``batch`` and ``waiters`` without them."""
        ended = {event.request_id for event in batch if event.terminal}
        if not ended:
            return batch, waiters
        loop = asyncio.get_running_loop()
        for request_id in ended:
            confirmation = _Confirmation(
                request_id,
                [event for event in batch if event.request_id == request_id],
                [waiter for waiter in waiters if waiter.request_id == request_id],
                loop.create_future(),
            )
            self._to_confirm.append(confirmation)
            self._confirming.append(confirmation)
        self._wake.set()
        rest = [event for event in batch if event.request_id not in ended]
        return rest, [waiter for waiter in waiters if waiter.request_id not in ended]

    def outcomes(self, request_id: str | None) -> list[asyncio.Future[PublishFailed | None]]:
        """The outcomes of the ends not yet confirmed: ``request_id``'s, or (``None``) all."""
        return [c.outcome for c in self._confirming if request_id in (None, c.request_id)]

    async def _confirm_forever(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            taken, self._to_confirm = self._to_confirm, []
            if not taken:
                continue
            again = await self._round(taken)
            if again:
                self._to_confirm[:0] = again  # ahead of ends handed over since
                self._wake.set()
                await asyncio.sleep(self._retry_delay_s)

    async def _round(self, taken: list[_Confirmation]) -> list[_Confirmation]:
        """Confirm ``taken`` once; the confirmations to send again."""
        events = [event for confirmation in taken for event in confirmation.events]
        metrics.ROUND_TRIPS["confirm"].inc()
        try:
            appended = await self._log.confirm(events)
        except Exception as exc:  # the confirmer must outlive any round
            if self._is_transient(exc):
                logger.warning("confirming the ends of %d requests failed, retrying: %s", len(taken), exc)
                return self._failed_again(taken, exc)
            self._fail(taken, PublishFailed(f"Redis refused the ends of {len(taken)} requests: {_named(exc)}"))
            return []
        metrics.PUBLISH_BATCH_EVENTS.observe(len(events) - len(appended.unsent))
        if appended.superseded or appended.out_of_step:
            self._on_refused(events, appended)
        unsent = {event.request_id for event in appended.unsent}
        again = [confirmation for confirmation in taken if confirmation.request_id in unsent]
        done = [confirmation for confirmation in taken if confirmation.request_id not in unsent]
        self._budgets.reached(confirmation.request_id for confirmation in done)
        for confirmation in done:
            self._resolve(confirmation)
        if not again:
            return []
        error = appended.error
        if isinstance(error, NotYetDurable):  # Redis answered: held, and no budget spent
            self._budgets.reached(confirmation.request_id for confirmation in again)
            return again
        if error is not None and not self._is_transient(error):
            self._fail(again, PublishFailed(f"Redis refused the ends of {len(again)} requests: {error}"))
            return []
        logger.warning("the ends of %d requests not confirmed, sent again: %s", len(again), error)
        return self._failed_again(again, error)

    def _failed_again(self, confirmations: list[_Confirmation], error: BaseException | None) -> list[_Confirmation]:
        """``confirmations`` to send again; those whose request's budget is spent fail."""
        spent = self._budgets.failed(c.request_id for c in confirmations)
        if spent:
            self._fail(
                [c for c in confirmations if c.request_id in spent],
                PublishFailed(f"could not confirm the ends of {len(spent)} requests: {error}"),
            )
        return [c for c in confirmations if c.request_id not in spent]

    def _fail(self, confirmations: list[_Confirmation], failure: PublishFailed) -> None:
        events = sum(len(c.events) for c in confirmations)
        logger.error("%d events of %d requests NOT published: %s", events, len(confirmations), failure)
        metrics.PUBLISH_FAILURES.inc(events)
        for confirmation in confirmations:
            self._resolve(confirmation, failure)

    def _resolve(self, confirmation: _Confirmation, failure: PublishFailed | None = None) -> None:
        """``confirmation`` is done: its waiters resolved (failed with ``failure``)."""
        with contextlib.suppress(ValueError):
            self._confirming.remove(confirmation)
        settle(confirmation.waiters, failure)
        if not confirmation.outcome.done():
            confirmation.outcome.set_result(failure)


def _named(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"
