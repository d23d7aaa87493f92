"""Each Lua script's keys and arguments, typed: one frozen, keyword-only call per script.

A script's file opens with its keys and arguments, a line each, in order (a line that goes
on continues on the next, indented two spaces):

- ``-- KEYS[1] job_key: ...``: one key (``ARGV[1]``: one argument);
- ``-- ARGV[8] priority = 0: ...``: optional: the value a call sends when not told one
  (``''`` or ``0`` where the script reads that as absent);
- ``-- KEYS[8] owner_key = nil: ...``: optional, left out when absent (only at the end);
- ``-- KEYS[2..] queues = {}: ...``: any number, to the end (``= {}``: none unless told);
- ``-- KEYS[1..] events{log_key, owner_key}: ...``: any number of groups of these, in turn;
- ``-- ARGV[n+1] publish = nil: ...``: after any number (``n``: the last position they took).

A call's fields are those names, ``Key`` or ``Keys`` for the script's KEYS, and its
defaults theirs; a group is a sequence of a ``NamedTuple`` whose ``Key`` members go to
KEYS and the rest to ARGV, each in its order. ``call.keys()`` and ``call.args()`` are what
the script gets; ``streamq.protocol.scripts.Script`` runs it. A test holds every call to its
script's header.
"""

from __future__ import annotations

import enum
import types
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Annotated, Any, ClassVar, Final, NamedTuple, TypeAlias, Union, get_args, get_origin, get_type_hints

from streamq.protocol.names import (
    ABORT_KEY,
    CANCEL_CHANNEL,
    CANCELLED_KEY_PREFIX,
    CLAIM_SCAN_INTERVAL_MS,
    DEFAULT_TENANT,
    EVENTS_CHANNEL_PREFIX,
    IN_PROGRESS_PREFIX,
    JOB_EXPIRY_MS,
    JOB_KEY_PREFIX,
    MODELS_KEY,
    RESULT_KEY_PREFIX,
    RETRY_KEY_PREFIX,
    TENANT_WEIGHTS_KEY,
    WAKEUP_CHANNEL,
    cancelled_key,
    running_key,
)

Arg: TypeAlias = str | bytes | int | float
"""One ARGV value, as Redis gets it (a number in decimal)."""


class _Mark(enum.Enum):
    KEY = "one of the script's KEYS"
    JOINED = "a list sent as one argument, comma-joined"


Key: TypeAlias = Annotated[str, _Mark.KEY]
"""A field (or group member) that goes to KEYS."""
Keys: TypeAlias = Annotated[Sequence[str], _Mark.KEY]
"""Any number of KEYS, to the end."""
Joined: TypeAlias = Annotated[Sequence[str], _Mark.JOINED]
"""Any number of names sent as one argument, joined by ``,`` (none: ``''``)."""

CALLS: Final[dict[str, type[ScriptCall]]] = {}
"""Script name -> its call."""
_LAYOUTS: dict[type[ScriptCall], tuple[_Slot, ...]] = {}


class _Slot(NamedTuple):
    """Where one field goes: ``shape`` one of ``one``, ``joined``, ``rest`` (any number) or
    ``group`` (any number of groups; ``members``: per member, whether it is a key)."""

    name: str
    shape: str
    key: bool
    members: tuple[bool, ...] = ()
    optional: tuple[int, ...] = ()
    """A group's members left out when ``None`` (every group alike)."""


@dataclass(frozen=True, kw_only=True)
class ScriptCall:
    """A call of the script ``script`` (``lua/<script>.lua``), its fields its header's."""

    script: ClassVar[str]
    read_only: ClassVar[bool] = False
    """Only reads: run by ``EVALSHA_RO`` (``Script``)."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        CALLS[cls.script] = cls

    def flat(self) -> tuple[list[str], list[Arg]]:
        """The script's KEYS and ARGV for this call."""
        keys: list[str] = []
        args: list[Arg] = []
        left_out: dict[bool, str] = {}  # KEYS (True) or ARGV: the field left out there
        for slot in _layout(type(self)):
            value = getattr(self, slot.name)
            if slot.shape == "group":
                _put_groups(slot, value, keys, args)
                continue
            if value is None:
                left_out.setdefault(slot.key, slot.name)
                continue
            if slot.key in left_out:
                raise ValueError(f"{type(self).__name__}: {slot.name} given after {left_out[slot.key]} was left out")
            out: list[Any] = keys if slot.key else args
            if slot.shape == "joined":
                out.append(",".join(value))
            elif slot.shape == "rest":
                out.extend(value)
            else:
                out.append(value)
        return keys, args

    def keys(self) -> list[str]:
        return self.flat()[0]

    def args(self) -> list[Arg]:
        return self.flat()[1]

    def command(self, sha: str, name: str = "EVALSHA") -> tuple[Any, ...]:
        """``EVALSHA`` (or ``name``) of this call, for ``execute_command`` or a pipeline."""
        keys, args = self.flat()
        return (name, sha, len(keys), *keys, *args)


def _put_groups(slot: _Slot, groups: Sequence[tuple[Any, ...]], keys: list[str], args: list[Arg]) -> None:
    if slot.optional and groups:
        shapes = {tuple(group[i] is None for i in slot.optional) for group in groups}
        if len(shapes) > 1:
            raise ValueError(f"{slot.name}: every group must leave out the same members")
    for group in groups:
        for value, key in zip(group, slot.members, strict=True):
            if value is not None:
                (keys if key else args).append(value)


def _marks(hint: Any) -> set[_Mark]:
    if get_origin(hint) is Annotated:
        return {mark for mark in hint.__metadata__ if isinstance(mark, _Mark)}
    if get_origin(hint) in (Union, types.UnionType):
        return set().union(*(_marks(arg) for arg in get_args(hint)))
    return set()


def _bare(hint: Any) -> Any:
    """``hint`` without ``Annotated`` and ``| None``."""
    if get_origin(hint) is Annotated:
        return _bare(get_args(hint)[0])
    if get_origin(hint) in (Union, types.UnionType):
        others = [arg for arg in get_args(hint) if arg is not type(None)]
        return _bare(others[0]) if len(others) == 1 else hint
    return hint


def _group_type(hint: Any) -> Any:
    """The ``NamedTuple`` of a sequence of groups, else ``None``."""
    bare = _bare(hint)
    if get_origin(bare) is not Sequence:
        return None
    [item] = get_args(bare)
    return item if isinstance(item, type) and issubclass(item, tuple) and hasattr(item, "_fields") else None


def _layout(call: type[ScriptCall]) -> tuple[_Slot, ...]:
    """Where each of ``call``'s fields goes, read from its types once."""
    layout = _LAYOUTS.get(call)
    if layout is None:
        layout = _LAYOUTS[call] = _read_layout(call)
    return layout


def _read_layout(call: type[ScriptCall]) -> tuple[_Slot, ...]:
    hints = get_type_hints(call, include_extras=True)
    slots = []
    for field in fields(call):
        hint = hints[field.name]
        group = _group_type(hint)
        if group is not None:
            member_hints = get_type_hints(group, include_extras=True)
            members = tuple(_Mark.KEY in _marks(member_hints[name]) for name in group._fields)
            defaults = group._field_defaults
            optional = tuple(i for i, name in enumerate(group._fields) if name in defaults and defaults[name] is None)
            slots.append(_Slot(field.name, "group", False, members, optional))
            continue
        marks = _marks(hint)
        if _Mark.JOINED in marks:
            shape = "joined"
        elif get_origin(_bare(hint)) is Sequence:
            shape = "rest"
        else:
            shape = "one"
        slots.append(_Slot(field.name, shape, _Mark.KEY in marks))
    return tuple(slots)


# One call per script, in the order of its header (``lua/<script>.lua``), which says what
# each field is.


@dataclass(frozen=True, kw_only=True)
class AdmitKeyRequest(ScriptCall):
    """Admit one HTTP request against its API key's limits."""

    script: ClassVar[str] = "admit_key_request"
    window_key: Key
    streams_key: Key
    secret_hash: str
    model: str
    stream_member: str
    stream_lease_ms: int
    window_ms: int
    api_keys_key: str


class AppendedEvent(NamedTuple):
    """One event of ``AppendAndPublish``."""

    log_key: Key
    owner_key: Key
    entry_id: str
    attempt: int
    terminal: int
    payload: bytes


@dataclass(frozen=True, kw_only=True)
class AppendAndPublish(ScriptCall):
    """Log and publish a batch of events, each only as the next entry of its log."""

    script: ClassVar[str] = "append_and_publish"
    maxlen: int
    ttl_ms: int
    events: Sequence[AppendedEvent]
    recent_ends_key: str | None = None
    recent_ends_max: int | None = None
    log_prefix: str | None = None
    publish: str | None = None
    """``None``: ``PUBLISH``; ``SPUBLISH`` on a cluster; ``DEFER`` (``''``): an end that waits
    for its replicas, published by the caller after its ``WAIT``."""

    DEFER: ClassVar[str] = ""


@dataclass(frozen=True, kw_only=True)
class Cancel(ScriptCall):
    """Stop a running request, or take a queued one off its queue."""

    script: ClassVar[str] = "cancel"
    job_key: Key
    cancelled_key: Key
    queues: Keys = ()
    request_id: str
    cancel_channel: str
    in_progress_key: str
    models_key: str
    queued_only: str = ""
    cancelled_ttl_ms: int = JOB_EXPIRY_MS

    @classmethod
    def of_request(cls, request_id: str, queues: Sequence[str] = (), *, queued_only: bool = False) -> Cancel:
        """The call for ``request_id``, looked for on ``queues`` (besides every model's), its
        keys and channel named from its id; ``queued_only``: a running request is left alone."""
        return cls(
            job_key=JOB_KEY_PREFIX + request_id,
            cancelled_key=cancelled_key(request_id),
            queues=queues,
            request_id=request_id,
            cancel_channel=CANCEL_CHANNEL,
            in_progress_key=IN_PROGRESS_PREFIX + request_id,
            models_key=MODELS_KEY,
            queued_only="1" if queued_only else "",
        )


@dataclass(frozen=True, kw_only=True)
class ClaimCallbacks(ScriptCall):
    """Claim due callback deliveries, with a lease."""

    script: ClassVar[str] = "claim_callbacks"
    callbacks_key: Key
    count: int
    lease_ms: int
    callback_prefix: str


@dataclass(frozen=True, kw_only=True)
class ClaimJobs(ScriptCall):
    """Claim due jobs for a worker's free slots (asked for none: only the bookkeeping)."""

    script: ClassVar[str] = "claim_jobs"
    queue: Key
    wanted: int
    lease_ms: int
    page: int
    in_progress_prefix: str
    worker_id: str
    weights_key: str = TENANT_WEIGHTS_KEY
    scan_interval_ms: int = CLAIM_SCAN_INTERVAL_MS
    affinity_worker_ttl_ms: int = 0
    free_ttl_ms: int = 0
    running: int = 0
    spare: int = 0
    wakeup_channel: str = ""
    cancelled_prefix: str = CANCELLED_KEY_PREFIX
    job_prefix: str = JOB_KEY_PREFIX
    retry_prefix: str = RETRY_KEY_PREFIX
    ahead: int = 0

    @staticmethod
    def reply(raw: Sequence[Any]) -> Claimed:
        """The script's reply, typed."""
        now_ms, hits, misses, expired, *flat = raw
        jobs = [
            ClaimedJob(job_id.decode(), int(float(score)), bool(cancelled), payload or None, int(tries))
            for job_id, score, cancelled, payload, tries in zip(*(iter(flat),) * 5, strict=True)
        ]
        return Claimed(int(now_ms), int(hits), int(misses), int(expired), jobs)


class ClaimedJob(NamedTuple):
    """One job a claim took (``claim_jobs``)."""

    job_id: str
    score: int
    """Its score in the queue: when it was enqueued (or became due), Redis's ms."""
    cancelled: bool
    """A cancel was recorded while an earlier attempt ran it."""
    payload: bytes | None
    """arq's job; ``None`` when its key was gone (it expired)."""
    tries: int
    """arq's try count, this one included."""


class Claimed(NamedTuple):
    """What a claim did: Redis's time, the affinity counts, the jobs taken."""

    now_ms: int
    hits: int
    misses: int
    expired: int
    jobs: list[ClaimedJob]


@dataclass(frozen=True, kw_only=True)
class EndRequest(ScriptCall):
    """End a request from outside the attempt running it."""

    script: ClassVar[str] = "end_request"
    log_key: Key
    owner_key: Key
    event: bytes
    maxlen: int
    ttl_ms: int
    callback_key: str = ""
    callbacks_key: str
    request_id: str
    recent_ends_key: str
    recent_ends_max: int
    attempt: int | str = ""
    publish: str


@dataclass(frozen=True, kw_only=True)
class Enqueue(ScriptCall):
    """arq's enqueue, indexed for the claim, and the wake-up."""

    script: ClassVar[str] = "enqueue"
    job_key: Key
    queue: Key
    log_key: Key
    cancelled_key: Key | None = None
    payload: bytes
    expiry_ms: int
    request_id: str
    wakeup_channel: str
    queue_name: str
    limit: int
    result_key: str
    priority: int = 0
    tenant: str = DEFAULT_TENANT
    delay_ms: int = 0
    callback_key: str = ""
    callback: bytes = b""
    callback_ttl_ms: int = 0
    reservation_ttl_ms: int | str = ""
    affinity_keys: Joined = ()
    window_ms: int = 0
    balance_slack: int = 0
    balance_fraction: float = 0
    eligible: Joined = ()

    @classmethod
    def of_request(
        cls, request_id: str, queue: str, payload: bytes, *, log_key: str | None = None, **rest: Any
    ) -> Enqueue:
        """The call for ``request_id`` on ``queue``, its keys and channel named from them
        (``log_key``: its replay log on one Redis unless given; ``rest``: the others)."""
        return cls(
            job_key=JOB_KEY_PREFIX + request_id,
            queue=queue,
            log_key=EVENTS_CHANNEL_PREFIX + request_id if log_key is None else log_key,
            payload=payload,
            expiry_ms=rest.pop("expiry_ms", JOB_EXPIRY_MS),
            request_id=request_id,
            wakeup_channel=WAKEUP_CHANNEL,
            queue_name=queue,
            limit=rest.pop("limit", -1),
            result_key=RESULT_KEY_PREFIX + request_id,
            **rest,
        )


@dataclass(frozen=True, kw_only=True)
class FinishJob(ScriptCall):
    """arq's bookkeeping at the end of an attempt, fenced by the request's owner."""

    script: ClassVar[str] = "finish_job"
    in_progress_key: Key
    job_key: Key
    retry_key: Key
    result_key: Key
    queue: Key
    abort_key: Key
    running_key: Key
    owner_key: Key | None = None
    job_id: str
    worker_id: str
    holder: str
    attempt: int
    action: str
    result: bytes = b""
    result_ttl_ms: int
    score_increment: int | str = ""
    cancelled_key: str
    owner: str | None = None

    @classmethod
    def of_job(cls, job_id: str, queue: str, **rest: Any) -> FinishJob:
        """The call for ``job_id`` on ``queue``, its keys named from them (``rest``: the others)."""
        return cls(
            in_progress_key=IN_PROGRESS_PREFIX + job_id,
            job_key=JOB_KEY_PREFIX + job_id,
            retry_key=RETRY_KEY_PREFIX + job_id,
            result_key=RESULT_KEY_PREFIX + job_id,
            queue=queue,
            abort_key=ABORT_KEY,
            running_key=running_key(queue),
            job_id=job_id,
            cancelled_key=cancelled_key(job_id),
            **rest,
        )


@dataclass(frozen=True, kw_only=True)
class FinishKeyRequest(ScriptCall):
    """Close a request's stream and charge what it used to its API key."""

    script: ClassVar[str] = "finish_key_request"
    window_key: Key
    streams_key: Key
    usage_key: Key
    stream_member: str
    model: str
    prompt_tokens: int
    completion_tokens: int
    window_ms: int
    counted: int


@dataclass(frozen=True, kw_only=True)
class ReadRegistry(ScriptCall):
    """The live registrations and every model ever served."""

    script: ClassVar[str] = "read_registry"
    read_only: ClassVar[bool] = True
    workers_key: Key
    models_key: Key
    models_seen_key: Key
    queue_models_key: Key


@dataclass(frozen=True, kw_only=True)
class ReadWaiting(ScriptCall):
    """Each queue's waiting count and oldest wait."""

    script: ClassVar[str] = "read_waiting"
    read_only: ClassVar[bool] = True
    waiting_keys: Keys


@dataclass(frozen=True, kw_only=True)
class RecordCallback(ScriptCall):
    """Record one try of a callback delivery."""

    script: ClassVar[str] = "record_callback"
    callbacks_key: Key
    callback_key: Key
    request_id: str
    outcome: str
    attempts: int
    http_status: int | str = ""
    error: str = ""
    retry_in_ms: int
    ttl_ms: int


@dataclass(frozen=True, kw_only=True)
class RegisterWorker(ScriptCall):
    """Renew a worker's registration and record its models."""

    script: ClassVar[str] = "register_worker"
    workers_key: Key
    models_key: Key
    models_seen_key: Key
    queue_models_key: Key
    registration: bytes
    ttl_ms: int
    queue: str
    models: Sequence[str]


@dataclass(frozen=True, kw_only=True)
class ReleaseAffinity(ScriptCall):
    """Give back the jobs held for a stopping worker."""

    script: ClassVar[str] = "release_affinity"
    queue: Key
    worker_id: str
    wakeup_channel: str


class LeaseRenewal(NamedTuple):
    """One job of ``RenewLeases``: ``owner_key`` on one Redis, else ``owner`` (every job alike)."""

    in_progress_key: Key
    job_key: Key
    holder: str
    attempt: int
    cancelled_key: str
    owner_key: Key | None = None
    owner: str | None = None


@dataclass(frozen=True, kw_only=True)
class RenewLeases(ScriptCall):
    """Renew the leases of the attempts that still own their requests; report those
    whose requests were cancelled."""

    script: ClassVar[str] = "renew_leases"
    ttl_ms: int
    jobs: Sequence[LeaseRenewal]


@dataclass(frozen=True, kw_only=True)
class ReportWorkerStats(ScriptCall):
    """Store a worker's stats report."""

    script: ClassVar[str] = "report_worker_stats"
    stats_key: Key
    seen_key: Key
    worker_id: str
    stats: bytes
    keep_ms: int


@dataclass(frozen=True, kw_only=True)
class RequestStatus(ScriptCall):
    """What Redis holds about a request, for its status."""

    script: ClassVar[str] = "request_status"
    read_only: ClassVar[bool] = True
    job_key: Key
    in_progress_key: Key
    result_key: Key
    log_key: Key
    retry_key: Key
    callback_key: Key
    queues: Keys = ()
    request_id: str
    models_key: str
    in_progress_prefix: str
    ended: str | None = None


@dataclass(frozen=True, kw_only=True)
class RevokeApiKey(ScriptCall):
    """Delete an API key, by name, and its rate window."""

    script: ClassVar[str] = "revoke_api_key"
    api_keys_key: Key
    api_key_names_key: Key
    window_key: Key
    name: str


@dataclass(frozen=True, kw_only=True)
class SaveApiKey(ScriptCall):
    """Create an API key, or replace an existing key's record."""

    script: ClassVar[str] = "save_api_key"
    api_keys_key: Key
    api_key_names_key: Key
    name: str
    secret_hash: str = ""
    record: bytes
    create: int


@dataclass(frozen=True, kw_only=True)
class ScheduleCallback(ScriptCall):
    """Make an ended request's callback due, once."""

    script: ClassVar[str] = "schedule_callback"
    callbacks_key: Key
    callback_key: Key
    owner_key: Key | None = None
    request_id: str
    callback: bytes = b""
    ttl_ms: int
    owner: str | None = None


@dataclass(frozen=True, kw_only=True)
class TakeOver(ScriptCall):
    """Make an attempt the owner of its request, and read the log."""

    script: ClassVar[str] = "take_over"
    log_key: Key
    owner_key: Key
    attempt: int
    ttl_ms: int
