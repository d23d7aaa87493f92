"""A lease names its holder: the worker and the attempt."""

from __future__ import annotations

from worker.lease import lease_holder


def test_a_holder_names_its_worker_and_attempt() -> None:
    holders = {lease_holder(worker, attempt) for worker in ("host-1-a", "host-2-b") for attempt in (1, 2)}
    assert len(holders) == 4  # each attempt of each worker holds a lease of its own
    assert all(holder.startswith(("host-1-a:", "host-2-b:")) for holder in holders)


def test_a_holder_is_not_the_workers_bare_claim() -> None:
    """The claim writes the bare worker id; an attempt's renewal must be told from it."""
    assert lease_holder("host-1-a", 1) != "host-1-a"
