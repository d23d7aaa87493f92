"""The names and numbers of the wire: Redis keys and channels, limits, TTLs, and the
defaults of the environment variables both sides read (their names are in
``streamq.env_vars``). Everything here is part of PROTOCOL.md; the ``arq:`` names are
arq's own, which a test holds against ``arq.constants``."""

from __future__ import annotations

import re
import zlib
from typing import Final

PROTOCOL_VERSION: Final = 1

# --- arq's keys ----------------------------------------------------------------
DEFAULT_QUEUE: Final = "streamq:queue"
"""arq queue (a sorted set of job ids scored by run-at time in ms)."""
JOB_KEY_PREFIX: Final = "arq:job:"
"""arq's key for a job's payload; the job id is the request id."""
RESULT_KEY_PREFIX: Final = "arq:result:"
"""arq's key for a finished job's result."""
IN_PROGRESS_PREFIX: Final = "arq:in-progress:"
"""arq's key marking a running job; streamq keeps it as a short lease (``worker/lease.py``)."""
RETRY_KEY_PREFIX: Final = "arq:retry:"
"""arq's count of the tries a job has used."""
ABORT_KEY: Final = "arq:abort"
"""arq's sorted set of job ids to abort; streamq aborts through ``CANCEL_CHANNEL`` instead,
but arq's worker removes every finished job from it."""
HEALTH_CHECK_SUFFIX: Final = ":health-check"
"""arq writes ``<queue>:health-check`` from its poll loop, i.e. once the engine is up."""
JOB_FUNCTION: Final = "generate"
"""Name of the arq job function that workers register."""
JOB_EXPIRY_MS: Final = 86_400_000
"""A job nobody takes within a day is dropped (arq's default expiry)."""
LEASE_TTL_MS: Final = 3000
"""A running job's in-progress key is renewed to this far ahead; a dead worker's jobs
move on once it lapses."""

# --- streamq's keys and channels -------------------------------------------------
EVENTS_CHANNEL_PREFIX: Final = "streamq:events:"
"""Pub/sub channel of one request's events (``streamq:events:<request_id>``), and the
Redis Stream of its replay log."""
OWNER_KEY_PREFIX: Final = "streamq:owner:"
"""``streamq:owner:<request_id>``: the attempt that owns the request (it alone may write its
events, renew its lease and remove its job), or ``ENDED``."""
ENDED: Final = "ended"
"""The owner key's value once a request has its terminal event: no attempt may write again."""
WAKEUP_CHANNEL: Final = "streamq:wakeup"
"""Producers publish the queue name here after an enqueue, so idle workers start at once."""
CANCEL_CHANNEL: Final = "streamq:cancel"
"""Producers publish a request id here to cancel it while it runs; every worker listens."""
CANCELLED_KEY_PREFIX: Final = "streamq:cancelled:"
"""``streamq:cancelled:<request_id>``: a running request's cancel, recorded (the Unix ms,
Redis's clock, it was asked; kept ``JOB_EXPIRY_MS``) by ``cancel`` beside its message on
``CANCEL_CHANNEL``, so that a worker that missed the message (its listener reconnecting) or
takes the request over later finds it: the lease renewal and the claim report it.
``finish_job`` deletes it with the job; ``enqueue`` deletes a stale one."""
SUBSCRIBER_CHANNEL_PREFIX: Final = "streamq:subscriber:"
"""A subscriber's own channel (``streamq:subscriber:<random>``), which nobody publishes
on: it keeps a pub/sub connection subscribed while no request is followed."""
WORKERS_KEY: Final = "streamq:workers"
"""Live workers: a sorted set whose members are ``WorkerRegistration`` JSON, each scored
with the Unix ms (Redis's clock) until which that worker counts as live. Workers renew
their score every ``WORKER_RENEW_S`` to ``WORKER_TTL_MS`` ahead, so one sorted set read
routes by model, without a SCAN."""
TOKENIZER_INFO_PREFIX: Final = "streamq:tokenizer:"
"""``streamq:tokenizer:<model>``: the model's tokenizer configuration as ``vllm serve``'s
``/tokenizer_info`` returns it (JSON), written by each of its workers at start-up."""
MODELS_KEY: Final = "streamq:models"
"""Hash model name -> queue of every model a worker ever registered (never expires), so
a model whose workers are all gone (503) is told apart from one never served (404)."""
MODELS_SEEN_KEY: Final = "streamq:models:seen"
"""Sorted set model name -> the Unix ms (Redis's clock) a live worker last registered it:
producers keep accepting requests for a model seen within ``DEFAULT_MODEL_MEMORY_S`` while
none of its workers is alive (they wait in its queue for the next worker: scale to zero)."""
QUEUE_MODELS_KEY: Final = "streamq:queue-models"
"""Hash queue -> the base model its workers last registered: the ``model`` label of the
queue's waiting gauges."""
WORKER_TTL_MS: Final = 10_000
WORKER_RENEW_S: Final = 3.0
DEFAULT_MODEL_MEMORY_S: Final = 7 * 86_400
"""How long after its last live worker a model still takes requests (they wait for a worker):
a week, so that a model scaled to zero over a weekend still answers on Monday."""

# --- the data plane on a Redis Cluster (docs/redis-cluster.md) ----------------------------
EVENTS_BUCKET_TAGS: Final = ("10", "3", "61", "43", "11", "2", "60", "42", "12", "1", "63", "41", "13", "0", "62", "40")
"""On a Redis Cluster, request ``id``'s log, owner key and channel carry the hash tag
``{EVENTS_BUCKET_TAGS[crc32(id) % 16]}``, so that one script call writes a bucket of requests
(the measured cheaper split: docs/redis-cluster.md). Tag ``i`` is the smallest number whose
hash slot lies in the ``i``-th sixteenth of the 16384 slots, so the buckets spread evenly
over shards that split the slots evenly. Part of the protocol: it cannot change while logs live."""
REQUEST_RESERVATION_PREFIX: Final = "streamq:request:"
"""``streamq:request:<request_id>``: on the control plane, where the logs live on a Redis
Cluster, the id's reservation, set by ``enqueue`` and kept ``JOB_EXPIRY_MS + LOG_TTL_MS``, so
that an id is never reused while its job or events may be kept (one Redis checks the log
itself)."""
SHARDED_RECENT_ENDS_PREFIX: Final = "streamq:recent-ends:"
"""``streamq:recent-ends:{<tag>}``: on a Redis Cluster, ``RECENT_ENDS_KEY`` kept per bucket
(the scripts that write a terminal event push it in their own slot); readers merge them."""

# --- what the dashboard reads ---------------------------------------------------------
WORKER_STATS_KEY: Final = "streamq:worker-stats"
"""Hash worker id -> ``WorkerStats`` JSON (``streamq.protocol.worker_stats``): each worker
rewrites its own every ``WORKER_STATS_INTERVAL_S`` (counters and in-flight requests, read
from memory: nothing per token), and once more when it stops, saying why."""
WORKER_STATS_SEEN_KEY: Final = "streamq:worker-stats:seen"
"""Sorted set worker id -> Unix ms (Redis's clock) of its last stats report; reports
older than ``WORKER_STATS_KEEP_MS`` are dropped from both keys by the next report."""
WORKER_STATS_INTERVAL_S: Final = 1.0
WORKER_STATS_KEEP_MS: Final = 900_000
"""A worker that stopped (or vanished) stays on the dashboard this long, with its reason."""
RECENT_ENDS_KEY: Final = "streamq:recent-ends"
"""List, newest first, of the last ``RECENT_ENDS_MAX`` requests to end, each
``<request_id> <ended_ms> <terminal event JSON>``: pushed by the scripts that write a
terminal event (``append_and_publish``, ``end_request``), once per request."""
RECENT_ENDS_MAX: Final = 200

# --- API keys (the gateway's tenants) ------------------------------------------------
API_KEYS_KEY: Final = "streamq:api-keys"
"""Hash: SHA-256 (hex) of a key's secret -> its record (JSON: name and limits). The
secret itself is never stored; a gateway hashes the bearer token and looks it up."""
API_KEY_NAMES_KEY: Final = "streamq:api-key-names"
"""Hash: key name -> SHA-256 (hex) of its secret, so keys are managed by name."""
KEY_WINDOW_PREFIX: Final = "streamq:key-window:"
"""``streamq:key-window:<name>``: hash of the current minute's ``minute`` (Unix minutes,
Redis's clock), ``requests`` and ``tokens``, shared by every gateway."""
KEY_STREAMS_PREFIX: Final = "streamq:key-streams:"
"""``streamq:key-streams:<name>``: sorted set of the key's open requests, each scored
with the Unix ms until which its gateway vouches for it (renewed while it runs)."""
KEY_USAGE_PREFIX: Final = "streamq:key-usage:"
"""``streamq:key-usage:<name>``: hash of totals by model: ``requests:<model>``,
``prompt_tokens:<model>``, ``completion_tokens:<model>``."""
REQUEST_KEY_PREFIX: Final = "streamq:request-key:"
"""``streamq:request-key:<request_id>``: name of the API key that created a named request;
only that key may resume it. Kept as long as the replay log."""
FILE_KEY_PREFIX: Final = "streamq:file:"
"""``streamq:file:<id>`` (a file's record) and ``streamq:file:<id>:users`` (the batches reading
it): the gateway's Files API (``gateway.batch_api.names``)."""
FILES_KEY_PREFIX: Final = "streamq:files:"
"""The gateway's indexes of files: by owner, by expiry, bytes stored per owner."""
BATCH_KEY_PREFIX: Final = "streamq:batch:"
"""``streamq:batch:{<id>}`` and its keys (lease, lines in flight, results, parts): the gateway's
Batch API, one hash tag per batch."""
BATCHES_KEY_PREFIX: Final = "streamq:batches:"
"""The gateway's indexes of batches: by owner, and the unfinished ones its runners scan."""
RESPONSE_KEY_PREFIX: Final = "streamq:response:"
"""``streamq:response:<request_id>``: JSON of a stored Responses API response's request (its
body, model, creation time, the chat messages before its input); its output is read from the
request's replay log. Kept as long as the log."""
KEY_STREAM_LEASE_MS: Final = 30_000
"""An open request counts against its key's stream limit this long past its gateway's
last renewal: a gateway that dies frees its streams within this."""
KEY_WINDOW_MS: Final = 60_000
"""The window of the per-key request and token limits (a minute, on Redis's clock)."""
API_KEY_NAME_PATTERN: Final = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
"""Key names become parts of Redis key names and Prometheus labels."""

# --- priorities and tenants ---------------------------------------------------------
MIN_PRIORITY: Final = -(2**31)
MAX_PRIORITY: Final = 2**31 - 1
"""A request's ``priority`` (lower runs sooner, as in vLLM) is a 32-bit integer."""
TENANT_PATTERN: Final = API_KEY_NAME_PATTERN
"""Tenant names become parts of Redis key names, like API key names (which the gateway
uses as tenants)."""
DEFAULT_TENANT: Final = "default"
"""The tenant of a request that names none."""
TENANT_WEIGHTS_KEY: Final = "streamq:tenant-weights"
"""Hash tenant -> weight (a number > 0; default 1): within a priority, a tenant of weight
3 is given three jobs for each one of a tenant of weight 1 while both have jobs waiting."""
CLAIM_SCAN_INTERVAL_MS: Final = 1000
"""The claim reads arq's queue itself (for jobs nobody indexed) at most this often per
queue, all workers together; the index and lapsed leases are read at every claim."""
# --- prefix-aware pickup (docs/features/prefix-aware-pickup.md) ---------------------------------------------
AFFINITY_WINDOW_MS: Final = 200
"""How long a job routed to the worker that served its prefix waits for that worker
alone; past it, any worker takes it (``enqueue`` ARGV[16])."""
MAX_AFFINITY_WINDOW_MS: Final = 10_000
"""A longer window would let one worker's stall hold requests that another could serve."""
AFFINITY_BALANCE_SLACK: Final = 4
AFFINITY_BALANCE_FRACTION: Final = 0.5
"""A job is held for its prefix's worker only if that worker runs at most
``max(AFFINITY_BALANCE_SLACK, AFFINITY_BALANCE_FRACTION x theirs)`` jobs more than the
least busy live worker of the queue (``enqueue`` ARGV[17] and [18]); otherwise it is held
for the least busy one: conversations that start together on one worker (a burst claimed
at once), or a prefix many share, must not keep that worker busier than the others."""
AFFINITY_WORKER_TTL_MS: Final = 300_000
"""How long a worker that served a prefix stays its affinity worker (``<queue>:affinity:<key>``),
renewed at each claim of a request with that prefix (``claim_jobs`` ARGV[8]); vLLM may evict
it sooner."""
AFFINITY_FREE_TTL_MS: Final = LEASE_TTL_MS
"""A worker's ``<queue>:free:<worker>`` (its free slots, set at each claim: every
``poll_delay`` while it has one) lapses this long after its last claim: a full, stalled or
dead worker stops attracting jobs within it (``claim_jobs`` ARGV[9]). A lease's time, the
stall the rest of the queue tolerates: on a loaded host a worker's loop misses its claims
for over a second now and then (it was 1 s, and a conversation's follow-up then went to
another worker); a dead worker costs at most a job's affinity window meanwhile."""
MAX_CALLBACK_URL_CHARS: Final = 2048
"""A callback URL's length bound."""
MAX_CACHE_SALT_CHARS: Final = 128
"""A request's ``cache_salt`` length bound (vLLM's)."""

# --- completion callbacks ------------------------------------------------------------
CALLBACK_KEY_PREFIX: Final = "streamq:callback:"
"""``streamq:callback:<request_id>``: hash of a request's callback: ``spec`` (the request's
``callback`` as JSON, stored at enqueue so that paths ending a request outside any worker
find it), and once the request ended its delivery: ``state`` (``pending``, ``delivered``,
``failed``), ``attempts``, ``http_status``, ``last_error``, ``ended_ms``, ``delivered_ms``."""
CALLBACKS_KEY: Final = "streamq:callbacks"
"""Sorted set of request ids whose callback is due, scored by the Unix ms (Redis's clock)
from which a worker may send it: every end path adds the request; a worker that claims a
delivery pushes its score a lease ahead, so a worker that dies leaves it due again."""
CALLBACK_SIGNATURE_HEADER: Final = "X-Streamq-Signature"
"""``sha256=<hex>``: HMAC-SHA256, keyed with ``$STREAMQ_CALLBACK_SECRET``, of the timestamp
header's value, a ``.``, and the body's bytes."""
CALLBACK_TIMESTAMP_HEADER: Final = "X-Streamq-Timestamp"
"""Unix seconds when the delivery was signed: a receiver refuses old ones (replays)."""

# --- durable ends (docs/reliability.md) ------------------------------------------------
DURABILITY_KEY: Final = "streamq:durability"
"""String (JSON): what an end waits for before anyone is told, as the workers resolved their
``--durable-ends`` against the primaries: ``{"v": 1, "spec", "timeout_ms", "control":
{"replicas", "fsync"}, "data": {...}, "nodes": {"<host:port>": {...}}}`` (``nodes``: each
primary of a Redis Cluster data plane). Every worker writes it at each check (every
``DURABILITY_RECHECK_S``), kept ``DURABILITY_TTL_MS``; producers and gateways, which may not
run ``INFO``, read it (at most every ``DURABILITY_RECHECK_S``) to wait as workers do for the
ends they write themselves (``end_request``). Absent: nothing to wait for."""
DURABILITY_TTL_MS: Final = 3_600_000
DURABILITY_RECHECK_S: Final = 10.0
"""Workers read what their primaries offer (replicas online, AOF) this often, and right
after an end fell short; producers read ``DURABILITY_KEY`` at most this often."""

# --- limits -----------------------------------------------------------------------
REQUEST_ID_PATTERN: Final = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,127}")
"""Request ids become parts of Redis key and channel names: a narrow alphabet keeps
one request from reaching another's keys, and 128 characters bound the names."""
MAX_PROMPT_CHARS: Final = 1_000_000
"""A payload bound that fails fast long before Redis or the tokenizer struggles."""
MAX_PROMPT_TOKEN_IDS: Final = 1_000_000
"""Token ids in one ``prompt_token_ids`` (the same bound, in tokens; the model's context
is the real one, which the engine checks)."""
MAX_JOB_BYTES: Final = 8_000_000
"""Job payloads larger than this are refused before they are even parsed."""
LOG_MAXLEN: Final = 100_000
"""Entries kept per request's replay log (approximately: trimming is lazy). A request
has one entry per chunk event (one or more DELTAs) plus its final event."""
LOG_TTL_MS: Final = 3_600_000
"""How long a request's replay log outlives its last event."""

MAX_POOLING_INPUTS: Final = 2048
"""The most inputs one pooling request (``inputs``) may hold: OpenAI's bound per
embeddings request."""

MAX_POOLED_BYTES: Final = 16 * 1024 * 1024
"""The most bytes of results one pooling request may return in its ``pooled`` event (its
vectors, packed): far below Redis's default pub/sub output buffer limit (32 MB, past which
Redis drops the subscriber). A request whose inputs could pass it (inputs x the model's
``pooled_size`` x 4 bytes) is refused at enqueue."""

# --- environment variables: their defaults (their names: streamq.env_vars) ----------
DEFAULT_REDIS_URL: Final = "redis://localhost:6379"
DEFAULT_DRAIN_SECONDS: Final = 30
DEFAULT_KEEP_RESULT_S: Final = 3600
DEFAULT_CHECKPOINT_TOKENS: Final = 256
"""A request that is not streamed (``"stream": false``) has its tokens written to its log
every this many tokens of a completion, and when it ends: what a take-over after a worker's
death must generate again is at most this many tokens per completion."""
DEFAULT_DURABLE_ENDS: Final = "auto"
DEFAULT_DURABLE_ENDS_TIMEOUT_S: Final = 5.0
"""How long one wait for an end's replicas blocks (``--durable-ends-timeout-s``): below a
connection's reply timeout (10 s), since the wait blocks its connection. A worker's end not
acknowledged by then is held and confirmed again; other ends are told after one wait."""


def events_channel(request_id: str) -> str:
    """Name of the pub/sub channel that carries ``request_id``'s events."""
    return EVENTS_CHANNEL_PREFIX + request_id


def owner_key(request_id: str) -> str:
    """Name of the key naming the attempt that owns ``request_id`` (or ``ENDED``)."""
    return OWNER_KEY_PREFIX + request_id


def cancelled_key(request_id: str) -> str:
    """Name of the key recording a cancel of ``request_id`` while it ran (``CANCELLED_KEY_PREFIX``)."""
    return CANCELLED_KEY_PREFIX + request_id


def events_bucket(request_id: str) -> int:
    """The bucket of ``request_id`` on a Redis Cluster: CRC-32 (zlib's) of its UTF-8 bytes, mod 16."""
    return zlib.crc32(request_id.encode()) % len(EVENTS_BUCKET_TAGS)


def bucket_tag(request_id: str) -> str:
    """``{<tag>}``, the hash tag of ``request_id``'s data-plane names on a Redis Cluster."""
    return "{" + EVENTS_BUCKET_TAGS[events_bucket(request_id)] + "}"


def sharded_events_channel(request_id: str) -> str:
    """``streamq:events:{<tag>}:<request_id>``: the log and sharded channel on a Redis Cluster."""
    return f"{EVENTS_CHANNEL_PREFIX}{bucket_tag(request_id)}:{request_id}"


def sharded_owner_key(request_id: str) -> str:
    """``streamq:owner:{<tag>}:<request_id>``: the owner key on a Redis Cluster."""
    return f"{OWNER_KEY_PREFIX}{bucket_tag(request_id)}:{request_id}"


def sharded_recent_ends_key(request_id: str) -> str:
    """``streamq:recent-ends:{<tag>}``: where ``request_id``'s end is pushed on a Redis Cluster."""
    return SHARDED_RECENT_ENDS_PREFIX + bucket_tag(request_id)


def sharded_recent_ends_keys() -> list[str]:
    """Every bucket's recent-ends list on a Redis Cluster."""
    return [SHARDED_RECENT_ENDS_PREFIX + "{" + tag + "}" for tag in EVENTS_BUCKET_TAGS]


def waiting_key(queue: str, priority: int) -> str:
    """The sorted set of the request ids waiting on ``queue`` at ``priority`` (queued,
    not started), scored by enqueue time (Unix ms): a request's rank in it is its
    position among the requests of its priority."""
    return f"{queue}:waiting:{priority}"


def queue_waiting_key(queue: str) -> str:
    """``<queue>:waiting``: the sorted set of the request ids due on ``queue`` and not started,
    of every priority (waiting for a free worker, or for their lapsed lease to be taken over),
    scored by the Unix ms they began waiting. Its size is the waiting count an autoscaler
    reads (KEDA's ``redis`` scaler takes it as its ``listName``); its lowest score, the oldest."""
    return f"{queue}:waiting"


def callback_key(request_id: str) -> str:
    """Name of the hash holding ``request_id``'s callback and its delivery."""
    return CALLBACK_KEY_PREFIX + request_id


def affinity_worker_key(queue: str, key: str) -> str:
    """``<queue>:affinity:<key>``: prefix ``key``'s affinity worker, the worker that last
    claimed a request with that prefix (an adapter's key: the worker it was placed on)."""
    return f"{queue}:affinity:{key}"


def affinity_free_key(queue: str, worker_id: str) -> str:
    """``<queue>:free:<worker>``: the worker's free slots as of its last claim (lapses)."""
    return f"{queue}:free:{worker_id}"


def running_key(queue: str) -> str:
    """The sorted set of jobs claimed from ``queue``, each scored with the Unix ms at
    which the claim looks at it again (when its lease could have lapsed)."""
    return f"{queue}:running"


def is_valid_request_id(request_id: object) -> bool:
    """True if ``request_id`` may be used as a request id (and so in key names)."""
    return isinstance(request_id, str) and REQUEST_ID_PATTERN.fullmatch(request_id) is not None
