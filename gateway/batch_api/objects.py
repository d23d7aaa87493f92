"""The records of files and batches as Redis keeps them (a hash each, every value a string),
and the OpenAI objects the API answers with (``openai.types.FileObject`` and ``Batch``, field
for field)."""

from __future__ import annotations

import json
from typing import Any, Final, Literal

import msgspec

FilePurpose = Literal["batch", "batch_output"]
BatchStatus = Literal[
    "validating", "failed", "in_progress", "finalizing", "completed", "expired", "cancelling", "cancelled"
]
FINAL_STATES: Final = frozenset({"failed", "completed", "expired", "cancelled"})
RUNNING_STATES: Final = frozenset({"validating", "in_progress", "finalizing", "cancelling"})


class FileRecord(msgspec.Struct, kw_only=True):
    id: str
    """``file-<32 hex>``; its bytes are ``files/<id>`` in the storage."""
    owner: str
    bytes: int
    created_at: int
    filename: str
    purpose: FilePurpose
    expires_at: int | None = None
    lines: int = 0
    """Lines that hold something (counted as the upload streams): a batch's ``total``."""

    def to_hash(self) -> dict[str, str]:
        return {name: "" if value is None else str(value) for name, value in msgspec.structs.asdict(self).items()}

    @classmethod
    def from_hash(cls, raw: dict[Any, Any]) -> FileRecord:
        fields = {_text(k): _text(v) for k, v in raw.items()}
        return msgspec.convert(
            {k: (None if v == "" and k == "expires_at" else v) for k, v in fields.items()}, cls, strict=False
        )

    def to_openai(self) -> dict[str, Any]:
        """``openai.types.FileObject``."""
        return {
            "id": self.id,
            "object": "file",
            "bytes": self.bytes,
            "created_at": self.created_at,
            "filename": self.filename,
            "purpose": self.purpose,
            "status": "processed",
            "expires_at": self.expires_at,
            "status_details": None,
        }


class BatchRecord(msgspec.Struct, kw_only=True):
    """A batch: what it was created with, where it is in its life, and its counters. The
    runner moves it on with scripts that write these fields in place."""

    id: str
    """``batch_<32 hex>``."""
    owner: str
    """Its files' namespace (the API key's name, ``OPEN_NAMESPACE`` without keys)."""
    queue_tenant: str = ""
    """The tenant its requests carry in the queue (fair share); empty: the default one."""
    key_digest: str = ""
    """The digest of the API key that created it, so that its requests count against that
    key's quotas; empty without a stored key."""
    endpoint: str
    input_file_id: str
    completion_window: str
    created_at: int
    expires_at: int
    priority: int
    """What its requests run at (a line's own ``priority`` may only lower their urgency)."""
    output_expires_after_s: int
    online_reserve: int = 0
    """Slots of each live worker its lines leave free for online requests (the creating
    gateway's ``--batch-online-reserve``), whichever gateway runs it."""
    status: BatchStatus = "validating"
    in_progress_at: int | None = None
    finalizing_at: int | None = None
    completed_at: int | None = None
    failed_at: int | None = None
    expired_at: int | None = None
    cancelling_at: int | None = None
    cancelled_at: int | None = None
    output_file_id: str | None = None
    error_file_id: str | None = None
    model: str | None = None
    metadata: str = ""
    """JSON object of strings, or empty."""
    errors: str = ""
    """JSON list of ``{code, message, line, param}``, or empty."""
    total: int = 0
    completed: int = 0
    failed: int = 0
    input_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    reasoning_tokens: int = 0
    next_line: int = 1
    """The number of the next input line to read (1-based, as errors name lines)."""
    next_offset: int = 0
    """The byte offset of that line in the input file."""
    ending: str = ""
    """``expired`` once its window has passed: the runner winds it down (its requests
    cancelled, its unread lines answered ``batch_expired``) before it says ``expired``."""

    def to_hash(self) -> dict[str, str]:
        return {name: "" if value is None else str(value) for name, value in msgspec.structs.asdict(self).items()}

    @classmethod
    def from_hash(cls, raw: dict[Any, Any]) -> BatchRecord:
        fields = {_text(k): _text(v) for k, v in raw.items()}
        optional = {name for name, value in msgspec.structs.asdict(_EMPTY_BATCH).items() if value is None}
        return msgspec.convert(
            {k: (None if v == "" and k in optional else v) for k, v in fields.items()}, cls, strict=False
        )

    def to_openai(self) -> dict[str, Any]:
        """``openai.types.Batch``."""
        errors = json.loads(self.errors) if self.errors else None
        return {
            "id": self.id,
            "object": "batch",
            "endpoint": self.endpoint,
            "model": self.model,
            "errors": None if errors is None else {"object": "list", "data": errors},
            "input_file_id": self.input_file_id,
            "completion_window": self.completion_window,
            "status": self.status,
            "output_file_id": self.output_file_id,
            "error_file_id": self.error_file_id,
            "created_at": self.created_at,
            "in_progress_at": self.in_progress_at,
            "expires_at": self.expires_at,
            "finalizing_at": self.finalizing_at,
            "completed_at": self.completed_at,
            "failed_at": self.failed_at,
            "expired_at": self.expired_at,
            "cancelling_at": self.cancelling_at,
            "cancelled_at": self.cancelled_at,
            "request_counts": {"total": self.total, "completed": self.completed, "failed": self.failed},
            "usage": {
                "input_tokens": self.input_tokens,
                "input_tokens_details": {"cached_tokens": self.cached_tokens},
                "output_tokens": self.output_tokens,
                "output_tokens_details": {"reasoning_tokens": self.reasoning_tokens},
                "total_tokens": self.input_tokens + self.output_tokens,
            },
            "metadata": json.loads(self.metadata) if self.metadata else None,
        }


_EMPTY_BATCH = BatchRecord(
    id="",
    owner="",
    endpoint="",
    input_file_id="",
    completion_window="",
    created_at=0,
    expires_at=0,
    priority=0,
    output_expires_after_s=0,
)


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
