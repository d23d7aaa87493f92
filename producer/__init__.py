"""streamq's client side: submit prompts, follow their token events, tail requests.

Imports neither vllm nor torch, so any service can use it.
"""

from producer.client import (
    Completion,
    DuplicateRequest,
    MissingEvents,
    NoLiveWorker,
    QueueFull,
    RequestError,
    RequestHandle,
    StreamqClient,
    StreamqError,
    UnknownModel,
)
from streamq.protocol import (
    ChatMessage,
    ChunkEvent,
    ErrorEvent,
    Event,
    FinalEvent,
    InvalidRequest,
    SamplingOptions,
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
    "InvalidRequest",
    "MissingEvents",
    "NoLiveWorker",
    "QueueFull",
    "RequestError",
    "RequestHandle",
    "SamplingOptions",
    "StreamqClient",
    "StreamqError",
    "StructuredOutputs",
    "TokenLogprob",
    "TopLogprob",
    "UnknownModel",
]
