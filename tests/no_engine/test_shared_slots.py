"""The engine slots that the front ends of ``--front-ends N`` share (``worker.shared_slots``)."""

from __future__ import annotations

import multiprocessing

import pytest

from worker.shared_slots import SharedSlots


def test_front_ends_together_never_take_more_than_the_limit() -> None:
    slots = SharedSlots(limit=5, front_ends=2)
    assert slots.take(0, 3) == 3
    assert slots.take(1, 3) == 2, "only what is left"
    assert slots.take(0, 1) == 0
    slots.give(1, 2)
    assert slots.take(0, 4) == 2
    assert (slots.held(0), slots.held(1)) == (5, 0)


def test_giving_a_slot_back_after_a_front_end_went_short_tells_the_giver_to_claim() -> None:
    slots = SharedSlots(limit=2, front_ends=2)
    slots.take(0, 2)
    assert not slots.give(0, 1), "nobody went short"
    slots.take(0, 1)
    assert slots.take(1, 1) == 0  # front end 1 went short: jobs may be waiting
    assert slots.give(0, 1), "the giver should claim the waiting job"
    assert not slots.give(0, 1), "told once"


def test_a_front_end_ahead_of_its_siblings_claims_one_at_a_time_and_one_behind_catches_up() -> None:
    slots = SharedSlots(limit=100, front_ends=3)
    assert slots.fair_batch(0) == 1, "all level: one each, in turn"
    slots.take(0, 10)
    slots.take(1, 4)
    assert slots.fair_batch(0) == 1, "ahead of the others' average (2)"
    assert slots.fair_batch(2) == 8, "behind their average (7) by 7: that, plus one"


def test_a_dead_front_end_gives_back_its_slots_and_leaves_the_balance() -> None:
    slots = SharedSlots(limit=4, front_ends=2)
    slots.take(0, 1)
    slots.take(1, 3)
    assert slots.give_back_all_of(1) == 3
    assert slots.take(0, 4) == 3
    assert slots.fair_batch(0) == 4, "no live sibling to wait for"


def _take_in_child(slots: SharedSlots, wanted: int) -> None:
    slots.take(1, wanted)


def test_slots_taken_in_a_spawned_front_end_are_seen_by_its_parent() -> None:
    slots = SharedSlots(limit=3, front_ends=2)
    child = multiprocessing.get_context("spawn").Process(target=_take_in_child, args=(slots, 2))
    child.start()
    child.join(60)
    assert child.exitcode == 0
    assert slots.held(1) == 2
    assert slots.take(0, 3) == 1


def test_an_engine_without_slots_is_refused() -> None:
    with pytest.raises(ValueError, match="at least one"):
        SharedSlots(limit=0, front_ends=2)


def test_free_counts_the_slots_no_front_end_holds() -> None:
    slots = SharedSlots(limit=6, front_ends=2)
    assert slots.take(0, 2) == 2 and slots.take(1, 1) == 1
    assert slots.free() == 3
    slots.give_back_all_of(0)
    assert slots.free() == 5
