"""streamq's client side: submit prompts, follow their token events, tail requests.

    from producer import StreamqClient

    async with await StreamqClient.connect() as client:  # $REDIS_URL, $STREAMQ_QUEUE
        completion = await client.generate("The key to happiness is", max_tokens=32)

Every error it raises is a ``StreamqError``. Imports neither vllm nor torch, so any
service can use it.
"""

from producer.client import Completion, RequestHandle, SamplingOptions, StreamqClient
from producer.errors import (
    DuplicateRequest,
    InvalidParameter,
    InvalidRequest,
    MissingEvents,
    NoLiveWorker,
    QueueFull,
    RequestError,
    RequestLost,
    StreamqError,
    UnknownModel,
)
from streamq.protocol import (
    ChatMessage,
    ChunkEvent,
    ErrorEvent,
    Event,
    FinalEvent,
    StructuredOutputs,
    TokenLogprob,
    TopLogprob,
)

__all__ = [
    "ChatMessage",
    "ChunkEvent",
    "Completion",
    "DuplicateRequest",
    "ErrorEvent",
    "Event",
    "FinalEvent",
    "InvalidParameter",
    "InvalidRequest",
    "MissingEvents",
    "NoLiveWorker",
    "QueueFull",
    "RequestError",
    "RequestHandle",
    "RequestLost",
    "SamplingOptions",
    "StreamqClient",
    "StreamqError",
    "StructuredOutputs",
    "TokenLogprob",
    "TopLogprob",
    "UnknownModel",
]
