"""``python -m bench.waiting_cost``: what keeping the waiting set (``<queue>:waiting``, the
autoscaling signal) costs an enqueue and a claim, side by side with the scripts before it,
in one run.

Each round fills a fresh database the same way for both pairs of scripts: ``--jobs``
requests enqueued one script call each (the library's arguments, no affinity), then claimed
one per call (a worker whose slot just freed), each claimed job finishing at once. Redis's
own accounting of each phase is read: ``INFO commandstats`` (microseconds inside
``EVALSHA``, one call per job). The rounds alternate the two pairs, so a noisy machine
weighs on both alike; each round's two figures make a ratio, and the median ratio is the
result (with the spread of the rounds beside it).

- before: ``bench/baseline_enqueue_pre_waiting.lua`` and
  ``bench/baseline_claim_jobs_pre_waiting.lua`` (verbatim copies of the scripts before the
  waiting set);
- now: ``streamq/protocol/lua/enqueue.lua`` and ``claim_jobs.lua``.
"""

from __future__ import annotations

import argparse
import statistics
from dataclasses import dataclass
from pathlib import Path

import redis

from devkit.redis_server import RedisServer
from streamq.protocol import IN_PROGRESS_PREFIX, LEASE_TTL_MS
from streamq.protocol.names import (
    AFFINITY_FREE_TTL_MS,
    AFFINITY_OWNER_TTL_MS,
    queue_waiting_key,
)
from streamq.protocol.script_calls import ClaimJobs, Enqueue
from streamq.protocol.scripts import script_text

QUEUE = "streamq:queue"
HERE = Path(__file__).parent
BEFORE = (HERE / "baseline_enqueue_pre_waiting.lua", HERE / "baseline_claim_jobs_pre_waiting.lua")
PAGE = 100
JOB = b'{"t":1,"f":"generate","a":[{"request_id":"x","prompt":"The key to happiness is","sampling":{}}],"k":{}}'
"""A small job: the payload's bytes cost both sides the same."""


@dataclass(frozen=True)
class Round:
    """Microseconds inside Redis per script call, of one round."""

    enqueue_us: float
    claim_us: float


def _script_us(client: redis.Redis) -> tuple[int, float]:
    stats = client.execute_command("INFO", "commandstats").get("cmdstat_evalsha", {"calls": 0, "usec": 0})
    return int(stats["calls"]), float(stats["usec"])


def one_round(client: redis.Redis, enqueue_text: str, claim_text: str, jobs: int) -> Round:
    """``jobs`` enqueues, then as many claims of one job each (each job finishing at once)."""
    client.flushall()
    enqueue = client.execute_command("SCRIPT LOAD", enqueue_text)
    claim = client.execute_command("SCRIPT LOAD", claim_text)
    client.config_resetstat()
    for i in range(jobs):
        job_id = f"job-{i}"
        call = Enqueue.of_request(
            job_id,
            QUEUE,
            JOB,
            expiry_ms=600_000,
            tenant=f"t{i % 4}",
            window_ms=AFFINITY_FREE_TTL_MS,
            balance_slack=4,
            balance_fraction=0.5,
        )
        assert client.execute_command(*call.command(enqueue)) == 1
    calls, enqueue_us = _script_us(client)
    assert calls == jobs
    client.config_resetstat()
    claim_command = ClaimJobs(
        queue=QUEUE,
        wanted=1,
        lease_ms=LEASE_TTL_MS,
        page=PAGE,
        in_progress_prefix=IN_PROGRESS_PREFIX,
        worker_id="bench-worker",
        owner_ttl_ms=AFFINITY_OWNER_TTL_MS,
        free_ttl_ms=AFFINITY_FREE_TTL_MS,
    ).command(claim)
    claimed = 0
    for _ in range(jobs):
        reply = client.execute_command(*claim_command)
        for job_id in reply[4:5]:  # one job at most (a claim of one: its id first, whatever follows it)
            claimed += 1
            client.zrem(QUEUE, job_id)
            client.delete(IN_PROGRESS_PREFIX + job_id.decode())
    calls, claim_us = _script_us(client)
    assert claimed == jobs == calls
    return Round(enqueue_us / jobs, claim_us / jobs)


def run(jobs: int, rounds: int) -> dict[str, list[Round]]:
    now = (script_text("enqueue"), script_text("claim_jobs"))
    before = tuple(path.read_text(encoding="utf-8") for path in BEFORE)
    results: dict[str, list[Round]] = {"before": [], "now": []}
    with RedisServer() as server:
        client = redis.Redis.from_url(server.url)
        try:
            for _ in range(rounds):
                for name, (enqueue_text, claim_text) in (("before", before), ("now", now)):
                    results[name].append(one_round(client, enqueue_text, claim_text, jobs))
            assert client.zcard(queue_waiting_key(QUEUE)) == 0, "every claimed job left the waiting set"
        finally:
            client.close()
    return results


def table(results: dict[str, list[Round]]) -> str:
    def median(name: str, field: str) -> float:
        return float(statistics.median(getattr(r, field) for r in results[name]))

    def paired(field: str) -> list[float]:
        return sorted(
            getattr(n, field) / getattr(b, field) for b, n in zip(results["before"], results["now"], strict=True)
        )

    header = "| script | before (µs per call) | now (µs per call) | now ÷ before, median of rounds (min–max) |"
    lines = [header, "|---|---:|---:|---:|"]
    for label, field in (("enqueue", "enqueue_us"), ("claim of one job", "claim_us")):
        ratios = paired(field)
        spread = f"{statistics.median(ratios):.3f} ({ratios[0]:.3f}–{ratios[-1]:.3f})"
        lines.append(f"| {label} | {median('before', field):.2f} | {median('now', field):.2f} | {spread} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.waiting_cost", description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=5000, help="jobs enqueued and claimed per round (default: 5000)")
    parser.add_argument("--rounds", type=int, default=7, help="rounds per pair of scripts (default: %(default)s)")
    args = parser.parse_args(argv)
    print(table(run(args.jobs, args.rounds)))


if __name__ == "__main__":
    main()
