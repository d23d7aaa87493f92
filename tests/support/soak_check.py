"""The chaos soak's requests and its check of each (``tests/real_engine/test_soak.py``), apart
from the soak so that the check is tested on its own (``tests/no_engine/test_soak_check.py``):
a check that cannot fail proves nothing.

A request must end exactly once in every eye: its replay log holds one terminal event, at
its end; its handle delivered one; and the wire (every pub/sub message a witness saw) carried
one, whatever its seq. The one repetition allowed on the wire is an end published again as
it was (same seq, same bytes): a take-over that finds its request ended confirms the logged
end again and publishes it again, for a subscriber that may have missed it. Any other second
end (another seq, or the same seq with other contents, as a request run again after a
failover took its first end back) fails the check.

Where a failover can take back writes (the cluster soak kills a shard's primary), an event
published again as it was passes too: the promoted replica may lack the last events an
attempt wrote, and published, before the kill; the attempt's retried call writes them again,
and publishes them again, same seq and bytes. A reader drops a seq it has seen (PROTOCOL.md,
``seq``), so a subscriber sees each once; the soak counts such requests apart. Anywhere else
(one Redis that loses nothing it acknowledged) any repeat fails the check.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from streamq.protocol import ChunkEvent, ErrorEvent, Event, FinalEvent

NEVER = "@@ no such words @@"
"""A stop string the tiny model never writes: vLLM holds back text while it might form."""


@dataclass(frozen=True)
class Spec:
    """One distinct request; the soak submits it many times under fresh ids."""

    name: str
    request: dict[str, Any]

    @property
    def runs_to_max_tokens(self) -> bool:
        return bool(self.request.get("ignore_eos")) and self.request.get("stop") in (None, [NEVER])


@dataclass(frozen=True)
class Answer:
    """What a subscriber assembles from a request's events."""

    text: str
    token_ids: list[int]
    finish_reasons: list[str | None]


@dataclass
class Run:
    """One request of the soak, as its handle saw it."""

    request_id: str
    spec: Spec
    streamed: bool = True
    submitted_at: float = 0.0
    events: list[tuple[float, Event]] = field(default_factory=list)
    error: str | None = None
    cancel_at: float | None = None
    cancel_outcome: str | None = None

    def ended_by(self, at: float) -> bool:
        return any(isinstance(event, FinalEvent | ErrorEvent) and seen <= at for seen, event in self.events)

    def next_event_after(self, at: float) -> float | None:
        return next((seen for seen, _ in self.events if seen > at), None)


def answer_of(events: list[Event]) -> Answer:
    chunks = [e for e in events if isinstance(e, ChunkEvent)]
    last = events[-1] if events else None
    reasons = last.finish_reasons if isinstance(last, FinalEvent) else []
    return Answer("".join(c.text for c in chunks), [t for c in chunks for t in c.token_ids], reasons)


def distinct_ends(events: Iterable[Event]) -> list[Event]:
    """The terminal events (``final`` or ``error``) among ``events``, whatever their seq, an
    end repeated as it was (same seq, same contents) counted once."""
    ends: list[Event] = []
    for event in events:
        if isinstance(event, FinalEvent | ErrorEvent) and event not in ends:
            ends.append(event)
    return ends


def repeated_as_they_were(wire: list[Event]) -> list[Event]:
    """The events the wire carried again with the same contents (a repeat each time)."""
    return [event for index, event in enumerate(wire) if event in wire[:index]]


def check(
    run: Run, logged: list[Event], wire: list[Event], expected: Answer, *, writes_may_be_lost: bool = False
) -> tuple[list[str], bool, bool]:
    """What is wrong with one request: (problems, lost, duplicated). ``logged``: its replay
    log at the end; ``wire``: every event of it a witness saw published, in order;
    ``writes_may_be_lost``: a failover may have taken back writes, so an event published
    again as it was passes (see the module's docstring)."""
    problems: list[str] = []
    seqs = [event.seq for event in logged]
    terminals = [event for event in logged if isinstance(event, FinalEvent | ErrorEvent)]
    lost = not terminals or not run.ended_by(float("inf"))
    duplicated = len(terminals) > 1 or len(set(seqs)) != len(seqs)
    if seqs != list(range(len(seqs))):
        problems.append(f"replay log seqs not contiguous from 0: {seqs}")
    if not terminals:
        problems.append("no final or error event in the replay log")
    elif terminals != [logged[-1]]:
        problems.append(f"{len(terminals)} terminal events, or one before the end: {terminals}")
    if run.cancel_outcome and run.cancel_outcome.startswith("raised"):
        problems.append(f"cancel() {run.cancel_outcome}")
    delivered = [event for _, event in run.events]
    handle_ends = [event for event in delivered if isinstance(event, FinalEvent | ErrorEvent)]
    if len(handle_ends) > 1:
        duplicated = True
        problems.append(f"the handle delivered {len(handle_ends)} ends: {handle_ends[:3]}")
    if run.error is not None:
        problems.append(f"the handle raised {run.error}")
    elif not run.ended_by(float("inf")):
        problems.append("the handle never saw the end")
    elif delivered != logged:
        problems.append("the handle's events differ from the replay log's")
    wire_ends = distinct_ends(wire)
    if len(wire_ends) > 1:
        duplicated = True
        problems.append(f"{len(wire_ends)} ends on the wire: {wire_ends[:3]}")
    by_seq = {event.seq: event for event in logged}
    # an end published again as it was is allowed (see the module's docstring); nothing else
    # twice, unless a failover may have taken back what an attempt wrote
    repeated = [] if writes_may_be_lost else [e for e in repeated_as_they_were(wire) if e not in wire_ends]
    if repeated:
        duplicated = True
        problems.append(f"events published twice: seqs {sorted({event.seq for event in repeated})}")
    strays = [event for event in wire if by_seq.get(event.seq) != event]
    if strays:
        duplicated = True
        problems.append(f"published events that the log does not hold: {strays[:3]}")
    if problems or not terminals:
        return problems, lost, duplicated

    final = logged[-1]
    if isinstance(final, ErrorEvent):
        return [f"ended with an error: {final.code}: {final.message}"], lost, duplicated
    assert isinstance(final, FinalEvent)
    got = answer_of(logged)
    attempts = sorted({event.attempt for event in logged})
    if final.completion_tokens != len(got.token_ids):
        problems.append(f"completion_tokens {final.completion_tokens} but {len(got.token_ids)} tokens sent")
    if got.finish_reasons == ["cancelled"]:
        if run.cancel_at is None:
            problems.append("cancelled, but nobody cancelled it")
        if got.token_ids != expected.token_ids[: len(got.token_ids)] or not expected.text.startswith(got.text):
            problems.append(f"cancelled output is not a prefix of the undisturbed answer (attempts {attempts})")
        return problems, lost, duplicated
    if got != expected:
        at = next((i for i, (a, b) in enumerate(zip(got.token_ids, expected.token_ids, strict=False)) if a != b), None)
        problems.append(
            f"answer differs from the undisturbed run (attempts {attempts}, first differing token {at}, "
            f"{len(got.token_ids)} vs {len(expected.token_ids)} tokens, {got.finish_reasons} vs "
            f"{expected.finish_reasons}): {got.text!r} != {expected.text!r}"
        )
    if run.spec.runs_to_max_tokens and final.completion_tokens != run.spec.request["max_tokens"]:
        problems.append(f"{final.completion_tokens} tokens, not max_tokens {run.spec.request['max_tokens']}")
    return problems, lost, duplicated
