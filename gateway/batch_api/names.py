"""The Redis keys of files and batches. Each batch's own keys share its hash tag, so that the
scripts that move a batch on touch one slot."""

from __future__ import annotations

from typing import Final

from streamq.protocol.names import BATCH_KEY_PREFIX, BATCHES_KEY_PREFIX, FILE_KEY_PREFIX, FILES_KEY_PREFIX

OPEN_NAMESPACE: Final = "-"
"""The owner of files and batches on a gateway without API keys (one namespace)."""

FILE_PREFIX: Final = FILE_KEY_PREFIX
BATCH_PREFIX: Final = BATCH_KEY_PREFIX
FILES_EXPIRY_KEY: Final = FILES_KEY_PREFIX + "expiry"
"""Sorted set: file id by ``expires_at`` (seconds), which the sweep reads."""
STORED_BYTES_KEY: Final = FILES_KEY_PREFIX + "bytes"
"""Hash: owner -> bytes its files hold, against ``max_stored_bytes``."""
ACTIVE_BATCHES_KEY: Final = BATCHES_KEY_PREFIX + "active"
"""Set: the ids of batches not yet in a final state, which every gateway's runner scans."""


def file_key(file_id: str) -> str:
    """Hash: the file's record (``files.FileRecord``)."""
    return FILE_PREFIX + file_id


def files_of(owner: str) -> str:
    """Sorted set: the owner's file ids by creation (milliseconds), for lists."""
    return f"{FILES_KEY_PREFIX}of:{owner}"


def file_users_key(file_id: str) -> str:
    """Set: the unfinished batches reading the file (it cannot be deleted while any is)."""
    return f"{FILE_KEY_PREFIX}{file_id}:users"


def batch_key(batch_id: str) -> str:
    """Hash: the batch's record (``records.BatchRecord``), counters and read position."""
    return f"{BATCH_PREFIX}{{{batch_id}}}"


def batches_of(owner: str) -> str:
    """Sorted set: the owner's batch ids by creation (milliseconds), for lists."""
    return f"{BATCHES_KEY_PREFIX}of:{owner}"


def batch_lease_key(batch_id: str) -> str:
    """String: the token of the gateway running the batch, with a ``LEASE_MS`` expiry."""
    return f"{BATCH_PREFIX}{{{batch_id}}}:lease"


def batch_inflight_key(batch_id: str) -> str:
    """Hash: request id -> its line (JSON), for each line sent and not yet recorded."""
    return f"{BATCH_PREFIX}{{{batch_id}}}:inflight"


def batch_results_key(batch_id: str, kind: str) -> str:
    """List: output (``kind`` ``out``) or error (``err``) lines recorded and not yet written
    to a part in storage."""
    return f"{BATCH_PREFIX}{{{batch_id}}}:{kind}"


def batch_parts_key(batch_id: str) -> str:
    """List: the storage names of the parts written, in order (``out/...`` and ``err/...``)."""
    return f"{BATCH_PREFIX}{{{batch_id}}}:parts"
