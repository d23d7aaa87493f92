"""The JSON bodies on the wire: the request a job carries, the events of a request,
and a worker's registration, each with its encoder and decoder."""

from __future__ import annotations

from typing import Any, Final, TypedDict

import msgspec
from msgspec import UNSET, UnsetType

from streamq.protocol.names import (
    MAX_CALLBACK_URL_CHARS,
    MAX_PRIORITY,
    MAX_PROMPT_CHARS,
    MIN_PRIORITY,
    PROTOCOL_VERSION,
    REQUEST_ID_PATTERN,
    TENANT_PATTERN,
    is_valid_request_id,
)


# --- Job payload ---------------------------------------------------------------
class ChatMessage(msgspec.Struct, forbid_unknown_fields=True):
    """One chat message; the worker renders a list of them with the model's chat template."""

    role: str
    content: str


class StructuredOutputs(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    """vLLM's structured outputs (``vllm.sampling_params.StructuredOutputsParams``):
    exactly one constraint, which the engine enforces token by token."""

    json: dict[str, Any] | str | None = None
    """A JSON schema (an object, or its JSON text) the output must validate against."""
    regex: str | None = None
    """A regular expression the whole output must match (the dialect of vLLM's backend,
    e.g. no look-arounds)."""
    choice: list[str] | None = None
    """The output is exactly one of these strings."""
    grammar: str | None = None
    """An EBNF (GBNF / Lark) grammar."""
    json_object: bool | None = None
    """Any JSON object (OpenAI's ``response_format: {"type": "json_object"}``)."""

    def __post_init__(self) -> None:
        given = [f for f in ("json", "regex", "choice", "grammar", "json_object") if getattr(self, f) is not None]
        if len(given) != 1:
            raise ValueError(
                "structured_outputs takes exactly one of json, regex, choice, grammar, json_object; "
                f"got {given or 'none'}"
            )
        if self.choice is not None and not self.choice:
            raise ValueError("structured_outputs.choice must not be empty")
        if self.json_object is False:
            raise ValueError("structured_outputs.json_object must be true when given")
        if isinstance(self.json, str):
            try:
                msgspec.json.decode(self.json)
            except msgspec.DecodeError as exc:
                raise ValueError(f"structured_outputs.json is not valid JSON: {exc}") from None


class Sampling(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    """The subset of ``vllm.SamplingParams`` a request may set (its ``sampling`` object).

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
    logprobs: int | None = None
    """Log probabilities of each sampled token and of this many most likely ones (0: the
    sampled token's alone), carried in the chunk events."""
    prompt_logprobs: int | None = None
    """Log probabilities of the prompt's tokens (and this many most likely at each)."""
    structured_outputs: StructuredOutputs | None = None

    def to_dict(self) -> dict[str, Any]:
        """The fields that were set, ready for ``SamplingParams(**...)``."""
        return {f: v for f in self.__struct_fields__ if (v := getattr(self, f)) is not None}


class SamplingOptions(TypedDict, total=False):
    """``Sampling`` as keyword arguments (``submit(prompt, **sampling)``), so that an editor
    completes them and a type checker catches a typo. Spelled out because type checkers
    cannot derive it; a test fails when it and ``Sampling`` differ."""

    max_tokens: int | None
    min_tokens: int | None
    temperature: float | None
    top_p: float | None
    top_k: int | None
    min_p: float | None
    seed: int | None
    n: int | None
    stop: list[str] | None
    stop_token_ids: list[int] | None
    ignore_eos: bool | None
    presence_penalty: float | None
    frequency_penalty: float | None
    repetition_penalty: float | None
    skip_special_tokens: bool | None
    include_stop_str_in_output: bool | None
    stream_interval: int | None
    logprobs: int | None
    prompt_logprobs: int | None
    structured_outputs: StructuredOutputs | dict[str, Any] | None
    """A ``StructuredOutputs``, or its fields as a dict."""


class Callback(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    """Where to POST a request's summary when it ends: for services that cannot hold
    a subscription open."""

    url: str
    include_text: bool = True
    """Whether the summary carries the whole generated text."""

    def __post_init__(self) -> None:
        if not self.url.startswith(("http://", "https://")):
            raise ValueError(f"callback.url must be an http:// or https:// URL, got {self.url[:64]!r}")
        if len(self.url) > MAX_CALLBACK_URL_CHARS:
            raise ValueError(f"callback.url is {len(self.url)} characters; the limit is {MAX_CALLBACK_URL_CHARS}")


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
    sampling: Sampling = msgspec.field(default_factory=Sampling)
    timeout_s: float | None = None
    """Seconds from enqueue by which the request must be complete; when they pass it
    ends with finish reason ``timeout``."""
    queue_timeout_s: float | None = None
    """Seconds the request may wait in the queue; a worker that picks it up later ends
    it at once with finish reason ``queue_timeout``."""
    priority: int = 0
    """Lower runs sooner, as in vLLM: workers take the most urgent waiting job first
    (first come, first served within a priority) and the engine schedules by it too."""
    tenant: str | None = None
    """Whose request this is: within a priority, workers take turns between tenants
    with waiting jobs (``DEFAULT_TENANT`` when absent)."""
    callback: Callback | None = None
    stream: bool = True
    """Whether someone follows the request token by token. ``False`` for a request whose
    only consumer is its end (a batch line, a ``stream: false`` call, a callback): the
    worker asks the engine for no per-token output and writes the tokens in checkpoints
    (every ``DEFAULT_CHECKPOINT_TOKENS`` tokens, as the worker sets) and at the end; the
    events are the same kinds, fewer and larger."""

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
        if not MIN_PRIORITY <= self.priority <= MAX_PRIORITY:
            raise ValueError(f"priority must be a 32-bit integer, got {self.priority}")
        if self.tenant is not None and TENANT_PATTERN.fullmatch(self.tenant) is None:
            raise ValueError(
                f"tenant must match {TENANT_PATTERN.pattern} (letters, digits, '._-', at most 64 characters), "
                f"got {self.tenant!r}"
            )
        size = len(self.prompt or "") + sum(len(m.content) for m in self.messages or ())
        if size > MAX_PROMPT_CHARS:
            raise ValueError(f"prompt is {size} characters; the limit is {MAX_PROMPT_CHARS}")


class StreamqError(Exception):
    """Base of the errors streamq raises to its users. Defined with the wire contract
    because ``InvalidRequest``, which ``parse_request`` raises, is one of them."""

    request_id: str | None = None
    """The request the error is about, where one is known (every error of ``generate_many``)."""


class InvalidRequest(StreamqError, ValueError):
    """A job payload that can never succeed; reported to the requester, never retried.
    A ``ValueError`` too: a bad argument, refused before anything is sent."""


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
    slots: int | None = None
    """Requests the worker runs at once (its engine's ``max_num_seqs``, or ``--max-jobs``): what
    a batch keeps in flight for it."""
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


LOGPROB_FLOOR: Final = -9999.0
"""What a log probability of ``-inf`` is sent as (JSON has no infinity; OpenAI's value)."""


class TopLogprob(msgspec.Struct, array_like=True, frozen=True):
    """One of the most likely tokens at a position; a JSON array ``[token_id, token, logprob]``."""

    token_id: int
    token: str
    """The token's text as vLLM decodes it alone (a byte-level piece may be ``\ufffd``)."""
    logprob: float


class TokenLogprob(msgspec.Struct, array_like=True, frozen=True):
    """The log probability of one token (sampled, or of the prompt) and the most likely
    tokens at its position; a JSON array ``[logprob, rank, token, top]``, compact since
    a chunk carries one per token."""

    logprob: float
    rank: int
    """1 for the most likely token in the vocabulary, 2 for the next, ..."""
    token: str
    top: list[TopLogprob]
    """The ``logprobs`` most likely tokens, most likely first (the sampled one among
    them when it ranks that high); empty for ``logprobs: 0``."""


class ChunkEvent(_Event, tag="chunk", kw_only=True):
    """One DELTA from the engine for completion ``index``.

    ``text`` may be empty while ``token_ids`` is not: byte-level tokens that do not
    yet form a whole UTF-8 character. ``finish_reason`` is set on the last chunk of
    that completion. The logprob fields are absent from the JSON unless asked for.
    """

    index: int = 0
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    logprobs: list[TokenLogprob] | UnsetType = UNSET
    """One per entry of ``token_ids``, when the request set ``sampling.logprobs``."""
    prompt_logprobs: list[TokenLogprob | None] | UnsetType = UNSET
    """One per prompt token (``None`` for the first, which has nothing before it), on the
    request's first chunk, when the request set ``sampling.prompt_logprobs``."""
    prompt_token_ids: list[int] | UnsetType = UNSET
    """The prompt's tokens (after the chat template), with ``prompt_logprobs``."""


class FinalEvent(_Event, tag="final", kw_only=True):
    """The last event of a request that completed. ``finish_reasons[i]`` is that of
    completion ``i`` (one entry unless ``n > 1``)."""

    finish_reasons: list[str | None]
    prompt_tokens: int
    completion_tokens: int
    worker: str | None = None
    """The id of the worker that ran the request to its end (absent when it ended in the
    queue: cancelled or timed out there): follow-ups of a conversation that keep finding
    the same worker are reusing its prefix cache (docs/features/prefix-aware-pickup.md)."""


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
