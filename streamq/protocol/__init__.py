"""The wire contract between producers and workers: names, job payload, events.

This is the only module that knows how streamq looks on the wire; PROTOCOL.md
documents the same for other languages. Both sides import it, so it must not
import vllm or torch. Everything on the wire is JSON (never pickle: a pickled
arq job in Redis would be code execution on every worker).
"""

from __future__ import annotations

import enum
import re
import time
from typing import Any, Final

import msgspec

PROTOCOL_VERSION: Final = 1

# --- Redis names -------------------------------------------------------------
DEFAULT_QUEUE: Final = "streamq:queue"
"""arq queue (a sorted set of job ids scored by run-at time in ms)."""
JOB_KEY_PREFIX: Final = "arq:job:"
"""arq's key for a job's payload; the job id is the request id."""
RESULT_KEY_PREFIX: Final = "arq:result:"
"""arq's key for a finished job's result."""
IN_PROGRESS_PREFIX: Final = "arq:in-progress:"
"""arq's key marking a running job; streamq keeps it as a short lease (``worker/lease.py``)."""
EVENTS_CHANNEL_PREFIX: Final = "streamq:events:"
"""Pub/sub channel of one request's events: ``streamq:events:<request_id>``."""
WAKEUP_CHANNEL: Final = "streamq:wakeup"
"""Producers publish the queue name here after an enqueue, so idle workers start at once."""
CANCEL_CHANNEL: Final = "streamq:cancel"
"""Producers publish a request id here to cancel it while it runs; every worker listens."""
JOB_FUNCTION: Final = "generate"
"""Name of the arq job function that workers register."""
WORKERS_KEY: Final = "streamq:workers"
"""Live workers: a sorted set whose members are ``WorkerRegistration`` JSON, each scored
with the Unix ms (Redis's clock) until which that worker counts as live. Workers renew
their score every ``WORKER_RENEW_S`` to ``WORKER_TTL_MS`` ahead, so one sorted set read
(``ZRANGEBYSCORE streamq:workers <now ms> +inf``) routes by model, without a SCAN."""
MODELS_KEY: Final = "streamq:models"
"""Hash model name -> queue of every model a worker ever registered (never expires), so
a model whose workers are all gone (503) is told apart from one never served (404)."""
WORKER_TTL_MS: Final = 10_000
WORKER_RENEW_S: Final = 3.0

REQUEST_ID_PATTERN: Final = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,127}")
"""Request ids become parts of Redis key and channel names: a narrow alphabet keeps
one request from reaching another's keys, and 128 characters bound the names."""
MAX_PROMPT_CHARS: Final = 1_000_000
"""A payload bound that fails fast long before Redis or the tokenizer struggles."""
MAX_JOB_BYTES: Final = 8_000_000
"""Job payloads larger than this are refused before they are even parsed."""


def events_channel(request_id: str) -> str:
    """Name of the pub/sub channel that carries ``request_id``'s events."""
    return EVENTS_CHANNEL_PREFIX + request_id


def is_valid_request_id(request_id: object) -> bool:
    """True if ``request_id`` may be used as a request id (and so in key names)."""
    return isinstance(request_id, str) and REQUEST_ID_PATTERN.fullmatch(request_id) is not None


# --- Job payload -------------------------------------------------------------
class ChatMessage(msgspec.Struct, forbid_unknown_fields=True):
    """One chat message; the worker renders a list of them with the model's chat template."""

    role: str
    content: str


class SamplingOptions(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    """The subset of ``vllm.SamplingParams`` a request may set.

    ``None`` means vLLM's own default. Types are checked here; values (ranges,
    combinations) are checked by vLLM when the worker builds ``SamplingParams``,
    so both sides agree on what is valid without the producer importing vLLM.
    """

    max_tokens: int | None = None
    min_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    n: int | None = None
    stop: list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    skip_special_tokens: bool | None = None
    include_stop_str_in_output: bool | None = None
    stream_interval: int | None = None
    """Send a chunk every this many tokens (the first and last at once) instead of every
    token: less work per token for consumers that do not need each one."""

    def to_dict(self) -> dict[str, Any]:
        """The fields that were set, ready for ``SamplingParams(**...)``."""
        return {f: v for f in self.__struct_fields__ if (v := getattr(self, f)) is not None}


class GenerateRequest(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    """The payload of one job: what to generate and how.

    Exactly one of ``prompt`` (plain text) or ``messages`` (chat) is given.
    """

    request_id: str
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    model: str | None = None
    """The served model name the request is meant for; a worker serving another model
    refuses it (``invalid_request``) rather than answer with the wrong model."""
    sampling: SamplingOptions = msgspec.field(default_factory=SamplingOptions)
    timeout_s: float | None = None
    """Seconds from enqueue by which the request must be complete; when they pass it
    ends with finish reason ``timeout``."""
    queue_timeout_s: float | None = None
    """Seconds the request may wait in the queue; a worker that picks it up later ends
    it at once with finish reason ``queue_timeout``."""

    def __post_init__(self) -> None:
        if not is_valid_request_id(self.request_id):
            raise ValueError(
                f"request_id must match {REQUEST_ID_PATTERN.pattern} "
                f"(letters, digits, '._:-', at most 128 characters), got {self.request_id!r}"
            )
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of 'prompt' or 'messages'")
        if self.prompt is not None and not self.prompt:
            raise ValueError("prompt must not be empty")
        if self.messages is not None and not self.messages:
            raise ValueError("messages must not be empty")
        if self.model is not None and not self.model:
            raise ValueError("model must not be empty")
        for name in ("timeout_s", "queue_timeout_s"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"{name} must be positive, got {value}")
        size = len(self.prompt or "") + sum(len(m.content) for m in self.messages or ())
        if size > MAX_PROMPT_CHARS:
            raise ValueError(f"prompt is {size} characters; the limit is {MAX_PROMPT_CHARS}")


class InvalidRequest(ValueError):
    """A job payload that can never succeed; reported to the requester, never retried."""


def parse_request(raw: object) -> GenerateRequest:
    """Validate a decoded job argument into a ``GenerateRequest``.

    Raises ``InvalidRequest`` with a message meant for the requester.
    """
    try:
        return msgspec.convert(raw, GenerateRequest)
    except (msgspec.ValidationError, ValueError) as exc:
        raise InvalidRequest(str(exc)) from None


# --- Worker registry -------------------------------------------------------------
class WorkerRegistration(msgspec.Struct, forbid_unknown_fields=False, omit_defaults=True):
    """What a live worker tells producers: which model it serves on which queue.

    ``model`` is vLLM's served model name (``--served-model-name``, else ``--model``):
    the name OpenAI clients put in ``"model"``. Unknown fields are ignored, so later
    versions may add some."""

    worker_id: str
    model: str
    queue: str
    max_model_len: int | None = None
    v: int = PROTOCOL_VERSION


_registration_decoder = msgspec.json.Decoder(WorkerRegistration)


def encode_registration(registration: WorkerRegistration) -> bytes:
    """A registration's JSON: the same bytes on every renewal (it is the set member)."""
    return msgspec.json.encode(registration)


def decode_registration(data: bytes | str) -> WorkerRegistration:
    """Parse a registration (raises ``msgspec.DecodeError`` / ``ValidationError``)."""
    return _registration_decoder.decode(data)


# --- Events --------------------------------------------------------------------
class _Event(msgspec.Struct, tag_field="type", kw_only=True, forbid_unknown_fields=False):
    """Fields every event carries. ``seq`` is contiguous from 0 per request, across
    every event type, so a reader can detect gaps and duplicates."""

    v: int = PROTOCOL_VERSION
    request_id: str
    seq: int
    attempt: int = 1
    """Which run of the job produced the event: a request taken over after a worker
    failure goes on with ``attempt`` 2, 3, ... and the sequence numbers continue."""


class ChunkEvent(_Event, tag="chunk", kw_only=True):
    """One DELTA from the engine for completion ``index``.

    ``text`` may be empty while ``token_ids`` is not: byte-level tokens that do not
    yet form a whole UTF-8 character. ``finish_reason`` is set on the last chunk of
    that completion.
    """

    index: int = 0
    text: str
    token_ids: list[int]
    finish_reason: str | None = None


class FinalEvent(_Event, tag="final", kw_only=True):
    """The last event of a request that completed. ``finish_reasons[i]`` is that of
    completion ``i`` (one entry unless ``n > 1``)."""

    finish_reasons: list[str | None]
    prompt_tokens: int
    completion_tokens: int
    approximate: bool = False
    """True when a worker failure interrupted the request and its continuation may differ
    from an undisturbed run (sampling without a seed under presence or frequency
    penalties, or a regeneration that did not reproduce the tokens already sent)."""


class ErrorCode(enum.StrEnum):
    """Why a request failed: the ``code`` of its ``error`` event."""

    INVALID_REQUEST = "invalid_request"
    """The requester's fault (a malformed payload, values vLLM rejects); never retried."""
    WORKER_LOST = "worker_lost"
    """The worker running it died and the request cannot continue elsewhere (``n > 1``)."""
    RETRIES_EXHAUSTED = "retries_exhausted"
    """Every try of the job ended without an answer (workers died or handed it back)."""
    EXPIRED = "expired"
    """The job's payload was gone from Redis when a worker took it (expired or deleted)."""
    TIMEOUT = "timeout"
    """The job ran past the worker's hard limit per job (``job_timeout``)."""
    PUBLISH_FAILED = "publish_failed"
    """Redis refused the request's events for good (a permission, a wrong key type)."""
    INTERNAL = "internal"
    """A bug or an unexpected failure; the message says what."""


class ErrorEvent(_Event, tag="error", kw_only=True):
    """The last event of a request that failed; ``code`` is an ``ErrorCode`` value."""

    code: str
    message: str


Event = ChunkEvent | FinalEvent | ErrorEvent
TERMINAL_EVENTS: Final = (FinalEvent, ErrorEvent)

_event_encoder = msgspec.json.Encoder()
_event_decoder = msgspec.json.Decoder(Event)


def encode_event(event: Event) -> bytes:
    """Serialize an event to its JSON wire form."""
    return _event_encoder.encode(event)


def decode_event(data: bytes | str) -> Event:
    """Parse an event's JSON wire form (raises ``msgspec.DecodeError`` on bad input)."""
    return _event_decoder.decode(data)


# --- arq job serialization -----------------------------------------------------
_json_encoder = msgspec.json.Encoder(enc_hook=lambda obj: _encode_fallback(obj))


def _encode_fallback(obj: Any) -> Any:
    """arq stores exceptions as failed-job results; JSON gets their type and message."""
    if isinstance(obj, BaseException):
        return {"error": type(obj).__name__, "message": str(obj)}
    if isinstance(obj, (set, frozenset, tuple)):
        return list(obj)
    raise TypeError(f"cannot encode {type(obj).__name__} as JSON")


def serialize_job(data: Any) -> bytes:
    """arq ``job_serializer``: JSON instead of arq's default pickle."""
    return _json_encoder.encode(data)


BAD_PAYLOAD_MARKER: Final = "__streamq_bad_payload__"
"""Keyword argument of the synthetic job that ``deserialize_job`` makes from a
payload that is not a valid arq job, so the job function can report it."""
MAX_ENQUEUE_TRY: Final = 1000
"""Largest try number (``t``) a job payload may carry; a fresh job carries 1."""
EARLIEST_ENQUEUE_MS: Final = 946_684_800_000
"""2000-01-01T00:00:00Z in Unix ms: an earlier ``et`` is seconds, or garbage."""
MAX_ENQUEUE_AHEAD_MS: Final = 86_400_000
"""How far past the worker's clock ``et`` may lie (clock skew, with room to spare)."""
MAX_ARGS_DEPTH: Final = 32
"""Nesting levels allowed in a job's arguments; a request needs 3. Deeper JSON makes
``repr`` (arq logs every job's arguments) hit Python's recursion limit."""
_RESULT_FIELDS: Final = ("s", "r", "st", "ft", "q", "id")
"""Fields arq adds to a job's own when it stores the result; arq reads results
through the job deserializer too."""


class _JobEnvelope(msgspec.Struct):
    """The arq fields of a job payload, each of a type and range arq's ``run_job`` can
    use outside its error handling: any other value there would kill the worker's poll
    loop. Other fields are ignored."""

    t: int | None
    """``None`` is arq's own ``enqueue_job``'s way of saying 1."""
    f: str
    a: list[Any]
    k: dict[str, Any]
    et: int

    def __post_init__(self) -> None:
        if self.t is not None and not 1 <= self.t <= MAX_ENQUEUE_TRY:
            raise ValueError(f"`t` (the try number) must be 1 to {MAX_ENQUEUE_TRY}, got {_shorten(self.t)}")
        latest = int(time.time() * 1000) + MAX_ENQUEUE_AHEAD_MS
        if not EARLIEST_ENQUEUE_MS <= self.et <= latest:
            raise ValueError(
                f"`et` (the enqueue time) must be Unix milliseconds from 2000-01-01 to a day "
                f"from now, got {_shorten(self.et)}"
            )
        if self.f != JOB_FUNCTION:
            raise ValueError(f"unknown job function {_shorten(self.f)}; use {JOB_FUNCTION!r}")
        if self.k and not (self.k.keys() == {BAD_PAYLOAD_MARKER} and isinstance(self.k[BAD_PAYLOAD_MARKER], str)):
            raise ValueError("`k` must be {}: a job takes exactly one positional argument and no keywords")
        if _nests_deeper(self.a, MAX_ARGS_DEPTH):
            raise ValueError(f"`a` nests deeper than {MAX_ARGS_DEPTH} levels")


def deserialize_job(data: bytes) -> Any:
    """arq ``job_deserializer``: a JSON object whose arq fields arq can use, always.

    arq only logs a job it cannot decode (the requester would wait forever), and
    fields of the wrong type or range raise outside its error handling, killing the
    worker (and then each worker that claims the job next). So a payload that is not
    a valid job (``_JobEnvelope``) becomes a call of the job function carrying the
    reason, which publishes an ``invalid_request`` error on the channel of the job id
    (the request id), and arq records the job as failed. The upper bound of ``et`` is
    read from this machine's clock when the job is read; nothing else here depends on
    time. Never raises.
    """
    if len(data) > MAX_JOB_BYTES:
        return _bad_payload_job(f"job payload is {len(data)} bytes; the limit is {MAX_JOB_BYTES}")
    try:
        decoded = msgspec.json.decode(data)
    except msgspec.DecodeError as exc:
        return _bad_payload_job(f"job payload is not valid JSON: {exc}")
    except RecursionError:
        return _bad_payload_job("job payload is not valid JSON: it nests too deeply")
    if not isinstance(decoded, dict):
        return _bad_payload_job("job payload must be a JSON object")
    try:
        msgspec.convert(decoded, _JobEnvelope)
    except msgspec.ValidationError as exc:
        result_fields = {name: decoded[name] for name in _RESULT_FIELDS if name in decoded}
        return {**result_fields, **_bad_payload_job(f"job payload is not a valid arq job: {exc}")}
    return decoded


def _bad_payload_job(reason: str) -> dict[str, Any]:
    """A job that passes ``_JobEnvelope`` and makes the job function report ``reason``."""
    return {
        "t": 1,
        "f": JOB_FUNCTION,
        "a": [],
        "k": {BAD_PAYLOAD_MARKER: reason[:2000]},
        "et": int(time.time() * 1000),
    }


def _nests_deeper(value: object, limit: int) -> bool:
    """Whether ``value`` has lists or dicts nested more than ``limit`` levels (iterative:
    the point is to stay clear of the recursion limit)."""
    level: list[Any] = [value]
    for _ in range(limit):
        level = [
            child
            for container in level
            for child in (container if type(container) is list else container.values())
            if type(child) in (list, dict)
        ]
        if not level:
            return False
    return True


def _shorten(value: object) -> str:
    """``repr(value)``, cut short: job payloads are up to 8 MB."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
