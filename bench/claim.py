"""``python -m bench.claim``: Redis CPU per claimed job, the priority-and-tenant claim
against the claim it replaced, and what prefix-aware pickup adds, side by side, in one run.

For each depth (jobs running, jobs waiting, tenants) a fresh database is filled the way
each claim finds it in service, then ``--claims`` claims of one job each (a worker whose
slot just freed: the common case) run back to back, each claimed job finishing at once
(so the running jobs stay as many), and Redis's own accounting of the claims is read:
``INFO commandstats`` (the microseconds spent in ``EVALSHA``, and the calls, one round
trip each) and the server's CPU time from ``/proc`` (coarser: 10 ms ticks, and it counts
the finishing commands too, the same on both sides).

- The old claim (``bench/baseline_claim_jobs.lua``, a verbatim copy) reads arq's queue
  from its head, where the running jobs are (they stay queued until they finish), and
  tries ``SET NX`` on each until one is free.
- The new claim (``streamq/protocol/lua/claim_jobs.lua``) starts with every running job's
  lease due for a look (as once per lease period in service: each renewed lease is
  rescored once per 3 s), then pops the index. The jobs are queued with the new enqueue
  script, spread over the tenants in turn, without affinity keys.
- The claim before prefix-aware pickup (``bench/baseline_claim_jobs_pre_affinity.lua``, a
  verbatim copy), on the same jobs: what affinity costs a claim of a job without keys
  (the held-job and expiry checks, the worker's free slots and load).
- The new claim on jobs with four affinity keys each, every one held for the claiming
  worker by enqueue (the claim takes it from the worker's own set and names the worker
  the owner of its longest and shortest keys), and the same jobs not held (no worker
  known: taken from the index, the two owner keys set).
"""

from __future__ import annotations

import argparse
import itertools
import statistics
from dataclasses import dataclass, replace
from pathlib import Path

import redis

from bench.config import int_list
from bench.cpu import cpu_seconds
from devkit.redis_server import RedisServer
from streamq.protocol import IN_PROGRESS_PREFIX, LEASE_TTL_MS
from streamq.protocol.names import (
    AFFINITY_FREE_TTL_MS,
    AFFINITY_OWNER_TTL_MS,
    TENANT_WEIGHTS_KEY,
    affinity_free_key,
    affinity_owner_key,
    running_key,
)
from streamq.protocol.script_calls import ClaimJobs, Enqueue
from streamq.protocol.scripts import script_text

QUEUE = "streamq:queue"
BASELINE = Path(__file__).with_name("baseline_claim_jobs.lua")
PRE_AFFINITY = Path(__file__).with_name("baseline_claim_jobs_pre_affinity.lua")
WORKER = "bench-worker"
AFFINITY_KEYS = 4
"""Keys per job: a conversation's third turn, or a prompt of 2-4k characters."""
PAGE = 100
"""arq's ``queue_read_limit`` for a worker of up to 20 slots (``max(max_jobs * 5, 100)``)."""
SETUP_BATCH = 2000


@dataclass(frozen=True)
class Cost:
    """What ``claims`` claims cost Redis."""

    jobs: int
    calls: int
    script_us: float
    cpu_s: float

    @property
    def us_per_job(self) -> float:
        return self.script_us / max(1, self.jobs)

    @property
    def cpu_us_per_job(self) -> float:
        return self.cpu_s * 1e6 / max(1, self.jobs)

    @property
    def round_trips_per_job(self) -> float:
        return self.calls / max(1, self.jobs)


@dataclass(frozen=True)
class Row:
    running: int
    waiting: int
    tenants: int
    old: Cost
    new: Cost
    pre_affinity: Cost
    held: Cost
    """Jobs with keys, held for the claiming worker."""
    keyed: Cost
    """Jobs with keys, no worker known for them."""

    @property
    def ratio(self) -> float:
        return self.new.us_per_job / self.old.us_per_job

    def affinity_ratio(self, cost: Cost) -> float:
        """What a claim costs with affinity, against the claim before it."""
        return cost.us_per_job / self.pre_affinity.us_per_job


def _fill_running(client: redis.Redis, running: int, *, new: bool, now_ms: int) -> None:
    """``running`` jobs at the head of the queue, each with a held lease."""
    pipe = client.pipeline(transaction=False)
    for i in range(running):
        job_id = f"running-{i}"
        pipe.zadd(QUEUE, {job_id: now_ms - 10_000_000 + i})
        pipe.set(IN_PROGRESS_PREFIX + job_id, "some-worker:1", px=3_600_000)
        if new:
            pipe.zadd(running_key(QUEUE), {job_id: 0})  # its lease is due for a look
    pipe.execute()


def _fill_waiting(client: redis.Redis, count: int, tenants: int, *, new: bool, now_ms: int, keys: bool = False) -> None:
    """``count`` jobs queued after the running ones: by the new enqueue script (indexed,
    tenants in turn; with ``keys``, four affinity keys each) or, for the old claim, by the
    ``ZADD`` its enqueue made."""
    enqueue = client.execute_command("SCRIPT LOAD", script_text("enqueue"))
    for start in range(0, count, SETUP_BATCH):
        pipe = client.pipeline(transaction=False)
        for i in range(start, min(count, start + SETUP_BATCH)):
            job_id = f"waiting-{i}"
            if new:
                prefixes = [f"{i:012x}-{level}" for level in range(AFFINITY_KEYS - 1)] + ["shared-prefix"]
                call = Enqueue.of_request(
                    job_id,
                    QUEUE,
                    b"{}",
                    expiry_ms=600_000,
                    tenant=f"t{i % tenants}",
                    affinity_keys=prefixes if keys else (),
                    window_ms=60_000,
                    balance_slack=1_000_000,
                )
                pipe.execute_command(*call.command(enqueue))
            else:
                pipe.zadd(QUEUE, {job_id: now_ms - 1_000_000 + i})
        pipe.execute()


def _measure(
    server: RedisServer,
    client: redis.Redis,
    script: str,
    claim: ClaimJobs,
    claims: int,
    *,
    new: bool,
    counts: int = 0,
) -> Cost:
    """``claims`` claims of one job each; each job claimed then finishes at once (arq's
    ``ZREM`` and ``DEL``), so the running jobs stay as many as the depth says. For the new
    claim its entry in ``<queue>:running`` is left due for a look, so the claims pay for
    clearing it as in service. ``counts``: the claim's reply starts with that many counts
    (the affinity claim's hits, misses and expired holds) after Redis's time."""
    sha = client.execute_command("SCRIPT LOAD", script)
    command = claim.command(sha)  # a baseline script reads the first of its arguments only
    assert server.process is not None
    client.config_resetstat()
    cpu_before = cpu_seconds(server.process.pid)
    jobs = 0
    for _ in range(claims):
        reply = client.execute_command(*command)
        claimed = [job_id.decode() for job_id in reply[1 + counts : 2 + counts]]  # a claim of one job at most
        jobs += len(claimed)
        pipe = client.pipeline(transaction=False)
        for job_id in claimed:
            pipe.zrem(QUEUE, job_id)
            pipe.delete(IN_PROGRESS_PREFIX + job_id)
            if new:
                pipe.zadd(running_key(QUEUE), {job_id: 0})
        pipe.execute()
    cpu = cpu_seconds(server.process.pid) - cpu_before
    stats = client.execute_command("INFO", "commandstats")["cmdstat_evalsha"]
    return Cost(jobs=jobs, calls=int(stats["calls"]), script_us=float(stats["usec"]), cpu_s=cpu)


def measure_case(server: RedisServer, running: int, waiting: int, tenants: int, claims: int) -> Row:
    """One depth: each claim on a freshly filled database."""
    client = redis.Redis.from_url(server.url)
    pre_affinity = PRE_AFFINITY.read_text(encoding="utf-8")
    common = ClaimJobs(
        queue=QUEUE, wanted=1, lease_ms=LEASE_TTL_MS, page=PAGE, in_progress_prefix=IN_PROGRESS_PREFIX, worker_id=WORKER
    )
    affine = replace(common, owner_ttl_ms=AFFINITY_OWNER_TTL_MS, free_ttl_ms=AFFINITY_FREE_TTL_MS, running=running)

    def fill(*, new: bool, keys: bool = False, held: bool = False) -> None:
        client.flushall()
        now_ms = int(client.execute_command("TIME")[0]) * 1000
        if held:  # the worker served the prefix every job shares, and has room
            client.set(affinity_owner_key(QUEUE, "shared-prefix"), WORKER)
            client.set(affinity_free_key(QUEUE, WORKER), 10 * (waiting + claims))
        _fill_running(client, running, new=new, now_ms=now_ms)
        _fill_waiting(client, waiting + claims, tenants, new=new, now_ms=now_ms, keys=keys)
        if new:
            client.hset(TENANT_WEIGHTS_KEY, mapping={f"t{i}": 1 + i % 3 for i in range(tenants)})

    def measure(script: str, claim: ClaimJobs, *, new: bool = True, counts: int = 0) -> Cost:
        cost = _measure(server, client, script, claim, claims, new=new, counts=counts)
        assert cost.jobs == claims, f"claimed {cost.jobs} of {claims}"
        return cost

    try:
        fill(new=False)
        old = measure(BASELINE.read_text(encoding="utf-8"), common, new=False)
        fill(new=True)
        pre = measure(pre_affinity, common)
        fill(new=True)
        new = measure(script_text("claim_jobs"), affine, counts=3)
        fill(new=True, keys=True, held=True)
        held = measure(script_text("claim_jobs"), affine, counts=3)
        assert client.hlen(f"{QUEUE}:held") == waiting, "every job was held for the worker"
        fill(new=True, keys=True)
        keyed = measure(script_text("claim_jobs"), affine, counts=3)
        return Row(running, waiting, tenants, old=old, new=new, pre_affinity=pre, held=held, keyed=keyed)
    finally:
        client.close()


def table(rows: list[Row]) -> str:
    header = (
        "| running | waiting | tenants | old µs/job | new µs/job | new/old | old CPU µs/job | new CPU µs/job "
        "| round trips/job (old, new) |\n|---|---|---|---|---|---|---|---|---|"
    )
    lines = [
        f"| {r.running} | {r.waiting} | {r.tenants} | {r.old.us_per_job:.1f} | {r.new.us_per_job:.1f} "
        f"| {r.ratio:.2f} | {r.old.cpu_us_per_job:.0f} | {r.new.cpu_us_per_job:.0f} "
        f"| {r.old.round_trips_per_job:.1f}, {r.new.round_trips_per_job:.1f} |"
        for r in rows
    ]
    return "\n".join([header, *lines])


def affinity_table(rows: list[Row]) -> str:
    """Redis time per claimed job with prefix-aware pickup against the claim before it."""
    header = (
        "| running | waiting | tenants | before µs/job | no keys µs/job (×) | held, 4 keys µs/job (×) "
        "| not held, 4 keys µs/job (×) | round trips/job |\n|---|---|---|---|---|---|---|---|"
    )
    lines = [
        f"| {r.running} | {r.waiting} | {r.tenants} | {r.pre_affinity.us_per_job:.1f} "
        f"| {r.new.us_per_job:.1f} ({r.affinity_ratio(r.new):.2f}) "
        f"| {r.held.us_per_job:.1f} ({r.affinity_ratio(r.held):.2f}) "
        f"| {r.keyed.us_per_job:.1f} ({r.affinity_ratio(r.keyed):.2f}) | {r.held.round_trips_per_job:.1f} |"
        for r in rows
    ]
    medians = [statistics.median(r.affinity_ratio(getattr(r, name)) for r in rows) for name in ("new", "held", "keyed")]
    summary = (
        f"\n\nMedian over the {len(rows)} depths: no keys {medians[0]:.2f}x, held {medians[1]:.2f}x, "
        f"not held {medians[2]:.2f}x."
    )
    return "\n".join([header, *lines]) + summary


def run(running: list[int], waiting: list[int], tenants: list[int], claims: int) -> list[Row]:
    with RedisServer() as server:
        return [measure_case(server, *case, claims) for case in itertools.product(running, waiting, tenants)]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.claim", description=__doc__.split("\n\n")[0])
    parser.add_argument("--running", type=int_list, default=[0, 8, 64, 256], help="jobs running (default: 0,8,64,256)")
    parser.add_argument("--waiting", type=int_list, default=[0, 1000, 10000], help="default: 0,1000,10000")
    parser.add_argument("--tenants", type=int_list, default=[1, 10], help="default: 1,10")
    parser.add_argument("--claims", type=int, default=1000, help="claims measured per depth (default: %(default)s)")
    args = parser.parse_args(argv)
    rows = run(args.running, args.waiting, args.tenants, args.claims)
    print("Redis time in the claim script per claimed job (INFO commandstats), old claim vs new:\n")
    print(table(rows))
    print("\nWhat prefix-aware pickup adds per claimed job, against the claim before it (target: ≤ 1.2×):\n")
    print(affinity_table(rows))


if __name__ == "__main__":
    main()
