"""How many tokens per second one Redis carries with streamq's own scripts.

Many workers' publish batches are played against one Redis (started in a session of its own,
as deployed) by publisher processes (``bench/redis_capacity_load.py``): each simulated worker
flushes one chunk event per running request through ``ReplayLog.append`` (the
``append_and_publish`` script: one Stream entry, one PUBLISH, owner keys, the deployed log
bounds), as fast as Redis answers, while subscriber processes follow every request with the
producer library's ``EventSubscriber``. Each arm sets how many tokens one event carries: 1 is
per-token streaming, more is what a worker that merges waiting tokens sends under load.

Over a measurement window it reads Redis's CPU time from ``/proc/<pid>/stat`` and reports CPU
µs per token and per event, and the tokens/s one Redis core sustains: measured when Redis was
near a full core, else ``1e6 / µs per token``. Where the publishers and subscribers share the
machine's cores with Redis (a small machine), Redis cannot reach a full core and the µs per
token is the robust figure.

``python -m bench.redis_capacity`` runs it (about a minute and a half); ``run_redis_capacity``
and ``capacity_table`` are the same for ``python -m bench``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import redis

from bench.config import int_list
from bench.cpu import cpu_seconds
from bench.redis_capacity_load import grouping_argument
from devkit.redis_cluster import RedisCluster
from devkit.redis_server import RedisServer, server_binary
from streamq.broker.replay_log import log_limits_from_env

ROOT = Path(__file__).resolve().parent.parent
SATURATED_CPU_PERCENT = 90.0
"""Redis at or above this share of one core counts as saturated: its tokens/s is then the
one-core figure itself, not an extrapolation."""
LOAD_MODULE = "bench.redis_capacity_load"


@dataclass(frozen=True)
class CapacityConfig:
    """One capacity run: the load shape, and the arms (tokens per event) to play it with."""

    tokens_per_event: tuple[int, ...] = (1, 4, 16)
    groupings: tuple[str, ...] = ("flush",)
    """How each flush is split into script calls (``bench.redis_capacity_load.GROUPINGS``), or
    ``cluster-<N>``: the logs and channels on a local Redis Cluster of N shards, as a deployment with
    ``$STREAMQ_EVENTS_REDIS_URL`` has them (one call per bucket, pipelined per shard; Redis's
    CPU is the shards' together): every grouping is an arm with every tokens-per-event."""
    workers: int = 8
    """Simulated workers (one Redis connection and one flush loop each)."""
    requests_per_worker: int = 64
    """Running requests per worker: the events in each flush."""
    output_len: int = 512
    """Tokens per request before its final event and the next request on its slot."""
    publishers: int = 1
    """Processes the simulated workers are spread over."""
    subscribers: int = 2
    """Subscriber processes, each one pub/sub connection following its share of the requests."""
    warmup_s: float = 2.0
    measure_s: float = 6.0
    rounds: int = 2
    """The arms run in turn this many times (k=1, 4, 16, 1, 4, 16, ...), so that a burst of
    load from elsewhere on the machine does not fall on one arm alone."""
    results_dir: Path = ROOT / "bench" / "results"
    run_id: str = field(default_factory=lambda: time.strftime("%Y%m%d-%H%M%S"))


@dataclass
class CapacityResult:
    """One arm's figures over the measurement window."""

    tokens_per_event: int
    workers: int
    requests_per_worker: int
    subscribers: int
    measure_s: float
    flushes_s: float
    events_s: float
    tokens_s: float
    delivered_events_s: float
    """Events the subscribers decoded in the window (each event reaches one subscriber)."""
    redis_cpu_percent: float
    """Redis's CPU over the window; 100 = one core."""
    redis_us_per_event: float
    redis_us_per_token: float
    one_core_tokens_s: float
    one_core_measured: bool
    """True: Redis was near a full core and ``one_core_tokens_s`` is scaled from what it
    carried; False: ``1e6 / redis_us_per_token``, an extrapolation."""
    errors: int
    """Events the log refused, gaps a subscriber saw, failed followers: 0 in a sound run."""
    cpu_percent: dict[str, float] = field(default_factory=dict)
    """Every process's CPU over the window (100 = one core): what else competed for the cores."""
    script_us_per_call: float = 0.0
    """Redis's own accounting of the ``append_and_publish`` calls (INFO commandstats)."""
    bytes_per_event: float = 0.0
    """Redis memory each logged event holds until its log expires (``used_memory`` grown over
    the window, per event): what the log's TTL costs at a given event rate."""
    grouping: str = "flush"
    """How each flush was split into script calls (``CapacityConfig.groupings``)."""
    calls_per_flush: float = 1.0
    unix_clients: int = 0
    """Connections on Redis's Unix socket as the window ended (the ``unix`` arm's load)."""


def script_calls(client: redis.Redis) -> tuple[int, int]:
    """(calls, µs) of EVALSHA and EVAL so far, as Redis counts them."""
    stats: dict[str, dict[str, int]] = client.info("commandstats")  # type: ignore[assignment]
    calls = usec = 0
    for name in ("cmdstat_evalsha", "cmdstat_eval"):
        entry = stats.get(name) or {}
        calls += int(entry.get("calls", 0))
        usec += int(entry.get("usec", 0))
    return calls, usec


def used_memory(client: redis.Redis) -> int:
    """Bytes Redis has allocated for data (INFO memory's ``used_memory``)."""
    return int(client.info("memory")["used_memory"])  # type: ignore[index]


def figures(
    config: CapacityConfig,
    tokens_per_event: int,
    published: dict[str, int],
    delivered: dict[str, int],
    cpu_percent: dict[str, float],
    errors: int,
    script_us_per_call: float,
    memory_grown: int = 0,
    grouping: str = "flush",
    calls: int = 0,
) -> CapacityResult:
    """An arm's result from its counts over the window and its processes' CPU shares."""
    window = config.measure_s
    redis_cpu = cpu_percent["redis"]
    events, tokens = published["events"], published["tokens"]
    us_per_event = 1e6 * (redis_cpu / 100) * window / events if events else float("inf")
    us_per_token = 1e6 * (redis_cpu / 100) * window / tokens if tokens else float("inf")
    measured = redis_cpu >= SATURATED_CPU_PERCENT
    one_core = tokens / window * 100 / redis_cpu if measured else (1e6 / us_per_token if tokens else 0.0)
    return CapacityResult(
        tokens_per_event=tokens_per_event,
        workers=config.workers,
        requests_per_worker=config.requests_per_worker,
        subscribers=config.subscribers,
        measure_s=window,
        flushes_s=published["flushes"] / window,
        events_s=events / window,
        tokens_s=tokens / window,
        delivered_events_s=delivered["events"] / window,
        redis_cpu_percent=redis_cpu,
        redis_us_per_event=us_per_event,
        redis_us_per_token=us_per_token,
        one_core_tokens_s=one_core,
        one_core_measured=measured,
        errors=errors,
        cpu_percent=cpu_percent,
        script_us_per_call=script_us_per_call,
        bytes_per_event=memory_grown / events if events else 0.0,
        grouping=grouping,
        calls_per_flush=calls / published["flushes"] if calls and published["flushes"] else 1.0,
    )


CLUSTER_ARM = "cluster-"
"""``cluster-<N>``: the arm whose logs are on a local Redis Cluster of N shards."""
UNIX_ARM = "unix"
"""The ``flush`` arm with every load process on Redis's Unix socket (``unix://``) instead of
loopback TCP: what a worker beside its Redis saves on each send."""


def cluster_shards(grouping: str) -> int | None:
    """N of a ``cluster-<N>`` arm, else ``None``."""
    if not grouping.startswith(CLUSTER_ARM):
        return None
    shards = grouping.removeprefix(CLUSTER_ARM)
    if not shards.isdigit() or int(shards) < 1:
        raise argparse.ArgumentTypeError(f"a cluster arm is cluster-<shards>, shards >= 1; got {grouping!r}")
    return int(shards)


def _load_command(
    config: CapacityConfig,
    role: str,
    url: str,
    run: str,
    k: int,
    out: Path,
    grouping: str = "flush",
    events_url: str | None = None,
) -> list[str]:
    events = [] if events_url is None else ["--events-url", events_url]
    return [
        sys.executable,
        "-m",
        LOAD_MODULE,
        role,
        "--redis-url",
        url,
        "--run",
        run,
        "--requests-per-worker",
        str(config.requests_per_worker),
        "--tokens-per-event",
        str(k),
        "--output-len",
        str(config.output_len),
        "--grouping",
        "flush" if cluster_shards(grouping) or grouping == UNIX_ARM else grouping,
        "--out",
        str(out),
        *events,
    ]


def _wait_ready(process: subprocess.Popen[str], timeout_s: float = 60.0) -> None:
    assert process.stdout is not None
    deadline = time.monotonic() + timeout_s
    for line in process.stdout:
        if line.strip() == "ready":
            return
        if time.monotonic() > deadline:
            break
    raise RuntimeError(f"a load process did not get ready (exit status {process.poll()})")


def run_arm(config: CapacityConfig, tokens_per_event: int, grouping: str = "flush") -> CapacityResult:
    """One arm on a fresh Redis: start subscribers, then publishers; measure the window."""
    run = f"cap{tokens_per_event}"
    prefix = config.results_dir / f"{config.run_id}-capacity-k{tokens_per_event}-{grouping}"
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    with contextlib.ExitStack() as servers:
        server = servers.enter_context(RedisServer(unix_socket=grouping == UNIX_ARM))
        assert server.process is not None
        url = server.unix_url if grouping == UNIX_ARM else server.url
        data_nodes = [server]
        events_url = None
        shards = cluster_shards(grouping)
        if shards:
            cluster = servers.enter_context(RedisCluster(primaries=shards))
            data_nodes, events_url = cluster.nodes, cluster.url
        processes: list[tuple[str, subprocess.Popen[str], Path]] = []
        try:
            for i in range(config.subscribers):
                out = Path(f"{prefix}-subscriber{i}.json")
                command = _load_command(config, "subscribe", url, run, tokens_per_event, out, grouping, events_url)
                command += ["--index", str(i), "--subscribers", str(config.subscribers)]
                command += ["--total-workers", str(config.workers)]
                process = subprocess.Popen(
                    command,
                    cwd=ROOT,
                    env=env,
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    text=True,
                    start_new_session=True,
                )
                processes.append((f"subscriber{i}", process, out))
            for _, process, _ in processes:
                _wait_ready(process)
            start = time.time() + 1.5 + config.warmup_s
            window = {"start": start, "end": start + config.measure_s, "stop": start + config.measure_s + 0.5}
            for _, process, _ in processes:
                assert process.stdin is not None
                process.stdin.write(json.dumps(window) + "\n")
                process.stdin.flush()
            for i in range(config.publishers):
                share = config.workers // config.publishers + (i < config.workers % config.publishers)
                first = sum(
                    config.workers // config.publishers + (j < config.workers % config.publishers) for j in range(i)
                )
                out = Path(f"{prefix}-publisher{i}.json")
                command = _load_command(config, "publish", url, run, tokens_per_event, out, grouping, events_url)
                command += ["--workers", str(share), "--first-worker", str(first)]
                command += ["--window", json.dumps(window), "--warmup", str(config.warmup_s)]
                process = subprocess.Popen(
                    command, cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True, start_new_session=True
                )
                processes.append((f"publisher{i}", process, out))
            roles = {role: process.pid for role, process, _ in processes}
            redis_pids = [node.process.pid for node in data_nodes if node.process is not None]
            clients = [redis.Redis(port=node.port) for node in data_nodes]

            def cpu_now() -> dict[str, float]:
                """Each load process's CPU seconds so far, and the data plane's servers' together."""
                return {role: cpu_seconds(pid) for role, pid in roles.items()} | {
                    "redis": sum(map(cpu_seconds, redis_pids))
                }

            time.sleep(max(0.0, window["start"] - time.time()))
            before = cpu_now()
            calls_before = _summed(script_calls(client) for client in clients)
            memory_before = sum(map(used_memory, clients))
            time.sleep(max(0.0, window["end"] - time.time()))
            after = cpu_now()
            calls_after = _summed(script_calls(client) for client in clients)
            memory_grown = sum(map(used_memory, clients)) - memory_before
            listed: list[dict[str, str]] = clients[0].client_list()  # type: ignore[assignment]
            unix_clients = sum(entry["addr"].startswith("/") for entry in listed)
            for client in clients:
                client.close()
            for role, process, _ in processes:
                if process.wait(timeout=120) != 0:
                    raise RuntimeError(f"{role} exited with status {process.returncode}")
        finally:
            for _, process, _ in processes:
                if process.poll() is None:
                    process.kill()
                    process.wait()
                for pipe in (process.stdin, process.stdout):
                    if pipe is not None:
                        pipe.close()
    counts = {role: json.loads(out.read_text()) for role, _, out in processes}
    published = _sum(c for role, c in counts.items() if role.startswith("publisher"))
    delivered = _sum(c for role, c in counts.items() if role.startswith("subscriber"))
    errors = published["skipped"] + delivered["skipped"] + delivered.get("failures", 0)
    cpu = {role: round(100 * (after[role] - before[role]) / config.measure_s, 1) for role in before}
    calls, usec = (b - a for a, b in zip(calls_before, calls_after, strict=True))
    per_call = usec / calls if calls else 0.0
    result = figures(
        config, tokens_per_event, published, delivered, cpu, errors, per_call, memory_grown, grouping, calls
    )
    result.unix_clients = unix_clients
    print(
        f"[capacity] {tokens_per_event} token(s)/event, calls per {grouping} ({result.calls_per_flush:.1f} a flush): "
        f"{result.tokens_s:,.0f} tokens/s, "
        f"{result.events_s:,.0f} events/s, Redis {result.redis_cpu_percent:.0f}% of a core, "
        f"{result.redis_us_per_token:.2f} µs/token, {result.redis_us_per_event:.2f} µs/event, "
        f"{result.delivered_events_s:,.0f} events/s delivered, {result.bytes_per_event:.0f} bytes/event kept, "
        f"{result.script_us_per_call:.1f} µs per script call (Redis's count), {result.errors} errors; "
        f"CPU: {', '.join(f'{role} {pct:.0f}%' for role, pct in cpu.items())}; "
        f"µs per token: {', '.join(f'{role} {us:.2f}' for role, us in us_per_token(result).items())}",
        flush=True,
    )
    return result


def us_per_token(result: CapacityResult) -> dict[str, float]:
    """Each process's CPU µs per token carried (a publisher's: what a worker's sends cost it)."""
    if not result.tokens_s:
        return {}
    return {role: 1e4 * pct / result.tokens_s for role, pct in result.cpu_percent.items()}


def _summed(pairs: Iterable[tuple[int, int]]) -> tuple[int, int]:
    """(calls, µs) of several servers together."""
    calls = usec = 0
    for server_calls, server_usec in pairs:
        calls, usec = calls + server_calls, usec + server_usec
    return calls, usec


def _sum(counts: object) -> dict[str, int]:
    total: dict[str, int] = {}
    for entry in counts:  # type: ignore[attr-defined]
        for name, value in entry.items():
            total[name] = total.get(name, 0) + int(value)
    return total


def run_redis_capacity(config: CapacityConfig) -> list[CapacityResult]:
    """Every arm of ``config``, in turn for ``config.rounds`` rounds, each on its own Redis;
    returns every round's result (``capacity_table`` pools them per arm)."""
    config.results_dir.mkdir(parents=True, exist_ok=True)
    return [
        run_arm(config, k, grouping)
        for _ in range(config.rounds)
        for grouping in config.groupings
        for k in config.tokens_per_event
    ]


def pooled(results: Sequence[CapacityResult]) -> list[tuple[CapacityResult, tuple[float, float]]]:
    """One result per arm over all its rounds (counts and CPU added up, so µs per token is
    total Redis CPU over total tokens), with the range of the rounds' µs per token."""
    arms: dict[tuple[int, str], list[CapacityResult]] = {}
    for r in results:
        arms.setdefault((r.tokens_per_event, r.grouping), []).append(r)
    out = []
    for (k, grouping), rounds in arms.items():
        window = sum(r.measure_s for r in rounds)
        cpu = {
            role: sum(r.cpu_percent.get(role, 0.0) * r.measure_s for r in rounds) / window
            for role in rounds[0].cpu_percent
        }
        first = rounds[0]
        config = CapacityConfig(
            workers=first.workers,
            requests_per_worker=first.requests_per_worker,
            subscribers=first.subscribers,
            measure_s=window,
        )
        published = {
            "flushes": round(sum(r.flushes_s * r.measure_s for r in rounds)),
            "events": round(sum(r.events_s * r.measure_s for r in rounds)),
            "tokens": round(sum(r.tokens_s * r.measure_s for r in rounds)),
        }
        delivered = {"events": round(sum(r.delivered_events_s * r.measure_s for r in rounds))}
        calls_us = sum(r.script_us_per_call for r in rounds) / len(rounds)
        memory = sum(r.bytes_per_event * r.events_s * r.measure_s for r in rounds)
        calls = round(sum(r.calls_per_flush * r.flushes_s * r.measure_s for r in rounds))
        errors = sum(r.errors for r in rounds)
        result = figures(config, k, published, delivered, cpu, errors, calls_us, round(memory), grouping, calls)
        spread = [r.redis_us_per_token for r in rounds]
        out.append((result, (min(spread), max(spread))))
    return out


def capacity_table(results: Sequence[CapacityResult]) -> str:
    """The markdown table of a capacity run, one row per arm (its rounds pooled)."""
    lines = [
        "| tokens per event | script calls per flush | workers × requests | events/s | tokens/s "
        "| Redis CPU (100 = one core) "
        "| Redis µs per event | Redis µs per token (rounds) | one Redis core, tokens/s | log bytes per event | errors "
        "| other processes' CPU (µs per token) |",
        "|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r, (low, high) in pooled(results):
        basis = "measured" if r.one_core_measured else "1e6 / µs per token"
        per_token = us_per_token(r)
        others = ", ".join(
            f"{role} {pct:.0f} ({per_token.get(role, 0):.2f})" for role, pct in r.cpu_percent.items() if role != "redis"
        )
        lines.append(
            f"| {r.tokens_per_event} | {_grouping_label(r)} | {r.workers} × {r.requests_per_worker} | "
            f"{r.events_s:,.0f} | "
            f"{r.tokens_s:,.0f} | {r.redis_cpu_percent:.0f} | {r.redis_us_per_event:.2f} | "
            f"{r.redis_us_per_token:.2f} ({low:.2f}-{high:.2f}) | {r.one_core_tokens_s:,.0f} ({basis}) | "
            f"{r.bytes_per_event:.0f} | "
            f"{r.errors} | {others} |"
        )
    return "\n".join(lines)


def _grouping_label(result: CapacityResult) -> str:
    """How a flush was split, in words, with the calls it came to."""
    if result.grouping == "flush":
        return "1 (the whole flush)"
    if result.grouping == UNIX_ARM:
        return "1 (the whole flush), over Redis's Unix socket"
    shards = cluster_shards(result.grouping)
    if shards:
        return f"{result.calls_per_flush:.1f} (one per bucket, pipelined per shard; {shards}-shard Redis Cluster)"
    what = "request" if result.grouping == "request" else f"bucket, {result.grouping.partition('-')[2]} buckets"
    return f"{result.calls_per_flush:.1f} (one per {what}, pipelined)"


def describe(config: CapacityConfig) -> str:
    """One paragraph on what was run, for the top of the table."""
    maxlen, ttl_ms = log_limits_from_env()
    return (
        f"One Redis ({Path(server_binary()).name}), {config.workers} simulated workers × "
        f"{config.requests_per_worker} running requests of {config.output_len} tokens, each flush one "
        f"event per running request through `append_and_publish` (log maxlen {maxlen}, TTL {ttl_ms // 1000} s), "
        f"{config.publishers} publisher and {config.subscribers} subscriber processes (every request followed); "
        f"{config.warmup_s:g} s warm-up, {config.measure_s:g} s measured, "
        f"{config.rounds} round(s) of the arms in turn; "
        f"{os.cpu_count()} CPUs shared by all. Redis CPU from /proc/<pid>/stat over the windows"
        + (
            " (a cluster arm's: its shards' together; a control Redis beside it carries only the ready lists)."
            if any(cluster_shards(grouping) for grouping in config.groupings)
            else "."
        )
    )


def main() -> None:
    # A SIGTERM (``timeout``) unwinds like Ctrl-C, so Redis and the load processes are stopped.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    defaults = CapacityConfig()
    parser = argparse.ArgumentParser(prog="python -m bench.redis_capacity", description=__doc__.splitlines()[0])
    parser.add_argument("--tokens-per-event", default="1,4,16", help="arms, comma-separated (default %(default)s)")
    parser.add_argument(
        "--grouping",
        default="flush",
        help="arms: how a flush is split into script calls, comma-separated, of flush (one call), request "
        "(one per request, pipelined), buckets-<B> (one per bucket, pipelined), all on one Redis, and "
        "cluster-<N> (the logs on a Redis Cluster of N shards, as deployed with $STREAMQ_EVENTS_REDIS_URL), "
        "and unix (flush, every process on Redis's Unix socket instead of loopback TCP) (default %(default)s)",
    )
    parser.add_argument("--workers", type=int, default=defaults.workers, help="default %(default)s")
    parser.add_argument(
        "--requests-per-worker", type=int, default=defaults.requests_per_worker, help="default %(default)s"
    )
    parser.add_argument("--output-len", type=int, default=defaults.output_len, help="default %(default)s")
    parser.add_argument("--publishers", type=int, default=defaults.publishers, help="default %(default)s")
    parser.add_argument("--subscribers", type=int, default=defaults.subscribers, help="default %(default)s")
    parser.add_argument("--warmup-s", type=float, default=defaults.warmup_s, help="default %(default)s")
    parser.add_argument("--measure-s", type=float, default=defaults.measure_s, help="default %(default)s")
    parser.add_argument("--rounds", type=int, default=defaults.rounds, help="default %(default)s")
    parser.add_argument("--results-dir", type=Path, default=defaults.results_dir)
    args = parser.parse_args()
    try:
        groupings = tuple(
            g if g == UNIX_ARM or cluster_shards(g) else grouping_argument(g) for g in args.grouping.split(",")
        )
    except argparse.ArgumentTypeError as error:
        parser.error(str(error))
    config = CapacityConfig(
        tokens_per_event=int_list(args.tokens_per_event),
        groupings=groupings,
        workers=args.workers,
        requests_per_worker=args.requests_per_worker,
        output_len=args.output_len,
        publishers=args.publishers,
        subscribers=args.subscribers,
        warmup_s=args.warmup_s,
        measure_s=args.measure_s,
        rounds=args.rounds,
        results_dir=args.results_dir,
    )
    results = run_redis_capacity(config)
    table = f"{describe(config)}\n\n{capacity_table(results)}\n"
    base = config.results_dir / f"{config.run_id}-redis-capacity"
    base.with_suffix(".md").write_text(table)
    base.with_suffix(".json").write_text(
        json.dumps(
            {
                "config": {**asdict(config), "results_dir": str(config.results_dir)},
                "results": [asdict(r) for r in results],
            },
            indent=1,
        )
    )
    print("\n" + table)
    print(f"written: {base}.json, {base}.md", flush=True)


if __name__ == "__main__":
    main()
