"""``python -m bench.claim``: Redis CPU per claimed job, the priority-and-tenant claim
against the claim it replaced, side by side, in one run.

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
  script, spread over the tenants in turn.
"""

from __future__ import annotations

import argparse
import itertools
from dataclasses import dataclass
from pathlib import Path

import redis

from bench.config import int_list
from bench.cpu import cpu_seconds
from devkit.redis_server import RedisServer
from streamq.protocol import IN_PROGRESS_PREFIX, JOB_KEY_PREFIX, LEASE_TTL_MS, WAKEUP_CHANNEL
from streamq.protocol.names import CLAIM_SCAN_INTERVAL_MS, TENANT_WEIGHTS_KEY, running_key
from streamq.protocol.scripts import script_text

QUEUE = "streamq:queue"
BASELINE = Path(__file__).with_name("baseline_claim_jobs.lua")
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

    @property
    def ratio(self) -> float:
        return self.new.us_per_job / self.old.us_per_job


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


def _fill_waiting(client: redis.Redis, count: int, tenants: int, *, new: bool, now_ms: int) -> None:
    """``count`` jobs queued after the running ones: by the new enqueue script (indexed,
    tenants in turn) or, for the old claim, by the ``ZADD`` its enqueue made."""
    enqueue = client.register_script(script_text("enqueue"))
    for start in range(0, count, SETUP_BATCH):
        pipe = client.pipeline(transaction=False)
        for i in range(start, min(count, start + SETUP_BATCH)):
            job_id = f"waiting-{i}"
            if new:
                keys = [JOB_KEY_PREFIX + job_id, QUEUE, f"streamq:events:{job_id}"]
                args: list[str | int] = ["{}", 600_000, job_id, WAKEUP_CHANNEL, QUEUE, -1, f"arq:result:{job_id}"]
                args += [0, f"t{i % tenants}"]
                enqueue(keys=keys, args=args, client=pipe)
            else:
                pipe.zadd(QUEUE, {job_id: now_ms - 1_000_000 + i})
        pipe.execute()


def _measure(
    server: RedisServer, client: redis.Redis, script: str, args: list[str | int], claims: int, *, new: bool
) -> Cost:
    """``claims`` claims of one job each; each job claimed then finishes at once (arq's
    ``ZREM`` and ``DEL``), so the running jobs stay as many as the depth says. For the new
    claim its entry in ``<queue>:running`` is left due for a look, so the claims pay for
    clearing it as in service."""
    sha = client.execute_command("SCRIPT LOAD", script)
    assert server.process is not None
    client.config_resetstat()
    cpu_before = cpu_seconds(server.process.pid)
    jobs = 0
    for _ in range(claims):
        reply = client.execute_command("EVALSHA", sha, 1, QUEUE, *args)
        claimed = [job_id.decode() for job_id in reply[(4 if new else 1) :: 2]]
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
    """One depth: the old claim, then the new one, each on a freshly filled database."""
    client = redis.Redis.from_url(server.url)
    try:
        costs: dict[bool, Cost] = {}
        for new in (False, True):
            client.flushall()
            now_ms = int(client.execute_command("TIME")[0]) * 1000
            _fill_running(client, running, new=new, now_ms=now_ms)
            _fill_waiting(client, waiting + claims, tenants, new=new, now_ms=now_ms)
            if new:
                client.hset(TENANT_WEIGHTS_KEY, mapping={f"t{i}": 1 + i % 3 for i in range(tenants)})
                script = script_text("claim_jobs")
                extra: list[str | int] = [TENANT_WEIGHTS_KEY, CLAIM_SCAN_INTERVAL_MS]
            else:
                script = BASELINE.read_text(encoding="utf-8")
                extra = []
            args: list[str | int] = [1, LEASE_TTL_MS, PAGE, IN_PROGRESS_PREFIX, "bench-worker", *extra]
            costs[new] = _measure(server, client, script, args, claims, new=new)
            assert costs[new].jobs == claims, f"claimed {costs[new].jobs} of {claims}"
        return Row(running, waiting, tenants, old=costs[False], new=costs[True])
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


if __name__ == "__main__":
    main()
