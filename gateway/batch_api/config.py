"""The Batch API's settings, fixed when the gateway starts (``python -m gateway`` flags)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

from streamq.env_vars import FILES_URL_ENV

DEFAULT_MAX_FILE_BYTES: Final = 200 * 1024 * 1024
"""OpenAI's bound on a batch's input file: 200 MB."""
DEFAULT_MAX_LINES: Final = 50_000
"""OpenAI's bound on the requests of one batch."""
DAY_S: Final = 24 * 3600
DEFAULT_OUTPUT_EXPIRY_S: Final = 30 * DAY_S
"""A batch's output and error files are kept 30 days unless its ``output_expires_after`` says."""
DEFAULT_BATCH_PRIORITY: Final = 10
"""A batch's requests run below online ones (priority 0; lower runs sooner)."""
DEFAULT_MAX_STORED_BYTES: Final = 10 * 1024**3
"""What one tenant may keep in files (inputs and outputs together) before uploads get 429."""
DEFAULT_MAX_RUNNING_BATCHES: Final = 16
"""Batches one tenant may have unfinished at once before creating another gets 429."""
DEFAULT_ONLINE_RESERVE: Final = 4
"""Slots of each live worker the batches leave free (at most an eighth of its slots), so
that an online request starts at once rather than after a batch line ends (vLLM preempts a running request for KV-cache
room, never for a sequence slot)."""
LEASE_MS: Final = 3000
"""A batch's owner renews its lease three times within it; a gateway that dies hands its
batches over within this, plus one scan."""
COMPLETION_WINDOWS: Final = {"24h": DAY_S}
"""The windows OpenAI takes; a deployment may allow more (``--batch-completion-window``)."""


def default_files_url() -> str:
    """Where files live without ``--files-url``: ``$STREAMQ_FILES_URL``, else one directory
    per user on this machine, so every gateway on it shares it with no flag
    (``$XDG_DATA_HOME/streamq/files``)."""
    if configured := os.environ.get(FILES_URL_ENV):
        return configured
    data = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return str(Path(data) / "streamq" / "files")


@dataclass(frozen=True)
class BatchApiConfig:
    files_url: str = field(default_factory=default_files_url)
    """A local directory, or ``s3://bucket/prefix`` (credentials and endpoint from ``s3_options``
    or the usual ``AWS_*`` variables)."""
    s3_options: dict[str, str] = field(default_factory=dict)
    """Passed to s3fs: ``endpoint_url``, ``key``, ``secret``, ``region_name`` where given."""
    max_file_bytes: int = DEFAULT_MAX_FILE_BYTES
    max_lines: int = DEFAULT_MAX_LINES
    completion_windows: dict[str, int] = field(default_factory=lambda: dict(COMPLETION_WINDOWS))
    """Window name -> seconds."""
    output_expiry_s: int = DEFAULT_OUTPUT_EXPIRY_S
    batch_priority: int = DEFAULT_BATCH_PRIORITY
    max_stored_bytes: int = DEFAULT_MAX_STORED_BYTES
    """Per tenant (per API key; the one namespace without keys)."""
    max_running_batches: int = DEFAULT_MAX_RUNNING_BATCHES
    """Per tenant."""
    online_reserve: int = DEFAULT_ONLINE_RESERVE
    """Per live worker."""
    lease_ms: int = LEASE_MS
    run_batches: bool = True
    """Whether this gateway runs batches (takes leases); every one does by default."""
