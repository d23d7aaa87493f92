"""streamq's client side: submit prompts, follow their token events, cancel them, ask where they are.

    from producer import StreamqClient

    async with StreamqClient.connect() as client:  # $REDIS_URL, $STREAMQ_QUEUE
        completion = await client.generate("The key to happiness is", max_tokens=32)

``producer.sync.StreamqClient`` is the same client for code that does not run an event
loop (a Flask view, a Celery task, a script). Every error it raises is a ``StreamqError``.
Imports neither vllm nor torch, so any service can use it.
"""

from producer.client import (
    Completion,
    Connecting,
    PoolOptions,
    RequestHandle,
    RequestOptions,
    SamplingOptions,
    StreamqClient,
    Usage,
)
from producer.errors import (
    ConnectionFailed,
    DuplicateRequest,
    InvalidParameter,
    InvalidRequest,
    MissingEvents,
    NoLiveWorker,
    QueueFull,
    RedisFull,
    RedisUnavailable,
    RequestError,
    RequestLost,
    RequestTimeout,
    StreamqError,
    UnknownModel,
)
from producer.pooled import Pooled
from streamq.protocol import (
    Callback,
    ChatMessage,
    ChatTemplateOptions,
    ChunkEvent,
    ErrorEvent,
    Event,
    FinalEvent,
    ParsedOutput,
    PooledEvent,
    Pooling,
    PromptEcho,
    StructuredOutputs,
    TokenLogprob,
    ToolOptions,
    TopLogprob,
)
from streamq.protocol.status import CallbackDelivery, DeliveryState, RequestState, RequestStatus

__all__ = [
    "Callback",
    "ChatMessage",
    "CallbackDelivery",
    "ChatTemplateOptions",
    "ChunkEvent",
    "Completion",
    "ConnectionFailed",
    "Connecting",
    "DeliveryState",
    "DuplicateRequest",
    "ErrorEvent",
    "Event",
    "FinalEvent",
    "InvalidParameter",
    "InvalidRequest",
    "MissingEvents",
    "NoLiveWorker",
    "ParsedOutput",
    "PoolOptions",
    "Pooled",
    "PooledEvent",
    "Pooling",
    "PromptEcho",
    "QueueFull",
    "RedisFull",
    "RedisUnavailable",
    "RequestError",
    "RequestHandle",
    "RequestLost",
    "RequestOptions",
    "RequestState",
    "RequestStatus",
    "RequestTimeout",
    "SamplingOptions",
    "StreamqClient",
    "StreamqError",
    "StructuredOutputs",
    "TokenLogprob",
    "ToolOptions",
    "TopLogprob",
    "UnknownModel",
    "Usage",
]
