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
    ChatTemplateOptions,
    ChunkEvent,
    ErrorEvent,
    Event,
    FinalEvent,
    PromptEcho,
    StructuredOutputs,
    TokenLogprob,
    TopLogprob,
)

__all__ = [
    "ChatMessage",
    "ChatTemplateOptions",
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
    "PromptEcho",
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
