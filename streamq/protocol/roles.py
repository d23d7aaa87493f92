"""Least-privilege Redis ACL rules for each component: worker, producer, gateway.

Each role lists the commands it sends (its own and those its Lua scripts call: Redis checks
a script's every ``redis.call`` against the caller's permissions), the keys it reads and
writes, the keys it only reads (``%R~``), the pub/sub channels it uses, and writes it may
make only on given keys (Redis 7 selectors, ``Writes``). PROTOCOL.md
("Redis roles") shows the same rules as ``ACL SETUSER`` lines; a fast test holds the two
together and the devkit creates its users from them.

Redis checks the keys a script declares (``KEYS``) as read *and* written, so a script
that only reads a key for some role takes its name in ``ARGV``, or runs by ``EVALSHA_RO``.

``+waitaof`` (an end's wait for the AOF fsync) names a command Redis 7.0 does not have, and
Redis 7.0 refuses the whole rule: ``rules(waitaof=False)`` leaves it out for such a server.
"""

from __future__ import annotations

from dataclasses import dataclass

from streamq.protocol.names import (
    ABORT_KEY,
    API_KEY_NAMES_KEY,
    API_KEYS_KEY,
    BATCH_KEY_PREFIX,
    BATCHES_KEY_PREFIX,
    CALLBACK_KEY_PREFIX,
    CALLBACKS_KEY,
    CANCEL_CHANNEL,
    CANCELLED_KEY_PREFIX,
    DEFAULT_QUEUE,
    DURABILITY_KEY,
    EVENTS_CHANNEL_PREFIX,
    FILE_KEY_PREFIX,
    FILES_KEY_PREFIX,
    IN_PROGRESS_PREFIX,
    JOB_KEY_PREFIX,
    KEY_STREAMS_PREFIX,
    KEY_USAGE_PREFIX,
    KEY_WINDOW_PREFIX,
    MODELS_KEY,
    MODELS_SEEN_KEY,
    OWNER_KEY_PREFIX,
    QUEUE_MODELS_KEY,
    RECENT_ENDS_KEY,
    REQUEST_KEY_PREFIX,
    REQUEST_RESERVATION_PREFIX,
    RESPONSE_KEY_PREFIX,
    RESULT_KEY_PREFIX,
    RETRY_KEY_PREFIX,
    SHARDED_RECENT_ENDS_PREFIX,
    SUBSCRIBER_CHANNEL_PREFIX,
    TENANT_WEIGHTS_KEY,
    TOKENIZER_INFO_PREFIX,
    WAKEUP_CHANNEL,
    WORKER_STATS_KEY,
    WORKER_STATS_SEEN_KEY,
    WORKERS_KEY,
)

QUEUE_KEY_PATTERNS = (DEFAULT_QUEUE, DEFAULT_QUEUE + ":*")
"""Queues the roles reach: ``streamq:queue`` and ``streamq:queue:<name>`` (and so each
queue's ``:health-check``). A queue named otherwise needs its own pattern added."""

CONNECTION_COMMANDS = ("ping", "hello", "auth", "client|setinfo")
"""What every redis-py connection sends: ``PING`` (health checks), ``HELLO``/``AUTH``
(log in), ``CLIENT SETINFO`` (redis-py names its library on connect)."""
WAIT_COMMANDS = ("wait", "waitaof")
"""What a role that ends requests sends after an end (``streamq.broker.durability``):
``WAIT`` for its replicas and ``WAITAOF`` for the primary's fsync (Redis 7.2 and later,
Valkey; left out for Redis 7.0 by ``rules(waitaof=False)``)."""


@dataclass(frozen=True)
class Writes:
    """A Redis 7 selector: ``commands`` allowed on ``keys`` (read and written) only."""

    commands: tuple[str, ...]
    keys: tuple[str, ...]

    def rule(self) -> str:
        return "(" + " ".join([*(f"+{command}" for command in self.commands), *(f"~{key}" for key in self.keys)]) + ")"


@dataclass(frozen=True)
class Role:
    """One ACL user's rules."""

    name: str
    """The component, and the suggested ACL user name (``streamq-<name>``)."""
    commands: tuple[str, ...]
    keys: tuple[str, ...]
    """Key patterns read and written (``~pattern``) by any of ``commands``."""
    read_only_keys: tuple[str, ...]
    """Key patterns only read (``%R~pattern``)."""
    channels: tuple[str, ...]
    """Pub/sub channel patterns, published or subscribed (``&pattern``)."""
    writes: tuple[Writes, ...] = ()
    """Writes allowed only as paired here: a command with the keys it may change."""

    @property
    def user(self) -> str:
        return f"streamq-{self.name}"

    def rules(self, *, waitaof: bool = True) -> list[str]:
        """The ACL rules, in ``ACL SETUSER`` (and ACL file) syntax, after the user's name
        and password: nothing is granted that is not listed here. ``waitaof=False``: for a
        server without ``WAITAOF`` (Redis 7.0), which refuses a rule naming it."""
        return [
            "resetkeys",
            "resetchannels",
            "-@all",
            *(f"+{command}" for command in self.commands if waitaof or command != "waitaof"),
            *(f"~{pattern}" for pattern in self.keys),
            *(f"%R~{pattern}" for pattern in self.read_only_keys),
            *(f"&{pattern}" for pattern in self.channels),
            *(selector.rule() for selector in self.writes),
        ]

    def setuser(self, password: str = "<password>", *, waitaof: bool = True) -> str:
        """The ``ACL SETUSER`` line that creates this role's user (``waitaof``: see ``rules``)."""
        return " ".join(["ACL SETUSER", self.user, "on", f">{password}", *self.rules(waitaof=waitaof)])


WORKER = Role(
    name="worker",
    commands=(
        *CONNECTION_COMMANDS,
        # streamq's scripts (claim, leases, replay log, registration) and what they call
        "evalsha",
        "script|load",
        "time",
        "zrangebyscore",
        "zremrangebyscore",
        "zadd",
        "hset",
        "xadd",
        # an ended log rewritten at its size (append_and_publish, end_request)
        "dump",
        "restore",
        # the claim's index: bands, tenants' passes, FIFOs, tenant weights, lapsed leases
        "zrange",
        "zpopmin",
        "incr",
        "hget",
        "hdel",
        "hexists",
        "pttl",
        "xrange",
        "xrevrange",
        "xlen",  # a log's last entry, when it was never trimmed (append_and_publish)
        # completion callbacks: schedule, claim and record deliveries (and hexists above)
        "hmget",
        # arq's own bookkeeping: read a job, count its tries, store its result, finish it
        "get",
        "set",
        "psetex",
        "setex",
        "incrby",  # redis-py sends INCR as INCRBY
        "expire",
        "pexpire",
        "exists",
        "del",
        "zrem",
        "zincrby",
        "zcard",
        "zscore",
        "multi",
        "exec",
        "discard",
        "watch",
        "unwatch",
        "info",  # arq's start-up log line (plain `arq worker.WorkerSettings`)
        "dbsize",
        # events out, wake-ups and cancels in
        "publish",
        "subscribe",
        "unsubscribe",
        "spublish",  # events out where a Redis Cluster carries them (sharded pub/sub)
        # the dashboard's data: the ends of requests (append_and_publish, end_request)
        "lpush",
        "ltrim",
        "mget",  # where a Redis Cluster carries the owner keys: read ahead of the control scripts
        # durable ends: each end, callback claim and record waits for its replicas (and the
        # AOF); INFO above reads what the primary offers, and the result goes to streamq:durability
        *WAIT_COMMANDS,
    ),
    keys=(
        *QUEUE_KEY_PATTERNS,
        JOB_KEY_PREFIX + "*",
        IN_PROGRESS_PREFIX + "*",
        RETRY_KEY_PREFIX + "*",
        RESULT_KEY_PREFIX + "*",
        ABORT_KEY,
        EVENTS_CHANNEL_PREFIX + "*",
        OWNER_KEY_PREFIX + "*",
        WORKERS_KEY,
        MODELS_KEY,
        MODELS_SEEN_KEY,
        QUEUE_MODELS_KEY,
        CALLBACK_KEY_PREFIX + "*",
        CALLBACKS_KEY,
        WORKER_STATS_KEY,
        WORKER_STATS_SEEN_KEY,
        RECENT_ENDS_KEY,
        SHARDED_RECENT_ENDS_PREFIX + "*",
        TOKENIZER_INFO_PREFIX + "*",  # its model's tokenizer, for the gateway's /tokenizer_info
        DURABILITY_KEY,  # what an end waits for, for the producers
    ),
    # a cancel's record: read (the claim, the lease renewal, the cancel listener), deleted
    # with its job (finish_job), never written
    read_only_keys=(TENANT_WEIGHTS_KEY, CANCELLED_KEY_PREFIX + "*"),
    channels=(EVENTS_CHANNEL_PREFIX + "*", WAKEUP_CHANNEL, CANCEL_CHANNEL),
    writes=(Writes(("del",), (CANCELLED_KEY_PREFIX + "*",)),),
)

PRODUCER = Role(
    name="producer",
    commands=(
        *CONNECTION_COMMANDS,
        # reads: a request's state, its replay log, the queue's depth, the registry
        # (EVALSHA_RO), and what the enqueue, cancel and end-request scripts read
        "evalsha_ro",
        "script|load",
        "time",
        "exists",
        "get",
        "zcard",
        "zrangebyscore",
        "hvals",
        "hgetall",
        "hget",  # cancel: a queued job's priority and tenant in the claim's index
        "xrange",
        "xrevrange",
        # a request's status (request_status, by EVALSHA_RO): its queue entry and rank
        "zscore",
        "zrank",
        "zrange",
        "hexists",  # end_request: a callback stored at enqueue?
        "xlen",  # end_request: a log short enough to rewrite at its size (DUMP, RESTORE)
        "dump",
        # Redis's memory and its policy (INFO memory): the start-up check, a stalled batch's
        # reason, the gateway's /metrics and dashboard
        "info",
        # enqueue: the adapters each worker is the affinity worker of, for an adapter with none live
        "zcount",
        "pttl",
        # following a request; the wake-up (enqueue), a cancel, a cancelled request's end
        "publish",
        "subscribe",
        "unsubscribe",
        # the same where a Redis Cluster carries the events (sharded pub/sub)
        "spublish",
        "ssubscribe",
        "sunsubscribe",
        # durable ends: the end of a request it takes off its queue waits for its replicas as
        # the workers' record (streamq:durability) says
        *WAIT_COMMANDS,
    ),
    keys=(),
    read_only_keys=(
        *QUEUE_KEY_PATTERNS,
        JOB_KEY_PREFIX + "*",
        IN_PROGRESS_PREFIX + "*",
        RESULT_KEY_PREFIX + "*",
        RETRY_KEY_PREFIX + "*",
        EVENTS_CHANNEL_PREFIX + "*",
        OWNER_KEY_PREFIX + "*",
        WORKERS_KEY,
        MODELS_KEY,
        MODELS_SEEN_KEY,
        QUEUE_MODELS_KEY,
        CALLBACK_KEY_PREFIX + "*",
        REQUEST_RESERVATION_PREFIX + "*",
        DURABILITY_KEY,
    ),
    channels=(
        EVENTS_CHANNEL_PREFIX + "*",
        SUBSCRIBER_CHANNEL_PREFIX + "*",
        WAKEUP_CHANNEL,
        CANCEL_CHANNEL,
    ),
    writes=(
        # the enqueue, cancel and end-request scripts, by the keys they declare
        Writes(
            ("evalsha",),
            (
                *QUEUE_KEY_PATTERNS,
                JOB_KEY_PREFIX + "*",
                EVENTS_CHANNEL_PREFIX + "*",
                OWNER_KEY_PREFIX + "*",
                REQUEST_RESERVATION_PREFIX + "*",
                CALLBACK_KEY_PREFIX + "*",  # schedule_callback, where a Redis Cluster carries the events
                CALLBACKS_KEY,
                CANCELLED_KEY_PREFIX + "*",  # cancel, enqueue
            ),
        ),
        # an id's reservation where a Redis Cluster carries the logs (enqueue)
        Writes(("set",), (REQUEST_RESERVATION_PREFIX + "*",)),
        Writes(("set", "del"), (JOB_KEY_PREFIX + "*",)),  # store a job; drop a cancelled one
        # record the cancel of a running request (cancel); clear a stale record (enqueue)
        Writes(("set", "del"), (CANCELLED_KEY_PREFIX + "*",)),
        Writes(("zadd", "zrem"), QUEUE_KEY_PATTERNS),  # queue it; take a cancelled one off
        Writes(("hset", "hdel", "incr"), QUEUE_KEY_PATTERNS),  # index it for the claim; unindex it
        # hold it for the worker of its prefix: one free slot and one job more for that worker
        Writes(("decr", "zincrby"), QUEUE_KEY_PATTERNS),
        # an adapter with no live affinity worker: the worker it is held for is made its one
        Writes(("set",), tuple(f"{DEFAULT_QUEUE}{infix}:affinity:*" for infix in ("", ":*"))),
        Writes(("pexpire",), tuple(f"{DEFAULT_QUEUE}{infix}:adapters:*" for infix in ("", ":*"))),
        # a request for an adapter not every worker serves: which workers may run it
        Writes(("set",), tuple(f"{DEFAULT_QUEUE}{infix}:eligible:*" for infix in ("", ":*"))),
        # kept power: ending a queued request it cancels (end_request) writes its log
        Writes(("xadd", "restore", "pexpire"), (EVENTS_CHANNEL_PREFIX + "*",)),
        Writes(("set",), (OWNER_KEY_PREFIX + "*",)),
        # a request's callback, stored at enqueue; made due when it cancels a queued one
        Writes(("hset", "pexpire"), (CALLBACK_KEY_PREFIX + "*",)),
        Writes(("zadd",), (CALLBACKS_KEY,)),
        # the cancelled request's end, pushed to the dashboard's list (end_request)
        Writes(("lpush", "ltrim"), (RECENT_ENDS_KEY, SHARDED_RECENT_ENDS_PREFIX + "*")),
    ),
)

GATEWAY = Role(
    name="gateway",
    commands=(
        *PRODUCER.commands,
        # API keys: read a key's record, admit and finish its requests (the admission
        # scripts), renew its open streams, record and read who owns a named request
        "evalsha",
        "hmget",
        "hlen",
        "hset",
        "hincrby",
        "zadd",
        "zrem",
        "zremrangebyscore",
        "pexpire",
        "set",
        # the dashboard: workers' reports (hgetall, zrange above) and the recent ends
        "lrange",
        # the Files and Batch APIs: records (hashes), indexes (sets, sorted sets), a batch's
        # lines in flight and results (its scripts: hdel, rpush, ltrim), its lease (set, get,
        # del), and the transactions that keep a record and its indexes together
        "hdel",
        "del",
        "sadd",
        "srem",
        "smembers",
        "scard",
        "zrevrank",
        "zrevrange",  # newest first (redis-py sends ZRANGE ... REV as ZREVRANGE)
        "rpush",
        "ltrim",
        "llen",
        "watch",
        "unwatch",
        "multi",
        "exec",
        "discard",
    ),
    keys=(
        KEY_WINDOW_PREFIX + "*",
        KEY_STREAMS_PREFIX + "*",
        KEY_USAGE_PREFIX + "*",
        REQUEST_KEY_PREFIX + "*",
        RESPONSE_KEY_PREFIX + "*",
        FILE_KEY_PREFIX + "*",
        FILES_KEY_PREFIX + "*",
        BATCH_KEY_PREFIX + "*",
        BATCHES_KEY_PREFIX + "*",
    ),
    read_only_keys=(
        *PRODUCER.read_only_keys,
        API_KEYS_KEY,
        API_KEY_NAMES_KEY,
        WORKER_STATS_KEY,
        WORKER_STATS_SEEN_KEY,
        RECENT_ENDS_KEY,
        SHARDED_RECENT_ENDS_PREFIX + "*",
        TOKENIZER_INFO_PREFIX + "*",
    ),
    channels=PRODUCER.channels,
    writes=PRODUCER.writes,
)
"""The gateway is a producer (the library) behind HTTP, plus its API keys' windows, open
streams, usage and request owners, the Responses API's stored requests, and the Files and
Batch APIs' records; it only reads
the keys themselves (``streamq keys`` writes them, as an administrator), the workers'
reports and recent ends its dashboard shows, and the tokenizers workers describe
(``/tokenizer_info``)."""

ROLES = (WORKER, PRODUCER, GATEWAY)
