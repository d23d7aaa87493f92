"""What a Redis does when it is full, read at start-up (``INFO memory``), as Sidekiq and
BullMQ check it: streamq needs ``maxmemory-policy noeviction`` (docs/operations/redis.md).

Under an evicting policy a full Redis deletes keys without a word: a queued job (a request
that never runs), a lease (a job run twice), a replay log (a stream cut off), a worker's
registration (its model refused as served by nobody). ``volatile-*`` policies delete only
keys with an expiry, but nearly all of streamq's have one. ``allkeys-*`` policies delete
any key, the queues and registrations too: a worker refuses to start under one unless the
deployment says it accepts that (``--allow-evicting-redis``), since managed Redis services
default to evicting policies and the loss would otherwise go unnoticed until it happens.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from streamq.env_vars import ALLOW_EVICTING_ENV
from streamq.environment import flag_from_env

"""Set to ``1`` (or ``true``/``yes``/``on``): start under an ``allkeys-*`` policy, warned."""

WHAT_EVICTION_LOSES = "queued jobs (requests that never run), leases (jobs run twice), replay logs (streams cut off)"


class EvictingRedis(Exception):
    """Redis's ``maxmemory-policy`` may delete any of streamq's keys, and the deployment did
    not say it accepts that."""


@dataclass(frozen=True)
class MemoryPolicy:
    """Redis's memory settings and use, as ``INFO memory`` reports them."""

    policy: str
    maxmemory: int
    """Bytes; 0: no limit."""
    used: int

    @classmethod
    def of_info(cls, info: Mapping[str, Any]) -> MemoryPolicy | None:
        """From ``INFO memory``'s fields; ``None`` where they are missing (a proxy, a cluster's merged reply)."""
        policy, limit, used = info.get("maxmemory_policy"), info.get("maxmemory"), info.get("used_memory")
        if not isinstance(policy, str) or not isinstance(limit, int) or not isinstance(used, int):
            return None
        return cls(policy, limit, used)

    @property
    def evicts_any_key(self) -> bool:
        return self.policy.startswith("allkeys-")

    @property
    def evicts(self) -> bool:
        return self.policy != "noeviction"

    @property
    def full(self) -> bool:
        """Its memory has reached its limit: writes are refused (``noeviction``) or evict."""
        return 0 < self.maxmemory <= self.used

    def describe(self) -> str:
        limit = f"maxmemory {self.maxmemory:,} bytes" if self.maxmemory else "no maxmemory"
        return f"maxmemory-policy {self.policy}, {limit}, {self.used:,} bytes used"

    def warning(self) -> str | None:
        """What an operator must hear, or ``None`` under ``noeviction``."""
        if not self.evicts:
            return None
        which = "any key, queues and workers' registrations too" if self.evicts_any_key else "keys with an expiry"
        return (
            f"Redis's maxmemory-policy is {self.policy}: when full it deletes {which}, and streamq's "
            f"{WHAT_EVICTION_LOSES} go without a word. Set maxmemory-policy noeviction "
            "(docs/operations/redis.md): a full Redis then refuses writes, and streamq says so"
        )


async def read_memory_policy(redis: Any) -> MemoryPolicy | None:
    """Redis's memory settings, or ``None`` where they cannot be read (``INFO`` refused to
    this Redis user, a proxy without it)."""
    try:
        info = await redis.info("memory")
    except Exception:
        return None
    return MemoryPolicy.of_info(info) if isinstance(info, Mapping) else None


async def eviction_cause(redis: Any) -> str | None:
    """Why a key streamq wrote may be gone, where Redis says it evicted keys: its policy and
    how many it evicted since it started, in words for an error message; ``None`` where it
    evicted none or cannot tell (``INFO`` refused, a proxy)."""
    try:
        info = await redis.info("memory", "stats")
    except Exception:
        return None
    policy = MemoryPolicy.of_info(info) if isinstance(info, Mapping) else None
    if policy is None or not policy.evicts:
        return None
    evicted = info.get("evicted_keys")
    if not isinstance(evicted, int) or evicted == 0:
        return None
    return (
        f"under maxmemory-policy {policy.policy} a full Redis evicts keys, {evicted:,} since it started: "
        "set noeviction, as docs/operations/redis.md says"
    )


def allow_evicting_from_env(environ: Mapping[str, str] = os.environ) -> bool:
    return flag_from_env(ALLOW_EVICTING_ENV, environ, default=False)


def check_memory_policy(policy: MemoryPolicy, *, allow_evicting: bool) -> str | None:
    """The warning to log for ``policy`` (``None``: nothing to say); raises ``EvictingRedis``
    under an ``allkeys-*`` policy unless ``allow_evicting``."""
    warning = policy.warning()
    if policy.evicts_any_key and not allow_evicting:
        raise EvictingRedis(
            f"{warning}. Refusing to start; --allow-evicting-redis (${ALLOW_EVICTING_ENV}=1) starts anyway"
        )
    return warning
