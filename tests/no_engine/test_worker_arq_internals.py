"""``StreamqWorker`` overrides and mirrors parts of arq's ``Worker``: a new arq that
changes any of them must fail here, naming the part, before it misbehaves in production."""

from __future__ import annotations

import ast
import hashlib
import inspect
import textwrap
import warnings
from collections.abc import Callable
from typing import Any

import arq.constants
import arq.utils
import pytest
from arq.worker import Worker

from streamq.protocol import IN_PROGRESS_PREFIX

with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)  # torch's own, raised while vLLM imports
    from worker.arq_worker import StreamqWorker, slots_freed_by_ended

RECORDED: dict[str, str] = {
    # Overridden by StreamqWorker.
    "Worker.__init__": "d6a9394abdb57cc4",
    "Worker.main": "0ecb21ce3368eccd",
    "Worker._release_sem_dec_counter_on_complete": "4a26f100774efecc",
    "Worker.close": "d14f94e939753f5e",
    "Worker.handle_sig": "c2b96e67b9157b33",
    "Worker._wait_for_tasks_to_complete": "e507e061554955c0",
    # Mirrored: StreamqWorker._start and its claim script do what start_jobs does; the
    # claim, worker/job_runner.py and worker/acknowledger.py what run_job, finish_job and
    # finish_failed_job do (each outcome of run_job: docs/internals.md, "A job's run").
    "Worker.start_jobs": "a38f54558b8cd0e0",
    "Worker.run_job": "3ba41d10a68f7bcc",
    "Worker.finish_job": "93bb5bdcf65892e5",
    "Worker.finish_failed_job": "103418320f3ae56c",
    # Called.
    "Worker._cancel_aborted_jobs": "5bd03e72e1ad5c85",
    "Worker._jobs_started": "b9cdaffd67067786",
    "arq.utils.timestamp_ms": "fb714827206ab4ab",
}
"""sha256 (first 16 hex digits) of the source of each arq part StreamqWorker depends on, in the arq tested."""


def _part(name: str) -> Callable[..., Any]:
    owner, attribute = name.rsplit(".", 1)
    function: Callable[..., Any] = getattr(Worker if owner == "Worker" else arq.utils, attribute)
    return function


def _digest(function: Callable[..., Any]) -> str:
    return hashlib.sha256(textwrap.dedent(inspect.getsource(function)).encode()).hexdigest()[:16]


def _overrides() -> list[str]:
    return sorted(name for name in vars(StreamqWorker) if name in dir(Worker) and not name.startswith("__"))


@pytest.mark.parametrize("name", sorted(RECORDED))
def test_arq_parts_the_worker_relies_on_are_unchanged(name: str) -> None:
    actual = _digest(_part(name))
    assert actual == RECORDED[name], (
        f"arq's {name} changed (source hash {actual}, recorded {RECORDED[name]}; arq {arq.VERSION}). "
        f"Re-read worker/arq_worker.py's StreamqWorker against the new {name}, fix it if need be, "
        f'then record "{actual}" for it in RECORDED here and widen the arq pin in pyproject.toml.'
    )


def test_every_override_is_recorded() -> None:
    unrecorded = [name for name in ["__init__", *_overrides()] if f"Worker.{name}" not in RECORDED]
    assert not unrecorded, f"StreamqWorker overrides arq's {unrecorded}: record their source hashes in RECORDED"


@pytest.mark.parametrize("name", _overrides())
def test_overrides_keep_arqs_signatures(name: str) -> None:
    ours, theirs = getattr(StreamqWorker, name), getattr(Worker, name)
    assert inspect.iscoroutinefunction(ours) == inspect.iscoroutinefunction(theirs), f"{name}: async or not"

    def shape(function: Callable[..., Any]) -> list[tuple[str, Any, Any]]:
        return [(p.name, p.kind, p.default) for p in inspect.signature(function).parameters.values()]

    assert shape(ours) == shape(theirs), f"StreamqWorker.{name} no longer takes what arq's Worker.{name} takes"


def _self_attributes(cls: type, *, assigned: bool) -> set[str]:
    """Names of ``self.<name>`` in ``cls``'s source: read (``assigned=False``) or assigned."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    names = set()
    for node in ast.walk(tree):
        is_self = isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self"
        if is_self and isinstance(node.ctx, ast.Store) == assigned:
            names.add(node.attr)
    return names


def test_arq_attributes_the_worker_reads_still_exist() -> None:
    own = set(vars(StreamqWorker)) | _self_attributes(StreamqWorker, assigned=True)
    arqs = set(dir(Worker)) | _self_attributes(Worker, assigned=True)
    missing = sorted(_self_attributes(StreamqWorker, assigned=False) - own - arqs)
    assert not missing, f"StreamqWorker reads {missing}, which arq's Worker no longer has: re-read it against arq"


def test_the_in_progress_prefix_is_arqs() -> None:
    assert arq.constants.in_progress_key_prefix == IN_PROGRESS_PREFIX


@pytest.mark.parametrize(
    ("batch", "jobs", "ended", "freed"),
    [
        (2, 1, 1, 1),  # the turn just ended, nothing else runs: its slot is the follow-up's
        (2, 2, 1, 1),  # one request runs beside it
        (2, 3, 1, 0),  # two run (one was waiting in the engine's queue): no room
        (4, 6, 3, 1),  # three ended, three run: one slot left
        (2, 0, 0, 0),
    ],
)
def test_ended_requests_free_slots_for_routing_only_where_the_batch_has_room(
    batch: int, jobs: int, ended: int, freed: int
) -> None:
    assert slots_freed_by_ended(batch, jobs, ended) == freed
