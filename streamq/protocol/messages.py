"""The JSON bodies on the wire: the request a job carries, the events of a request,
and a worker's registration, each with its encoder and decoder."""

from __future__ import annotations

from collections.abc import Collection
from typing import Any, Final, Literal, TypedDict

import msgspec
from msgspec import UNSET, UnsetType

from streamq.protocol.names import (
    MAX_CACHE_SALT_CHARS,
    MAX_CALLBACK_URL_CHARS,
    MAX_POOLING_INPUTS,
    MAX_PRIORITY,
    MAX_PROMPT_CHARS,
    MAX_PROMPT_TOKEN_IDS,
    MIN_PRIORITY,
    PROTOCOL_VERSION,
    REQUEST_ID_PATTERN,
    TENANT_PATTERN,
    is_valid_request_id,
)


# --- Job payload ---------------------------------------------------------------
class ChatMessage(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    """One chat message; the worker renders a list of them with the model's chat template.

    An assistant turn that called tools has ``tool_calls`` (OpenAI's objects, as the
    response gave them) and may have no ``content``; a tool's answer names the call it
    answers (``tool_call_id``)."""

    role: str
    content: str | None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    name: str | None = None
    reasoning: str | None = None
    """An assistant turn's reasoning, sent back for templates that interleave it."""

    @property
    def text(self) -> str:
        """What the message says: its reasoning, content and tool calls as JSON (for size
        bounds and prefix keys)."""
        calls = msgspec.json.encode(self.tool_calls).decode() if self.tool_calls else ""
        return (self.reasoning or "") + (self.content or "") + calls

    def template_fields(self) -> dict[str, Any]:
        """The message as a chat template reads it, as vLLM hands it over: the fields it
        has, no content as empty text, reasoning also as ``reasoning_content``."""
        fields: dict[str, Any] = msgspec.to_builtins(self)
        if self.content is None:
            fields["content"] = ""
        if self.reasoning is not None:
            fields["reasoning_content"] = self.reasoning
        return fields


class ToolOptions(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    """A chat request's tools, as OpenAI's (and ``vllm serve``'s) fields of these names:
    the worker renders them with the messages, constrains named and required calls with
    vLLM's grammar, and parses calls out of the output with its tool parser."""

    tools: list[dict[str, Any]]
    """OpenAI ``{"type": "function", "function": {...}}`` objects."""
    tool_choice: str | dict[str, Any] | None = None
    """``none``, ``auto`` (the default with tools), ``required`` or a named function."""
    parallel_tool_calls: bool | None = None
    """``false``: at most one call per completion."""

    def __post_init__(self) -> None:
        if not self.tools:
            raise ValueError("`tools` must not be an empty array")


class ChatTemplateOptions(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    """How the worker renders a request's messages with the model's chat template, as
    ``vllm serve``'s request fields of the same names say."""

    add_generation_prompt: bool = True
    """End with the template's prompt for the assistant's turn."""
    continue_final_message: bool = False
    """Leave the last message open, for the model to continue it (not with
    ``add_generation_prompt``)."""
    documents: list[dict[str, str]] | None = None
    """Documents for a template that supports them (retrieval)."""
    kwargs: dict[str, Any] | None = None
    """More variables for the template (``chat_template_kwargs``); those the template does
    not use are dropped, as vLLM drops them."""

    def __post_init__(self) -> None:
        if self.add_generation_prompt and self.continue_final_message:
            raise ValueError("Cannot set both `continue_final_message` and `add_generation_prompt` to True.")
        if self.kwargs is not None and (unexpected := {"chat_template", "tokenize"} & self.kwargs.keys()):
            raise ValueError(f"Found unexpected chat template kwargs from request: {unexpected}")


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
    spaces_between_special_tokens: bool | None = None
    logit_bias: dict[str, float] | None = None
    """Added to the logits of these token ids (the object's keys, in decimal, as JSON
    spells them) before sampling, clamped to -100..100 as ``vllm serve`` clamps it."""
    allowed_token_ids: list[int] | None = None
    """Only these token ids may be sampled."""
    bad_words: list[str] | None = None
    """Words that may not be generated."""
    watermarking: bool | None = None
    """vLLM's output watermark."""
    thinking_token_budget: int | None = None
    """The most tokens a reasoning model may spend thinking."""
    repetition_detection: dict[str, int] | None = None
    """vLLM's ``RepetitionDetectionParams`` (``max_pattern_size``, ``min_pattern_size``,
    ``min_count``): end a completion that repeats itself."""
    extra_args: dict[str, Any] | None = None
    """Arguments for the engine's custom extensions (``vllm_xargs``)."""
    stream_interval: int | None = None
    """Send a chunk every this many tokens (the first and last at once) instead of every
    token: less work per token for consumers that do not need each one."""
    logprobs: int | None = None
    """Log probabilities of each sampled token and of this many most likely ones (0: the
    sampled token's alone), carried in the chunk events."""
    prompt_logprobs: int | None = None
    """Log probabilities of the prompt's tokens (and this many most likely at each)."""
    logprob_token_ids: list[int] | None = None
    """Log probabilities of these tokens at each position, beside the sampled token's
    (instead of the most likely ones): a token logprob's ``top`` lists them in the
    engine's order."""
    structured_outputs: StructuredOutputs | None = None

    def __post_init__(self) -> None:
        if self.logit_bias is not None and not all(key.isdigit() for key in self.logit_bias):
            raise ValueError("logit_bias keys must be token ids (decimal integers)")

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
    spaces_between_special_tokens: bool | None
    logit_bias: dict[str, float] | None
    allowed_token_ids: list[int] | None
    bad_words: list[str] | None
    watermarking: bool | None
    thinking_token_budget: int | None
    repetition_detection: dict[str, int] | None
    extra_args: dict[str, Any] | None
    stream_interval: int | None
    logprobs: int | None
    prompt_logprobs: int | None
    logprob_token_ids: list[int] | None
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


POOLING_TASKS: Final = ("embed", "classify")
"""The pooling tasks a request may name (vLLM's ``PoolingTask`` names): one vector per input."""


class Pooling(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    """What a pooling request asks of a pooling model (``vllm.PoolingParams``): the task is
    always named, since vLLM's default (``token_embed``) is one vector per token."""

    task: Literal["embed", "classify"] = "embed"
    dimensions: int | None = None
    """Keep this many of the embedding's dimensions (a Matryoshka model), as vLLM's field."""
    use_activation: bool | None = None
    """Apply the pooler's activation (normalize an embedding, softmax the class scores);
    absent: the model's default (yes), as vLLM's field."""

    def __post_init__(self) -> None:
        if self.dimensions is not None and self.dimensions < 1:
            raise ValueError(f"dimensions must be positive, got {self.dimensions}")


class GenerateRequest(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    """The payload of one job: what to generate and how.

    Exactly one of ``prompt`` (plain text), ``prompt_token_ids``, ``messages`` (chat) or,
    for a pooling model, ``inputs`` (with ``pooling``) is given.
    """

    request_id: str
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    """A prompt already tokenized for the model (what evaluation harnesses send): given to
    the engine as it is, no special tokens added."""
    messages: list[ChatMessage] | None = None
    chat_options: ChatTemplateOptions | None = None
    """How ``messages`` are rendered (absent: as ``vllm serve`` renders them by default)."""
    tools: ToolOptions | None = None
    """Tools the model may call (with ``messages``)."""
    model: str | None = None
    """The served model name the request is meant for; a worker serving another model
    refuses it (``invalid_request``) rather than answer with the wrong model."""
    sampling: Sampling = msgspec.field(default_factory=Sampling)
    deadline_s: float | None = None
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
    add_special_tokens: bool | None = None
    """Whether the tokenizer adds its special tokens (e.g. BOS) to a text prompt (default:
    yes) or to the rendered chat template (default: no, the template holds them), as
    vLLM's field of the name."""
    echo: bool = False
    """Send the prompt back: the request's first chunk carries ``prompt_echo`` (its text,
    a token-id prompt decoded) and ``prompt_token_ids``, so that a reader can answer
    OpenAI's ``echo`` (and ``return_token_ids``)."""
    return_prompt_token_ids: bool = False
    """Send the prompt's token ids back (without its text, which ``echo`` adds): the request's
    first chunk carries ``prompt_token_ids``, so that a reader can answer OpenAI's
    ``return_token_ids``, or count the prompt's tokens from the first chunk on."""
    truncate_prompt_tokens: int | None = None
    """Keep only this many of the prompt's tokens (after the chat template); ``-1``: as many
    as the model's context less one, as ``vllm serve``'s field of the name."""
    truncation_side: Literal["left", "right"] | None = None
    """With ``truncate_prompt_tokens``: ``left`` keeps the last tokens, ``right`` the first
    (absent: the tokenizer's side)."""
    cache_salt: str | None = None
    """Isolates the request's prefix cache: only requests with the same salt share cached
    blocks (vLLM's prompt field of the name)."""
    include_reasoning: bool = True
    """With ``messages``, on a worker with a reasoning parser: ``false`` drops the reasoning
    from the parsed output, as ``vllm serve``'s field of the name."""
    reasoning_per_chunk: bool = False
    """With ``messages``, on a worker with a reasoning parser: every parsed chunk counts its
    completion's reasoning tokens so far (``parsed.reasoning_tokens``), not only the last,
    for a reader that puts usage in every chunk (``stream_options.continuous_usage_stats``)."""
    inputs: list[str | list[int]] | None = None
    """A pooling request's inputs, each a text or a token-id list: every one goes through the
    engine (as ``vllm serve`` splits a list), and their results come back together in one
    ``pooled`` event before the final event."""
    pooling: Pooling | None = None
    """Given with ``inputs``: the pooling task and its options."""

    def __post_init__(self) -> None:
        if not is_valid_request_id(self.request_id):
            raise ValueError(
                f"request_id must match {REQUEST_ID_PATTERN.pattern} "
                f"(letters, digits, '._:-', at most 128 characters), got {self.request_id!r}"
            )
        given = [f for f in ("prompt", "prompt_token_ids", "messages", "inputs") if getattr(self, f) is not None]
        if len(given) != 1:
            raise ValueError(
                f"give exactly one of 'prompt', 'prompt_token_ids', 'messages' or 'inputs', got {given or 'none'}"
            )
        if (self.inputs is None) != (self.pooling is None):
            raise ValueError("'inputs' and 'pooling' go together: a pooling request gives both")
        if self.inputs is not None:
            _check_pooling_request(self)
        if self.prompt is not None and not self.prompt:
            raise ValueError("prompt must not be empty")
        if self.prompt_token_ids is not None:
            if not self.prompt_token_ids:
                raise ValueError("prompt_token_ids must not be empty")
            if len(self.prompt_token_ids) > MAX_PROMPT_TOKEN_IDS:
                raise ValueError(
                    f"prompt_token_ids holds {len(self.prompt_token_ids)} tokens; the limit is {MAX_PROMPT_TOKEN_IDS}"
                )
            if min(self.prompt_token_ids) < 0:
                raise ValueError("prompt_token_ids must not be negative")
        if self.messages is not None and not self.messages:
            raise ValueError("messages must not be empty")
        if self.chat_options is not None and self.messages is None:
            raise ValueError("chat_options apply to messages only")
        if self.tools is not None and self.messages is None:
            raise ValueError("tools apply to messages only")
        if self.add_special_tokens is not None and self.prompt_token_ids is not None:
            raise ValueError("add_special_tokens applies to text prompts and messages, not token ids")
        if self.truncate_prompt_tokens is not None and self.truncate_prompt_tokens < -1:
            raise ValueError(f"truncate_prompt_tokens must be -1 or more, got {self.truncate_prompt_tokens}")
        if self.cache_salt is not None:
            check_cache_salt(self.cache_salt)
        if not self.include_reasoning and self.messages is None:
            raise ValueError("include_reasoning applies to messages only")
        if self.reasoning_per_chunk and self.messages is None:
            raise ValueError("reasoning_per_chunk applies to messages only")
        if self.model is not None and not self.model:
            raise ValueError("model must not be empty")
        for name in ("deadline_s", "queue_timeout_s"):
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
        size = len(self.prompt or "") + sum(len(m.text) for m in self.messages or ())
        size += sum(len(i) for i in self.inputs or () if isinstance(i, str))
        if size > MAX_PROMPT_CHARS:
            raise ValueError(f"prompt is {size} characters; the limit is {MAX_PROMPT_CHARS}")


def _check_pooling_request(request: GenerateRequest) -> None:
    """Refuse a pooling request's inputs that can never run, and generation's fields on it."""
    inputs = request.inputs or []
    if not inputs:
        raise ValueError("inputs must not be empty")
    if len(inputs) > MAX_POOLING_INPUTS:
        raise ValueError(f"inputs holds {len(inputs)} inputs; the limit is {MAX_POOLING_INPUTS}")
    for index, item in enumerate(inputs):
        if isinstance(item, list):
            if not item:
                raise ValueError(f"inputs[{index}] is an empty token-id list")
            if len(item) > MAX_PROMPT_TOKEN_IDS or min(item) < 0:
                raise ValueError(f"inputs[{index}]: token ids must be 0 or more, at most {MAX_PROMPT_TOKEN_IDS}")
    generation = {
        "sampling": request.sampling != Sampling(),
        "echo": request.echo,
        "return_prompt_token_ids": request.return_prompt_token_ids,
        "truncation_side": request.truncation_side is not None,
    }
    if given := [name for name, set_ in generation.items() if set_]:
        raise ValueError(f"a pooling request takes no generation fields, got {', '.join(given)}")


def check_cache_salt(salt: str) -> None:
    """Raise ``ValueError`` for a cache salt vLLM would refuse."""
    if not salt or len(salt) > MAX_CACHE_SALT_CHARS or set(salt) & set("@/\\\0"):
        raise ValueError(f"cache_salt must be 1 to {MAX_CACHE_SALT_CHARS} characters, none of '@', '/', '\\' or NUL")


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
class AdapterCard(msgspec.Struct, frozen=True, forbid_unknown_fields=False, omit_defaults=True):
    """A LoRA adapter a worker serves beside its base model, as ``vllm serve`` lists it."""

    name: str
    """The model name requests give to run under the adapter."""
    path: str
    """Where the worker loaded it from (``/v1/models``' ``root``, as vllm serve shows it)."""


def task_refusal(tasks: Collection[str], pooling: Pooling | None) -> str | None:
    """vLLM's words for a request that an engine running ``tasks`` cannot run: generation
    on a pooling model, pooling on a model that generates, a pooling task it lacks;
    ``None`` where it can. One rule for the producer, which refuses before enqueue, and the
    worker, which refuses what reached it all the same (from a producer in another
    language, or routed before the model's workers changed)."""
    if pooling is None:
        return None if "generate" in tasks else "This model does not support generation"
    if not set(tasks) - {"generate"}:
        return "This model does not support pooling"
    if pooling.task not in tasks:
        return f"Unsupported task: {pooling.task!r} Supported tasks: {', '.join(sorted(tasks))}"
    return None


class WorkerRegistration(msgspec.Struct, forbid_unknown_fields=False, omit_defaults=True):
    """What a live worker tells producers: which models it serves on which queue.

    ``model`` is vLLM's served model name (``--served-model-name``, else ``--model``):
    the name OpenAI clients put in ``"model"``; each of ``adapters`` is a model too, on the
    same queue. Unknown fields are ignored, so later versions may add some."""

    worker_id: str
    model: str
    queue: str
    max_model_len: int | None = None
    slots: int | None = None
    """Requests the worker runs at once (its engine's ``max_num_seqs``, or ``--max-jobs``): what
    a batch keeps in flight for it."""
    adapters: tuple[AdapterCard, ...] = ()
    """The LoRA adapters it serves: its ``--lora-modules`` and those it loaded at run time."""
    loads_adapters: bool = False
    """Whether it loads adapters it does not list yet, by name (vLLM's LoRA resolvers): a
    request for a model no worker lists goes to its queue."""
    tasks: tuple[str, ...] = ()
    """What its engine runs, by vLLM's task names (``generate``; ``embed``, ``classify``, ...
    for a pooling model); empty: ``generate`` (a worker that does not list them)."""
    pooled_size: int | None = None
    """A pooling model's values per input at most (its hidden size): what bounds a pooling
    request's results (``MAX_POOLED_BYTES``) before it is enqueued."""
    v: int = PROTOCOL_VERSION

    @property
    def engine_tasks(self) -> tuple[str, ...]:
        """What its engine runs (``generate``, ``embed``, ...), ``generate`` where unlisted."""
        return self.tasks or ("generate",)

    def serves(self, model: str) -> bool:
        """Whether ``model`` is this worker's base model or one of its listed adapters."""
        return model == self.model or any(adapter.name == model for adapter in self.adapters)

    def models(self) -> list[str]:
        """The base model's name, then its adapters'."""
        return [self.model, *(adapter.name for adapter in self.adapters)]


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


class PromptEcho(msgspec.Struct, frozen=True):
    """A request's prompt as the worker gave it to the engine, sent back for ``echo``."""

    text: str
    """The prompt's text: a text prompt as it was sent, a token-id prompt decoded (with its
    special tokens, as ``vllm serve`` decodes it for ``echo``)."""
    first_token: str
    """The first prompt token's text alone: the one prompt position without logprobs,
    whose text OpenAI's ``echo`` with ``logprobs`` still lists."""


class ParsedOutput(msgspec.Struct, frozen=True, omit_defaults=True):
    """A chat completion's output as the worker's tool and reasoning parsers read it
    (vLLM's own parsers, run as ``vllm serve`` runs them), on the chunk it belongs to."""

    message: dict[str, Any] | None
    """A streamed request: this chunk's delta (vLLM's ``DeltaMessage``: ``content``,
    ``reasoning``, ``tool_calls`` deltas), ``None`` where the parser holds the text back.
    A request not streamed: on its completion's last chunk, the whole message
    (``content``, ``reasoning``, ``tool_calls`` with their ids)."""
    finish_reason: str | None = None
    """``tool_calls`` where ``vllm serve`` reports it instead of the engine's reason."""
    reasoning_tokens: int | None = None
    """On a completion's last chunk (on every chunk, for a request with
    ``reasoning_per_chunk``), on a worker with a reasoning parser: how many of its tokens so
    far were reasoning (usage's ``completion_tokens_details``)."""


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
    """The prompt's tokens (after the chat template), with ``prompt_logprobs`` or ``prompt_echo``."""
    prompt_echo: PromptEcho | UnsetType = UNSET
    """The prompt as text, on the request's first chunk, when the request set ``echo``."""
    parsed: ParsedOutput | UnsetType = UNSET
    """A chat request on a worker with a tool or reasoning parser: what it made of the text."""


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


class PooledEvent(_Event, tag="pooled", kw_only=True):
    """A pooling request's results, every input's, just before its final event.

    On the wire it is a JSON line (these fields but ``data``), a newline, then ``data``: the
    results packed as little-endian ``dtype``, input after input, each of the shape in
    ``shapes`` (a 1,024-value embedding is 4 KiB, not ~20 KB of JSON numbers). JSON never
    holds a raw newline, so any reader splits at the first one."""

    dtype: str = "float32"
    shapes: list[list[int]]
    """Per input, its result's shape (one dimension for ``embed`` and ``classify``)."""
    prompt_tokens: list[int]
    """Per input, its tokens as the engine ran it (after truncation)."""
    data: bytes | UnsetType = UNSET
    """The packed results (carried after the JSON line, never inside it)."""


class ErrorEvent(_Event, tag="error", kw_only=True):
    """The last event of a request that failed; ``code`` is an ``ErrorCode`` value."""

    code: str
    message: str


Event = ChunkEvent | PooledEvent | FinalEvent | ErrorEvent
TERMINAL_EVENTS: Final = (FinalEvent, ErrorEvent)

_event_encoder = msgspec.json.Encoder()
_event_decoder = msgspec.json.Decoder(Event)


def encode_event(event: Event) -> bytes:
    """Serialize an event to its wire form: JSON, and for a ``PooledEvent`` its packed
    results after a newline."""
    if isinstance(event, PooledEvent) and isinstance(event.data, bytes):
        return b"%b\n%b" % (_event_encoder.encode(msgspec.structs.replace(event, data=UNSET)), event.data)
    return _event_encoder.encode(event)


def event_json(event: Event) -> str:
    """An event as JSON text alone, for people and logs: a ``PooledEvent`` without its data."""
    if isinstance(event, PooledEvent):
        event = msgspec.structs.replace(event, data=UNSET)
    return _event_encoder.encode(event).decode()


def decode_event(data: bytes | str) -> Event:
    """Parse an event's wire form (raises ``msgspec.DecodeError`` on bad input)."""
    if isinstance(data, bytes) and (end := data.find(b"\n")) >= 0:
        event = _event_decoder.decode(data[:end])
        if not isinstance(event, PooledEvent):
            raise msgspec.DecodeError("only a pooled event carries data after its JSON")
        event.data = data[end + 1 :]
        return event
    return _event_decoder.decode(data)
