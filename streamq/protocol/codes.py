"""Why a request ended: the codes of ``error`` events and the finish reasons of
``chunk`` and ``final`` events, as the wire carries them."""

from __future__ import annotations

import enum


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


class FinishReason(enum.StrEnum):
    """Why a completion ended: a chunk's ``finish_reason``, an entry of ``finish_reasons``."""

    STOP = "stop"
    """The model emitted a stop token or string (vLLM's own reason)."""
    LENGTH = "length"
    """``max_tokens`` or the model's context ran out (vLLM's own reason)."""
    CANCELLED = "cancelled"
    """Someone cancelled the request."""
    TIMEOUT = "timeout"
    """The request's own deadline (``deadline_s``) passed."""
    QUEUE_TIMEOUT = "queue_timeout"
    """The request waited longer than ``queue_timeout_s`` for a worker."""
