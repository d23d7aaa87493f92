"""The producer library: submit prompts to streamq and follow their tokens.

    async with StreamqClient.connect() as client:  # $REDIS_URL, $STREAMQ_QUEUE
        completion = await client.generate("The key to happiness is", max_tokens=32)
        print(completion.text)

        async with await client.submit("Once upon a time", max_tokens=32) as handle:
            async for event in handle:
                if isinstance(event, ChunkEvent):
                    print(event.text, end="", flush=True)

``submit`` subscribes to the request's channel before it enqueues the job, so no
event can be missed; ``follow`` joins a request later and replays its log first.
Every error is a ``StreamqError``. Imports neither vllm nor torch.
"""

from __future__ import annotations

import asyncio
import difflib
import time
import uuid
from collections.abc import (
    AsyncGenerator,
    AsyncIterable,
    AsyncIterator,
    Iterable,
    Mapping,
    Sequence,
)
from types import TracebackType
from typing import Any, Final, Literal, Self, TypedDict, Unpack, cast, overload

import msgspec
from arq.connections import ArqRedis
from redis.asyncio.cluster import RedisCluster
from redis.exceptions import RedisError

from producer.connecting import Connecting
from producer.errors import (
    ConnectionFailed,
    DuplicateRequest,
    InvalidParameter,
    NoLiveWorker,
    QueueFull,
    UnknownModel,
    redis_errors_as_streamq_errors,
)
from producer.handle import DIGEST_PATTERN, Completion, RequestHandle, Usage, event_digest
from producer.pooled import Pooled, check_task
from producer.pooled import inputs_of as _inputs_of
from producer.sharded_subscriber import ShardedEventSubscriber
from producer.status import StatusReader
from producer.subscriber import EventSubscriber, Inbox
from streamq.broker.callback_schedule import CallbackSchedule
from streamq.broker.connection import (
    close_pool,
    create_pool,
    redis_settings_for,
)
from streamq.broker.data_plane import DataRedis, close_data_plane, connect_data_plane
from streamq.broker.durability import PublishedDurability
from streamq.broker.memory_policy import eviction_cause, read_memory_policy
from streamq.broker.registry import Routes, WorkerRegistry
from streamq.broker.replay_log import ReplayLog
from streamq.broker.replies import as_text
from streamq.environment import (
    affinity_window_from_env,
    check_events_url,
    declared_models_from_env,
    events_url_from_env,
    model_memory_from_env,
    queue_from_env,
    redis_url_from_env,
)
from streamq.protocol import (
    IN_PROGRESS_PREFIX,
    JOB_EXPIRY_MS,
    JOB_FUNCTION,
    JOB_KEY_PREFIX,
    LOG_TTL_MS,
    MAX_JOB_BYTES,
    RESULT_KEY_PREFIX,
    WORKER_RENEW_S,
    Callback,
    ChatMessage,
    ChatTemplateOptions,
    FinalEvent,
    FinishReason,
    GenerateRequest,
    InvalidRequest,
    Pooling,
    SamplingOptions,
    StreamqError,
    ToolOptions,
    callback_key,
    deserialize_job,
    parse_request,
    serialize_job,
)
from streamq.protocol.affinity import affinity_keys, check_affinity_key, under_adapter
from streamq.protocol.names import (
    AFFINITY_BALANCE_FRACTION,
    AFFINITY_BALANCE_SLACK,
    AFFINITY_FREE_TTL_MS,
    DEFAULT_TENANT,
    MAX_AFFINITY_WINDOW_MS,
    REQUEST_RESERVATION_PREFIX,
    cancelled_key,
)
from streamq.protocol.script_calls import Cancel, Enqueue
from streamq.protocol.scripts import Script
from streamq.protocol.status import RequestState, RequestStatus
from streamq.redaction import redact_url

__all__ = [
    "Completion",
    "Connecting",
    "RequestHandle",
    "RequestOptions",
    "SamplingOptions",
    "StreamqClient",
    "Usage",
    "event_digest",
]

DEFAULT_CONNECT_TIMEOUT_S = 5.0
"""How long ``connect`` tries before it raises ``ConnectionFailed``."""


class ConnectOptions(TypedDict, total=False):
    """``connect``'s keyword arguments (its docstring says what each does)."""

    events_url: str | None
    queue: str | None
    max_queue_depth: int | None
    silence_check_s: float
    affinity_window_s: float | None
    model_memory_s: float | None
    declared_models: Mapping[str, str | None] | Iterable[str] | None
    connect_timeout_s: float | None


class PoolOptions(TypedDict, total=False):
    """The request's own keyword arguments that every request takes, a pooling one too
    (``embed``'s and ``classify``'s beside their own); ``submit`` says what each does."""

    request_id: str | None
    model: str | None
    deadline_s: float | None
    queue_timeout_s: float | None
    callback: Callback | dict[str, Any] | None
    priority: int
    tenant: str | None
    defer_s: float
    affinity_key: str | None
    affinity: bool
    add_special_tokens: bool | None
    truncate_prompt_tokens: int | None
    cache_salt: str | None


class RequestOptions(SamplingOptions, PoolOptions, total=False):
    """``submit``'s and ``generate``'s keyword arguments beside the prompt, spelled once:
    the request's own (``PoolOptions`` and those below; ``submit`` says what each does) and
    ``SamplingOptions``, so that an editor completes them and a type checker catches a typo."""

    messages: Sequence[ChatMessage | dict[str, Any]] | None
    echo: bool
    chat_options: ChatTemplateOptions | dict[str, Any] | None
    tools: ToolOptions | dict[str, Any] | None
    return_prompt_token_ids: bool
    truncation_side: Literal["left", "right"] | None
    include_reasoning: bool
    reasoning_per_chunk: bool
    inputs: Sequence[str | Sequence[int]]
    pooling: Pooling | dict[str, Any]


REQUEST_OPTION_NAMES: Final = RequestOptions.__optional_keys__ - SamplingOptions.__optional_keys__
"""The request's own options: every other keyword of ``submit`` is a sampling option."""

DEFAULT_SILENCE_CHECK_S = 15.0
ROUTES_FRESH_S = 1.0
"""How long ``submit`` reuses a registry read that showed its model live. The registry
itself keeps a dead worker listed for up to ``WORKER_TTL_MS`` (10 s), so a second more
hides nothing that matters."""


class _HandleSource:
    """The ``RequestSource`` of a client's handles (``producer.handle``): its replay log,
    its view of the job, its subscriber, its cancel."""

    def __init__(self, client: StreamqClient) -> None:
        self._client = client

    @property
    def silence_check_s(self) -> float:
        return self._client.silence_check_s

    async def read_log(self, request_id: str, from_seq: int) -> list[bytes]:
        return await self._client._log.read(request_id, from_seq)

    async def job_state(self, request_id: str, queue: str | None) -> RequestState:
        return await self._client._job_state(request_id, queue)

    async def end_queued(self, request_id: str, queue: str, reason: FinishReason) -> RequestState:
        return await self._client._end_queued(request_id, queue, reason)

    async def eviction_cause(self) -> str | None:
        return await eviction_cause(self._client._redis)

    async def unfollow(self, request_id: str, inbox: Inbox) -> None:
        await self._client._subscriber.unsubscribe(self._client._log.names.events(request_id), inbox)

    async def cancel(self, request_id: str, *, queue: str | None = None) -> RequestState:
        return await self._client.cancel(request_id, queue=queue)


class StreamqClient:
    """Submits requests to a streamq queue, follows and cancels them.

    ``connect()`` opens one; used as ``async with``, it is closed on exit."""

    def __init__(
        self,
        redis: ArqRedis,
        *,
        data: DataRedis | None = None,
        queue: str | None = None,
        max_queue_depth: int | None = None,
        silence_check_s: float = DEFAULT_SILENCE_CHECK_S,
        affinity_window_s: float | None = None,
        model_memory_s: float | None = None,
        declared_models: Mapping[str, str | None] | Iterable[str] | None = None,
    ) -> None:
        """A client on an open pool (``connect`` opens one); ``queue`` and the rest as in
        ``connect``; ``data``: the data plane's client, when a Redis Cluster carries the events."""
        if max_queue_depth is not None and max_queue_depth < 0:
            raise ValueError(f"max_queue_depth must be >= 0, got {max_queue_depth}")
        if affinity_window_s is None:
            affinity_window_s = affinity_window_from_env()
        most_s = MAX_AFFINITY_WINDOW_MS / 1000
        if not (isinstance(affinity_window_s, int | float) and 0 <= affinity_window_s <= most_s):
            raise ValueError(f"affinity_window_s must be 0 to {most_s:g} seconds, got {affinity_window_s!r}")
        self.affinity_window_s = affinity_window_s
        """How long a request is held for the worker that served its prefix before any
        worker may take it (docs/features/prefix-aware-pickup.md); 0 turns prefix-aware pickup off."""
        if model_memory_s is None:
            model_memory_s = model_memory_from_env()
        if not (isinstance(model_memory_s, int | float) and model_memory_s >= 0):
            raise ValueError(f"model_memory_s must be a number of seconds >= 0, got {model_memory_s!r}")
        self.model_memory_s = model_memory_s
        """How long after its last live worker a model still takes requests: they wait in its
        queue for the next worker to start (scale to zero). Past it, ``NoLiveWorker``."""
        self._redis = redis
        self.silence_check_s = silence_check_s
        """After this many seconds without an event, a handle checks that its request is
        still queued or running (one round trip) and fails with ``RequestLost`` if not."""
        self.queue = queue_from_env() if queue is None else queue
        """Where requests without a ``model`` go."""
        if declared_models is None:
            declared_models = declared_models_from_env()
        elif not isinstance(declared_models, Mapping):
            declared_models = dict.fromkeys(declared_models)
        self.declared_models: dict[str, str] = {name: q or self.queue for name, q in declared_models.items()}
        """Model name -> queue of the models that take requests while none of their workers is
        alive even if none was ever seen (a fleet that starts at zero); the rest wait only
        within ``model_memory_s`` of their last worker."""
        self.max_queue_depth = max_queue_depth
        """``submit`` raises ``QueueFull`` when the queue already holds this many jobs
        (waiting or running); ``None``: no limit."""
        self._data: DataRedis = redis if data is None else data
        self._subscriber: EventSubscriber | ShardedEventSubscriber = (
            ShardedEventSubscriber(self._data) if isinstance(self._data, RedisCluster) else EventSubscriber(redis)
        )
        # the end of a request taken off its queue waits as the workers' record says
        self._log = ReplayLog(self._data, durability=PublishedDurability(redis, "data"))
        self._handle_source = _HandleSource(self)
        # a running request's cancel record waits as the workers' record says for the control plane
        self._cancel_durability = PublishedDurability(redis, "control")
        self._registry = WorkerRegistry(redis)
        self._cancel_script = Script(redis, Cancel)
        self._enqueue_script = Script(redis, Enqueue)
        self._schedule_callback = CallbackSchedule(redis, self._log.owners, self._log.ttl_ms)
        self._status = StatusReader(redis, self._log)
        self._routes_read: tuple[float, Routes] | None = None

    @classmethod
    def connect(cls, url: str | None = None, **options: Unpack[ConnectOptions]) -> Connecting[Self]:
        """Connect to the Redis at ``url`` (``redis://``, or ``rediss://`` for TLS; see
        ``streamq.broker.connection``): ``await`` it for the client, or ``async with
        StreamqClient.connect() as client:`` (closed on exit). Requests without a ``model``
        go to ``queue``. Either one not given is read from the environment as every command
        line reads it: ``$REDIS_URL`` and ``$STREAMQ_QUEUE``, else the defaults
        (``redis://localhost:6379``, ``streamq:queue``). ``events_url`` (else
        ``$STREAMQ_EVENTS_REDIS_URL``) names a Redis Cluster carrying the requests' events
        (docs/redis-cluster.md); unset, the Redis of ``url`` carries them. ``max_queue_depth``
        bounds every queue this client submits to (see ``submit``); ``silence_check_s`` is the
        handles' watchdog; ``affinity_window_s`` (else ``$STREAMQ_AFFINITY_WINDOW_S``, else
        200) bounds how long a request waits for the worker that served its prefix
        (docs/features/prefix-aware-pickup.md). A model none of whose workers is alive still
        takes requests, which wait in its queue for the next worker, for ``model_memory_s``
        after its last worker (else ``$STREAMQ_MODEL_MEMORY_S``, else a week), and always if
        it is one of ``declared_models`` (names, or name -> queue; else
        ``$STREAMQ_DECLARED_MODELS``): docs/operations/kubernetes.md, scale to zero.

        Connecting takes at most ``connect_timeout_s`` (5 s); past it, or when Redis refuses
        the connection (a wrong password, a certificate refused), it raises
        ``ConnectionFailed`` naming the URL (its password masked), the cause chained.
        ``None`` keeps trying for about a minute: for a service that may start before its
        Redis. Once connected, a call that meets Redis away retries for 20 s (a restart, a
        failover), then raises ``RedisUnavailable``."""
        return Connecting(cls._connect(url, **options))

    @classmethod
    async def _connect(cls, url: str | None = None, **options: Unpack[ConnectOptions]) -> Self:
        url = redis_url_from_env() if url is None else url
        events_url = options.get("events_url")
        events_url = events_url_from_env() if events_url is None else check_events_url(events_url)
        queue = options.get("queue")
        queue = queue_from_env() if queue is None else queue
        connect_timeout_s = options.get("connect_timeout_s", DEFAULT_CONNECT_TIMEOUT_S)
        redis: ArqRedis | None = None
        try:
            async with asyncio.timeout(connect_timeout_s):
                redis = await create_pool(
                    redis_settings_for(url),
                    job_serializer=serialize_job,
                    job_deserializer=deserialize_job,
                    default_queue_name=queue,
                )
                data = await connect_data_plane(redis, events_url)
        except BaseException as exc:
            if redis is not None:
                await close_pool(redis)
            where = redact_url(url)
            if isinstance(exc, TimeoutError):
                message = f"cannot connect to Redis at {where}: no answer within {connect_timeout_s:g} s"
                raise ConnectionFailed(message, url=where) from exc
            if isinstance(exc, (RedisError, OSError)):
                raise ConnectionFailed(f"cannot connect to Redis at {where}: {exc}", url=where) from exc
            raise
        try:
            return cls(
                redis,
                data=data,
                queue=queue,
                max_queue_depth=options.get("max_queue_depth"),
                silence_check_s=options.get("silence_check_s", DEFAULT_SILENCE_CHECK_S),
                affinity_window_s=options.get("affinity_window_s"),
                model_memory_s=options.get("model_memory_s"),
                declared_models=options.get("declared_models"),
            )
        except BaseException:
            await close_data_plane(redis, data)
            await close_pool(redis)
            raise

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    async def close(self) -> None:
        """Stop following every request and close the connections."""
        await self._subscriber.close()
        await close_data_plane(self._redis, self._data)
        await close_pool(self._redis)

    @redis_errors_as_streamq_errors
    async def submit(
        self,
        prompt: str | Sequence[int] | None = None,
        *,
        cancel_on_close: bool = False,
        stream: bool = True,
        **options: Unpack[RequestOptions],
    ) -> RequestHandle:
        """Enqueue a prompt (or chat ``messages``) and return the handle of its events
        (``RequestHandle``: iterate it, or ``await handle.result()``); ``generate`` does
        both at once.

        ``model`` routes the request to the queue of the workers serving that model
        (see ``live_models``); without it, the request goes to this client's queue.
        ``sampling`` takes ``SamplingOptions`` (``max_tokens``, ``temperature``, ...).
        ``deadline_s``: seconds from now by which the request must be complete, kept by the
        workers (past it, it ends with finish reason ``timeout``); ``queue_timeout_s``: how long
        it may wait for a worker (past it, finish reason ``queue_timeout``). ``cancel_on_close``
        sets the handle's: closing it before the request ended (``async with`` does, on exit)
        cancels the request.

        Raises ``InvalidRequest`` (a ``ValueError``) before anything is sent if the
        request is malformed (an unknown sampling option: ``InvalidParameter`` naming it)
        or its job would pass ``MAX_JOB_BYTES``; ``max_tokens`` above the context
        (``max_model_len``) of ``model``'s live workers is lowered to it.
        ``UnknownModel`` or ``NoLiveWorker`` if ``model`` cannot be served,
        ``QueueFull`` if the queue already holds ``max_queue_depth`` jobs, and
        ``DuplicateRequest`` if ``request_id`` is in use (queued, running, a stored
        result, or a replay log: an id is not reused while its events are kept).

        The request carries ``model``, so a worker of another model that takes it
        refuses it. ``callback``
        (``{"url": ..., "include_text": True}``) is POSTed the request's summary when it
        ends, however it ends (see docs/features/callbacks.md).

        ``structured_outputs`` (a ``StructuredOutputs``, or its dict) constrains the
        output to a JSON schema, a regex, one of some strings or a grammar:
        ``submit(prompt, structured_outputs=StructuredOutputs(json=schema))``. A schema,
        regex or grammar vLLM cannot compile ends the request with an ``invalid_request``
        error (``RequestError`` from ``result()``).

        ``priority`` (lower runs sooner, as in vLLM) and ``tenant`` (fair share between
        tenants within a priority) order the queue; ``defer_s`` keeps the job from
        starting for that many seconds (on Redis's clock).

        The worker that served the request's prefix (its leading text, or its chat
        messages before the last turn) gets first pick of it for ``affinity_window_s``,
        so its prefix cache is reused (docs/features/prefix-aware-pickup.md). ``affinity_key`` names the
        conversation or document instead; ``affinity=False`` opts the request out.

        ``stream=False`` says that nobody follows the request token by token (only its end
        matters: ``result()``, a callback): the worker writes its tokens in checkpoints
        rather than one event per engine step, which costs per request what the engine
        costs. Its events are the same kinds, fewer and larger; ``generate`` sends it.

        ``prompt`` may be token ids (a prompt already tokenized for the model, given to
        the engine as it is). ``echo=True`` sends the prompt back: the first chunk (and
        the ``Completion``) carry ``prompt_echo`` and ``prompt_token_ids``;
        ``return_prompt_token_ids=True`` the token ids alone.
        ``chat_options`` (a ``ChatTemplateOptions``, or its dict) says how ``messages`` are
        rendered: ``add_generation_prompt``, ``continue_final_message``, ``documents`` and
        more template variables, as ``vllm serve`` takes them. ``add_special_tokens``:
        whether the tokenizer adds its special tokens to a text prompt (default yes) or to
        the rendered messages (default no). ``tools`` (a ``ToolOptions``, or its dict:
        ``tools``, ``tool_choice``, ``parallel_tool_calls`` as OpenAI's) lets the model call
        them: each completion's last chunk carries the calls
        the worker's tool parser read (``Completion.parsed``; docs/client.md, "Tools").
        ``truncate_prompt_tokens`` (with ``truncation_side``), ``cache_salt`` and, for
        ``messages``, ``include_reasoning`` are ``vllm serve``'s fields of those names.
        """
        sampling = {name: value for name, value in options.items() if name not in REQUEST_OPTION_NAMES}
        messages, request_id, model = options.get("messages"), options.get("request_id"), options.get("model")
        chat_options, tools, callback = options.get("chat_options"), options.get("tools"), options.get("callback")
        priority, tenant, defer_s = options.get("priority", 0), options.get("tenant"), options.get("defer_s", 0)
        affinity_key, affinity = options.get("affinity_key"), options.get("affinity", True)
        _check_sampling_names(sampling)
        try:
            check_affinity_key(affinity_key)
        except ValueError as exc:
            raise InvalidParameter(str(exc), param="affinity_key") from None
        if not (isinstance(defer_s, int | float) and 0 <= defer_s <= JOB_EXPIRY_MS / 1000):
            limit_s = JOB_EXPIRY_MS // 1000
            raise InvalidParameter(f"defer_s must be a number from 0 to {limit_s}, got {defer_s!r}", param="defer_s")
        request = parse_request(
            {
                "request_id": request_id or uuid.uuid4().hex,
                "prompt": prompt if prompt is None or isinstance(prompt, str) else None,
                "prompt_token_ids": None if prompt is None or isinstance(prompt, str) else list(prompt),
                "messages": msgspec.to_builtins(list(messages)) if messages is not None else None,
                "chat_options": msgspec.to_builtins(chat_options) if chat_options is not None else None,
                "tools": msgspec.to_builtins(tools) if tools is not None else None,
                "model": model,
                "sampling": sampling,
                "deadline_s": options.get("deadline_s"),
                "queue_timeout_s": options.get("queue_timeout_s"),
                "callback": msgspec.to_builtins(callback) if callback is not None else None,
                "priority": priority,
                "tenant": tenant,
                "stream": stream,
                "echo": options.get("echo", False),
                "add_special_tokens": options.get("add_special_tokens"),
                "return_prompt_token_ids": options.get("return_prompt_token_ids", False),
                "truncate_prompt_tokens": options.get("truncate_prompt_tokens"),
                "truncation_side": options.get("truncation_side"),
                "cache_salt": options.get("cache_salt"),
                "include_reasoning": options.get("include_reasoning", True),
                "reasoning_per_chunk": options.get("reasoning_per_chunk", False),
                "inputs": _inputs_of(options.get("inputs")),
                "pooling": msgspec.to_builtins(pooling) if (pooling := options.get("pooling")) is not None else None,
            }
        )
        job = _job_payload(request)
        prefixes = affinity_keys(_prefix_text(request), request.messages, affinity_key) if affinity else []
        queue = self.queue
        eligible: list[str] = []
        if model is not None:
            routes = await self._routes_serving(model)
            try:
                queue = _queue_of(routes, model, memory_s=self.model_memory_s, declared=self.declared_models)
            except (UnknownModel, NoLiveWorker) as exc:  # or Redis evicted the registrations
                if evicted := await eviction_cause(self._redis):
                    raise type(exc)(
                        f"{exc}, or Redis evicted its workers' registrations (each registers again within "
                        f"{WORKER_RENEW_S:g} s): {evicted}",
                        model=model,
                    ) from exc
                raise
            check_task(request, routes, model)
            if _cap_max_tokens(request, routes.context_length(model)):
                job = _job_payload(request)
            if not routes.is_base_model(model):  # a LoRA adapter: only workers that serve it, its own first
                eligible = routes.adapter_workers(model, queue)
                if affinity:
                    prefixes = under_adapter(model, prefixes)
        # Subscribe and enqueue at once: the job can start one round trip sooner. What
        # is published before the subscription holds is in the replay log, read right
        # after; the handle merges both without gap or duplicate.
        subscribing = asyncio.ensure_future(
            self._subscribe(
                request.request_id,
                next_seq=0,
                job_queue=queue,
                cancel_on_close=cancel_on_close,
                queue_timeout_s=request.queue_timeout_s,
            )
        )
        limit = -1 if self.max_queue_depth is None else self.max_queue_depth
        try:
            outcome = await self._enqueue(request, job, queue, limit, defer_s, prefixes, eligible)
        except BaseException:
            await _close_when_subscribed(subscribing)
            raise
        handle = await subscribing
        try:
            if outcome == 0:
                raise DuplicateRequest(
                    f"request id {request.request_id!r} is already in use", request_id=request.request_id
                )
            if outcome == -1:
                raise QueueFull(
                    f"queue {queue} already holds {limit} jobs (its limit): try again later", queue=queue, limit=limit
                )
            await handle._replay()
        except BaseException:
            await handle.close()
            raise
        return handle

    async def _enqueue(
        self,
        request: GenerateRequest,
        job: bytes,
        queue: str,
        limit: int,
        defer_s: float,
        prefixes: list[str],
        eligible: list[str],
    ) -> int:
        """Run the enqueue script: 1 (queued), 0 (id in use) or -1 (queue full). Where the
        logs live on a cluster, an id whose log is still kept is in use, and the enqueue
        reserves the id on the control plane (two requests racing for one id: one wins).
        ``eligible``: the only workers that may run it (none: any)."""
        names, request_id = self._log.names, request.request_id
        reserving = names.sharded
        if reserving and await self._log.exists(request_id):
            return 0
        # The callback is kept where the paths ending the request outside a worker find it; a
        # job only some workers may run is held for one of them even with affinity off.
        callback = request.callback
        window_ms = round(self.affinity_window_s * 1000)
        call = Enqueue.of_request(
            request_id,
            queue,
            job,
            log_key=REQUEST_RESERVATION_PREFIX + request_id if reserving else names.events(request_id),
            cancelled_key=cancelled_key(request_id),  # a stale one goes
            limit=limit,
            priority=request.priority,
            tenant=request.tenant or DEFAULT_TENANT,
            delay_ms=round(defer_s * 1000),
            callback_key=callback_key(request_id) if callback is not None else "",
            callback=msgspec.json.encode(callback) if callback is not None else b"",
            callback_ttl_ms=JOB_EXPIRY_MS + LOG_TTL_MS if callback is not None else 0,
            reservation_ttl_ms=JOB_EXPIRY_MS + LOG_TTL_MS if reserving else "",
            affinity_keys=prefixes if window_ms > 0 else (),
            window_ms=window_ms or AFFINITY_FREE_TTL_MS,
            balance_slack=AFFINITY_BALANCE_SLACK,
            balance_fraction=AFFINITY_BALANCE_FRACTION,
            eligible=eligible,
        )
        return int(await self._enqueue_script(call))

    async def generate(
        self,
        prompt: str | Sequence[int] | None = None,
        *,
        timeout: float | None = None,
        **options: Unpack[RequestOptions],
    ) -> Completion:
        """Submit a prompt (or chat ``messages``) and wait for its whole output: ``submit``
        and ``RequestHandle.result`` in one call, with ``submit``'s parameters and errors.

        ``timeout`` bounds the caller's wait, as asyncio's and the openai SDK's do: past it,
        ``RequestTimeout`` (a builtin ``TimeoutError`` too) is raised and the request is
        cancelled, since nobody holds its handle to read the rest (so is a request whose waiting
        task is cancelled). ``deadline_s`` is the request's own, kept by the workers: it ends the
        request with finish reason ``timeout``, which ``result`` returns.
        """
        handle = await self.submit(prompt, cancel_on_close=True, stream=False, **options)
        async with handle:
            return await handle.result(timeout)

    async def embed(
        self,
        inputs: str | Sequence[int] | Sequence[str | Sequence[int]],
        *,
        dimensions: int | None = None,
        use_activation: bool | None = None,
        timeout: float | None = None,
        **options: Unpack[PoolOptions],
    ) -> Pooled:
        """Embed ``inputs`` (a text, a token-id list, or a sequence of them) with a pooling
        model's workers, all in one request (one job: the worker runs each input through the
        engine, as ``vllm serve`` splits a list), and return their vectors
        (``Pooled.vectors``: numpy arrays where numpy is installed, lists of floats
        otherwise) with each input's token count.

        ``dimensions`` and ``use_activation`` (normalize; the model's default: yes) are
        ``vllm serve``'s fields; ``truncate_prompt_tokens`` keeps that many of each input's
        tokens (``-1``: the model's context), else an input longer than the context ends
        the request with an ``invalid_request`` error naming its index. The other keywords
        are ``submit``'s (``model``, ``priority``, ``deadline_s``, ``callback``, ...), and
        so are the errors, with ``RequestError`` for a request that ended in error.
        At most ``MAX_POOLING_INPUTS`` inputs per call."""
        pooling = Pooling(task="embed", dimensions=dimensions, use_activation=use_activation)
        return await self._pool(inputs, pooling, timeout, options)

    async def classify(
        self,
        inputs: str | Sequence[int] | Sequence[str | Sequence[int]],
        *,
        use_activation: bool | None = None,
        timeout: float | None = None,
        **options: Unpack[PoolOptions],
    ) -> Pooled:
        """Classify ``inputs`` with a classification model's workers (``--convert classify``):
        each result is the input's class probabilities (raw scores with
        ``use_activation=False``). Otherwise as ``embed``."""
        pooling = Pooling(task="classify", use_activation=use_activation)
        return await self._pool(inputs, pooling, timeout, options)

    async def _pool(
        self,
        inputs: str | Sequence[int] | Sequence[str | Sequence[int]],
        pooling: Pooling,
        timeout: float | None,
        options: PoolOptions,
    ) -> Pooled:
        request = cast(RequestOptions, {**options, "inputs": _inputs_of(inputs) or [], "pooling": pooling})
        completion = await self.generate(None, timeout=timeout, **request)
        if completion.pooled is None:
            raise StreamqError(
                f"request {completion.request_id}: it ended without results ({completion.finish_reason})"
            )
        return completion.pooled

    @overload
    def generate_many(
        self,
        requests: Iterable[str | Mapping[str, Any]] | AsyncIterable[str | Mapping[str, Any]],
        *,
        max_in_flight: int | None = None,
        return_exceptions: Literal[False] = False,
        **common: Any,
    ) -> AsyncGenerator[Completion, None]: ...

    @overload
    def generate_many(
        self,
        requests: Iterable[str | Mapping[str, Any]] | AsyncIterable[str | Mapping[str, Any]],
        *,
        max_in_flight: int | None = None,
        return_exceptions: Literal[True],
        **common: Any,
    ) -> AsyncGenerator[Completion | StreamqError, None]: ...

    async def generate_many(
        self,
        requests: Iterable[str | Mapping[str, Any]] | AsyncIterable[str | Mapping[str, Any]],
        *,
        max_in_flight: int | None = None,
        return_exceptions: bool = False,
        **common: Any,
    ) -> AsyncGenerator[Completion | StreamqError, None]:
        """Run many requests with a bounded number in flight and yield each ``Completion``
        as its request ends (in the order they end, not the order given), for batch work
        from code: ``async for completion in client.generate_many(prompts, max_tokens=32)``.

        Each item of ``requests`` (an iterable, or an async one, read as room frees) is a
        prompt, or a mapping of ``generate``'s keyword arguments; ``common`` holds those
        shared by every item (an item's own win). Give an item a ``request_id`` to match
        its completion (``Completion.request_id``) to it; else each gets a random one.
        Every request is sent with ``stream=False`` (``submit``).

        ``max_in_flight`` bounds the requests queued or running at once. By default it is
        as many as keep every live worker's engine full: twice the slots of the workers of
        ``common``'s ``model`` (of every live worker without one), so that a slot that frees
        finds a request waiting; re-read as workers come and go, at least ``MIN_IN_FLIGHT``.

        A request that fails raises its ``StreamqError`` here, and the others still in flight
        are cancelled (so is everything in flight when the loop is left early); with
        ``return_exceptions=True`` the error is yielded in its place and the rest go on.
        Every error yielded or raised names its request (``StreamqError.request_id``).
        """
        if max_in_flight is not None and max_in_flight < 1:
            raise InvalidParameter(f"max_in_flight must be 1 or more, got {max_in_flight}", param="max_in_flight")
        window = _InFlightWindow(self, max_in_flight, common.get("model"))
        ended: asyncio.Queue[asyncio.Task[Completion]] = asyncio.Queue()
        running: set[asyncio.Task[Completion]] = set()
        items = _aiter_of(requests)
        exhausted = False
        try:
            while True:
                while not exhausted and len(running) < await window.size():
                    try:
                        item = await anext(items)
                    except StopAsyncIteration:
                        exhausted = True
                        break
                    task = asyncio.create_task(self._generate_one(item, common))
                    running.add(task)
                    task.add_done_callback(ended.put_nowait)
                if not running:
                    return
                task = await ended.get()
                running.discard(task)
                if task.cancelled():
                    raise asyncio.CancelledError
                error = task.exception()
                if error is None:
                    yield task.result()
                elif return_exceptions and isinstance(error, StreamqError):
                    yield error
                else:
                    raise error
        finally:
            for task in running:
                task.cancel()
            await asyncio.gather(*running, return_exceptions=True)

    async def _generate_one(self, item: str | Mapping[str, Any], common: Mapping[str, Any]) -> Completion:
        """``generate`` for one item of ``generate_many``; its error names its request."""
        kwargs = {**common, "prompt": item} if isinstance(item, str) else {**common, **item}
        request_id = kwargs.setdefault("request_id", uuid.uuid4().hex)
        try:
            return await self.generate(**kwargs)
        except StreamqError as exc:
            exc.request_id = request_id
            raise

    @redis_errors_as_streamq_errors
    async def follow(self, request_id: str, *, from_seq: int = 0, after: str | None = None) -> RequestHandle:
        """Follow ``request_id`` from event ``from_seq`` on: the replay log first,
        then live events, with no gap and no duplicate.

        ``after``: the digest of event ``from_seq - 1`` as the caller had it (the
        ``last_digest`` of the handle that delivered it; ``event_digest`` of its JSON). The
        log's event at that ``seq`` is checked before anything is delivered: if it is gone
        or another (Redis lost writes it had acknowledged and the request went on from what
        it kept), ``MissingEvents``, rather than a continuation of another version of the
        stream, or its second end. If that event ended the request, the handle is ``done``
        at once and delivers nothing (``result()`` says how it ended). Without ``after``
        nothing is checked: events before ``from_seq`` are taken on trust."""
        if after is not None:
            after = after.lower()
            if from_seq < 1:
                raise InvalidParameter(f"after is the digest of event from_seq - 1: from_seq={from_seq}", param="after")
            if not DIGEST_PATTERN.fullmatch(after):
                raise InvalidParameter(f"after must be an event digest (16 hex digits), got {after!r}", param="after")
        handle = await self._subscribe(request_id, next_seq=from_seq)
        try:
            if after is None:
                await handle._replay()
            else:
                await handle._start_after(after)
        except BaseException:
            await handle.close()
            raise
        return handle

    async def _subscribe(
        self,
        request_id: str,
        *,
        next_seq: int,
        job_queue: str | None = None,
        cancel_on_close: bool = False,
        queue_timeout_s: float | None = None,
    ) -> RequestHandle:
        inbox = await self._subscriber.subscribe(self._log.names.events(request_id))
        return RequestHandle(
            self._handle_source,
            request_id,
            inbox,
            next_seq,
            job_queue=job_queue or self.queue,
            queue_known=job_queue is not None,
            cancel_on_close=cancel_on_close,
            queue_timeout_s=queue_timeout_s,
        )

    @redis_errors_as_streamq_errors
    async def _routes(self) -> Routes:
        """The live workers (model, queue, slots) and every model ever registered."""
        return await self._registry.routes()

    async def _routes_serving(self, model: str) -> Routes:
        """``_routes()``, reused for ``ROUTES_FRESH_S`` while they show ``model`` live: one
        registry read per request is a round trip before every enqueue. A model not live in
        them is always read afresh, so a worker that just registered is found at once."""
        now = time.monotonic()
        if self._routes_read is not None:
            read_at, routes = self._routes_read
            if now - read_at < ROUTES_FRESH_S and model in routes.live_models():
                return routes
        routes = await self._routes()
        self._routes_read = (now, routes)
        return routes

    @redis_errors_as_streamq_errors
    async def live_models(self) -> dict[str, str]:
        """Model name -> queue, for each model that has a live worker."""
        return (await self._routes()).live_models()

    async def redis_full(self) -> str | None:
        """Whether Redis is full: its memory used against its ``maxmemory`` (``INFO memory``)
        in words when it has reached it, else ``None``; ``None`` too where this client may not
        ask (a Redis user without ``INFO``, a cluster). Writes then fail with ``RedisFull``."""
        memory = await read_memory_policy(self._redis)
        if memory is None or not memory.full:
            return None
        return f"Redis is full: {memory.used:,} bytes used of its maxmemory {memory.maxmemory:,}"

    @redis_errors_as_streamq_errors
    async def cancel(self, request_id: str, *, queue: str | None = None) -> RequestState:
        """Cancel a request: a running one is aborted in the engine, a queued one is
        removed before it runs. Either way its stream ends with a final event whose
        finish reason is ``cancelled``. Returns what the request was doing:
        ``running``, ``queued``, or ``unknown`` (finished, or never submitted).
        A queued request is found on this client's queue or any model's, in one
        round trip; ``queue`` (the queue it was put on, if known) is looked at first.
        It returns once the cancel is as durable as the workers make an end (their
        ``--durable-ends``: Redis's replicas have its record), so a failover after it
        returns cannot take it back; the worker is told at once all the same.
        """
        return await self._take_off_queue(request_id, queue, FinishReason.CANCELLED, queued_only=False)

    async def _end_queued(self, request_id: str, queue: str | None, reason: FinishReason) -> RequestState:
        """End ``request_id`` with ``reason`` if it is still queued (never one running)."""
        return await self._take_off_queue(request_id, queue, reason, queued_only=True)

    async def _take_off_queue(
        self, request_id: str, queue: str | None, reason: FinishReason, *, queued_only: bool
    ) -> RequestState:
        """The cancel script (``queued_only``: a running request is left alone), and the end
        of a request it took off its queue, with finish reason ``reason``."""
        queues = list(dict.fromkeys(q for q in (queue, self.queue) if q is not None))
        call = Cancel.of_request(request_id, queues, queued_only=queued_only)
        reply = await self._cancel(call, durable=not queued_only)
        outcome = cast(RequestState, as_text(reply))
        if outcome == "queued":
            # No worker will run it now: end its stream here, numbered in Redis after
            # whatever the log holds and only if nothing ended it first (an attempt
            # whose lease lapsed may still be running: its next events are refused).
            final = FinalEvent(
                request_id=request_id, seq=0, finish_reasons=[reason], prompt_tokens=0, completion_tokens=0
            )
            if await self._log.end(request_id, final) is not None and self._log.names.sharded:
                await self._schedule_callback(request_id)  # on one Redis, end_request did
        return outcome

    async def _cancel(self, call: Cancel, *, durable: bool) -> Any:
        """The cancel script's reply; ``durable``: it returns once its write (a running request's
        cancel record) is as durable as the workers' record says an end must be: the script and
        the wait in one pipeline on one connection (``WAIT`` covers that connection's writes).
        The script publishes the cancel itself, so the worker acts at once; only the caller
        waits."""
        durability = self._cancel_durability
        if durable:
            await durability.fresh()
        wait = durability.wait()
        if not durable or not wait.waits:
            return await self._cancel_script(call)
        started = time.perf_counter()
        reply, *waited = await self._cancel_script.then(call, *wait.commands())
        durability.check_wait(wait, waited, seconds=time.perf_counter() - started, what="cancel")
        return reply

    @redis_errors_as_streamq_errors
    async def status(self, request_id: str) -> RequestStatus:
        """Where the request is, in one round trip: ``queued`` (its position among the
        waiting requests of its priority, the wait so far; or deferred, with its run-at
        time), ``running`` (the worker, the attempt, tokens so far), ``finished`` (finish
        reasons, usage, when), ``failed`` (code, message) or ``unknown``; and its
        callback's delivery. A queued request is looked for on this client's queue and
        every model's."""
        return await self._status.read(request_id, queues=[self.queue])

    @redis_errors_as_streamq_errors
    async def _job_state(self, request_id: str, queue: str | None = None) -> RequestState:
        """Where the request's job is, cheaper than ``status`` (the handle's watchdog only
        asks whether anything will still happen): ``running`` (a worker holds its lease),
        ``queued`` (waiting for a worker, or for its lapsed lease to be taken over), ``finished``
        (a result is stored) or ``unknown``. With the ``queue`` it was put on, a job is queued
        only while that queue still lists it: one whose entry an evicting Redis deleted would
        be claimed by nobody, ever."""
        async with self._redis.pipeline(transaction=False) as pipe:
            pipe.exists(IN_PROGRESS_PREFIX + request_id)
            pipe.exists(JOB_KEY_PREFIX + request_id)
            pipe.exists(RESULT_KEY_PREFIX + request_id)
            if queue is not None:
                pipe.zscore(queue, request_id)
            running, stored, finished, *listed = await pipe.execute()
        queued = stored and (queue is None or listed[0] is not None)
        return "running" if running else "queued" if queued else "finished" if finished else "unknown"


def _queue_of(routes: Routes, model: str, *, memory_s: float, declared: Mapping[str, str]) -> str:
    """The queue of ``model``'s live workers; raises ``UnknownModel`` or ``NoLiveWorker``.

    A model with no live worker waits in the queue it was last served on if a worker served
    it within ``memory_s``, or in its queue in ``declared``: its workers may have scaled to
    zero, and the next to start takes it. Otherwise it goes to the queue of live workers that
    load LoRA adapters by name at run time, if there is one (the queue it was served on
    before, if several): the worker that takes it loads it, or ends the request with an
    error naming it."""
    live_models = routes.live_models()
    if model in live_models:
        return live_models[model]
    loading = routes.adapter_queues()
    known = routes.known_models.get(model)
    if known in loading:
        return routes.known_models[model]
    if model in declared:
        return declared[model]
    if known is not None and routes.seen_within(model, memory_s):
        return known
    if len(loading) == 1:
        return next(iter(loading))
    if known is not None:
        raise NoLiveWorker(
            f"no live worker serves model {model!r} now, nor did one in the last {memory_s:g} s "
            "(the model memory: requests for a model seen within it wait for its next worker)",
            model=model,
        )
    if loading:
        raise UnknownModel(
            f"no worker lists model {model!r}, and workers on several queues load adapters at run time "
            f"({', '.join(sorted(loading))}): list it with --lora-modules on the workers that should serve it",
            model=model,
        )
    live = ", ".join(sorted(live_models)) or "none"
    raise UnknownModel(f"no worker serves model {model!r} (models with live workers: {live})", model=model)


def _check_sampling_names(sampling: Mapping[str, object]) -> None:
    """Refuse a keyword that is no sampling option, before anything is sent: ``submit``
    takes its other keywords as sampling options, so a typo lands here, and is named
    with the option it was probably meant to be."""
    for name in sampling:
        if name not in SamplingOptions.__optional_keys__:
            known = sorted(SamplingOptions.__optional_keys__)
            close = difflib.get_close_matches(name, known, n=1)
            hint = f"did you mean {close[0]!r}?" if close else f"the sampling options are {', '.join(known)}"
            raise InvalidParameter(f"unknown sampling option {name!r}: {hint}", param=name)


def _job_payload(request: GenerateRequest) -> bytes:
    """The arq job for ``request``; raises ``InvalidRequest`` past ``MAX_JOB_BYTES``."""
    # arq reads the enqueue time from the payload; the queue score is Redis's clock.
    now_ms = int(time.time() * 1000)
    job = serialize_job({"t": 1, "f": JOB_FUNCTION, "a": [msgspec.to_builtins(request)], "k": {}, "et": now_ms})
    if len(job) > MAX_JOB_BYTES:
        raise InvalidRequest(f"the request is {len(job)} bytes as a job; the limit is {MAX_JOB_BYTES} bytes")
    return job


def _prefix_text(request: GenerateRequest) -> str | None:
    """The text whose prefixes name the request's prefix for affinity: its prompt, or its
    token ids written out (a shared token prefix is a shared text prefix)."""
    if request.prompt_token_ids is not None:
        return " ".join(map(str, request.prompt_token_ids))
    return request.prompt


def _cap_max_tokens(request: GenerateRequest, context: int | None) -> bool:
    """Lower ``max_tokens`` to the model's context (``max_model_len``), as ``vllm serve``
    caps it: generation stops there anyway. True if it was lowered."""
    max_tokens = request.sampling.max_tokens
    if context is None or max_tokens is None or max_tokens <= context:
        return False
    request.sampling.max_tokens = context
    return True


async def _close_when_subscribed(subscribing: asyncio.Future[RequestHandle]) -> None:
    """Close the handle that a failed ``submit`` was subscribing for."""
    try:
        handle = await subscribing
    except Exception:
        return  # the subscription failed too: nothing to close
    await handle.close()


MIN_IN_FLIGHT = 64
"""``generate_many``'s (and ``streamq batch``'s) fewest requests in flight when it sizes them
to the live workers: what it keeps while no worker is live, so work waits queued for one."""
IN_FLIGHT_READ_S = 5.0
"""How often ``generate_many`` reads the live workers' slots again while it runs."""


class _InFlightWindow:
    """How many requests ``generate_many`` keeps in flight: the caller's bound, or twice the
    live workers' slots (a request waits for each slot as it frees), read again every
    ``IN_FLIGHT_READ_S`` as workers come and go."""

    def __init__(self, client: StreamqClient, bound: int | None, model: str | None) -> None:
        self._client = client
        self._bound = bound
        self._model = model
        self._size = MIN_IN_FLIGHT
        self._read_at: float | None = None

    async def size(self) -> int:
        if self._bound is not None:
            return self._bound
        now = time.monotonic()
        if self._read_at is None or now - self._read_at >= IN_FLIGHT_READ_S:
            self._read_at = now
            slots = (await self._client._routes()).slots(self._model)
            self._size = max(MIN_IN_FLIGHT, 2 * slots)
        return self._size


async def _aiter_of(items: Iterable[Any] | AsyncIterable[Any]) -> AsyncIterator[Any]:
    """``items`` as an async iterator, whichever kind it is."""
    if isinstance(items, AsyncIterable):
        async for item in items:
            yield item
    else:
        for item in items:
            yield item
