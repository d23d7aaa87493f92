"""``python -m bench.durable_ends``: what durable ends cost (``--durable-ends``: an end waits for
its replicas, ``WAIT``, and with ``fsync=local`` for the primary's AOF, ``WAITAOF``, before it
is published), side by side with the same deployment without the wait, in one run.

Every arm is a primary with one replica on loopback (fresh servers and a fresh scripted worker,
``devkit.worker_process.scripted_worker`` at ``--tokens-per-s`` per request, for each arm of each
round), the producer library as the client in this process:

- ``off`` (``--durable-ends off``) against ``auto`` (the default: each end waits for the
  replica), no AOF;
- ``off, AOF always`` against ``fsync=local, AOF always`` (``replicas=all,fsync=local``: the
  replica and the primary's fsync, which ``appendfsync always`` has done by the time the
  write is acknowledged).

Each arm measures short requests (``--short-tokens``, 4) closed-loop at concurrency 1 and 64
(requests/s; end latency, the final's arrival minus the last chunk's at the subscriber, which
is ~0 where the last chunk went out with the final, so also the final's arrival minus the first
chunk's, and submit to final), ``WAIT`` and ``WAITAOF`` calls per end (the primary's
``INFO commandstats``), and long streams (32 of ``--long-tokens``, 2,000, 16 at once: tokens/s).
With AOF on, a last phase counts the primary's ``fsync``/``fdatasync`` calls under ``strace``
(apart from the timed phases: tracing slows the server). The rounds alternate the arms' order;
each figure is the median over rounds, and each ratio the median of the rounds' paired ratios.
Last, the wait itself on one idle pair of servers: ``SET`` then ``WAIT 1`` (a healthy replica),
``WAITAOF 1 0`` under ``appendfsync always`` and under ``everysec``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import shutil
import signal
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import redis

from devkit.redis_server import RedisServer, server_binary, server_version
from devkit.worker_process import WorkerProcess, scripted_worker
from producer.client import StreamqClient
from streamq.protocol import ChunkEvent, FinalEvent


@dataclass(frozen=True)
class Arm:
    name: str
    spec: str
    aof: bool
    """The primary writes an AOF, fsynced at every write (``appendfsync always``)."""


OFF = Arm("off", "off", False)
AUTO = Arm("auto", "auto", False)
OFF_AOF = Arm("off, AOF always", "off", True)
FSYNC_AOF = Arm("fsync=local, AOF always", "replicas=all,fsync=local", True)
ARMS = (OFF, AUTO, OFF_AOF, FSYNC_AOF)
PAIRS = ((OFF, AUTO), (OFF_AOF, FSYNC_AOF))
"""(baseline, with the wait): the ratios printed."""


@dataclass
class Phase:
    """One closed-loop phase of an arm's run."""

    requests: int = 0
    seconds: float = 0.0
    tokens: int = 0
    end_ms: list[float] = field(default_factory=list)
    """Per request: the final's arrival minus its last chunk's, at the subscriber (the last
    chunk goes out with the final when both are in the buffer the flusher takes: the
    tokens that came with the end wait with it)."""
    tail_ms: list[float] = field(default_factory=list)
    """Per request: the final's arrival minus its first chunk's: the rest of its tokens'
    generation (the same in every arm) and the end's wait."""
    request_ms: list[float] = field(default_factory=list)
    """Per request: submit to the final's arrival."""
    waits: int = 0
    waitaofs: int = 0

    @property
    def per_s(self) -> float:
        return self.requests / self.seconds

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds


@dataclass
class ArmRun:
    arm: Arm
    c1: Phase
    c64: Phase
    long: Phase
    fsyncs_per_s: float | None = None
    fsyncs_per_end: float | None = None


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def command_calls(client: redis.Redis) -> tuple[int, int]:
    stats: dict[str, dict[str, int]] = client.info("commandstats")  # type: ignore[assignment]
    return (
        int(stats.get("cmdstat_wait", {}).get("calls", 0)),
        int(stats.get("cmdstat_waitaof", {}).get("calls", 0)),
    )


async def closed_loop(
    client: StreamqClient, primary: redis.Redis, *, requests: int, concurrency: int, tokens: int
) -> Phase:
    """``requests`` requests of ``tokens`` tokens, ``concurrency`` in flight, each followed to
    its final by its handle."""
    phase = Phase()
    left = requests
    waits_before = await asyncio.to_thread(command_calls, primary)

    async def one_by_one() -> None:
        nonlocal left
        while left > 0:
            left -= 1
            submitted = time.monotonic()
            handle = await client.submit("durable ends", max_tokens=tokens, ignore_eos=True)
            first_chunk = last_chunk = None
            async for event in handle:
                now = time.monotonic()
                if isinstance(event, ChunkEvent):
                    first_chunk = first_chunk or now
                    last_chunk = now
                elif isinstance(event, FinalEvent):
                    phase.tokens += event.completion_tokens
                    phase.request_ms.append((now - submitted) * 1000)
                    if first_chunk is not None and last_chunk is not None:
                        phase.end_ms.append((now - last_chunk) * 1000)
                        phase.tail_ms.append((now - first_chunk) * 1000)
            phase.requests += 1

    started = time.monotonic()
    await asyncio.gather(*(one_by_one() for _ in range(concurrency)))
    phase.seconds = time.monotonic() - started
    waits, waitaofs = await asyncio.to_thread(command_calls, primary)
    phase.waits, phase.waitaofs = waits - waits_before[0], waitaofs - waits_before[1]
    return phase


@contextlib.contextmanager
def traced_fsyncs(pid: int) -> Iterator[dict[str, int]]:
    """Count ``fsync``/``fdatasync`` calls of process ``pid`` (its threads too) while inside:
    ``strace -c``, detached on leaving (the counts fill the dict then)."""
    counts: dict[str, int] = {}
    tracer = subprocess.Popen(
        ["strace", "-f", "-c", "-e", "trace=fsync,fdatasync", "-p", str(pid)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    time.sleep(0.5)  # attached
    try:
        yield counts
    finally:
        tracer.send_signal(signal.SIGINT)
        _, summary = tracer.communicate(timeout=30)
        for line in summary.splitlines():
            parts = line.split()
            if parts and parts[-1] in ("fsync", "fdatasync") and len(parts) >= 5:
                counts[parts[-1]] = int(parts[3])


def _replica_state(admin: redis.Redis) -> str | None:
    info: dict[str, dict[str, str]] = admin.info("replication")  # type: ignore[assignment]
    return info.get("slave0", {}).get("state")


@contextlib.contextmanager
def deployed(arm: Arm) -> Iterator[tuple[RedisServer, RedisServer]]:
    """A fresh primary (with an AOF fsynced at every write for ``arm.aof``) and its replica,
    online."""
    with RedisServer(persistent=arm.aof) as primary:
        admin = redis.Redis.from_url(primary.url)
        admin.config_set("repl-diskless-sync-delay", 0)
        try:
            with RedisServer(replica_of=primary) as replica:
                deadline = time.monotonic() + 20
                while _replica_state(admin) != "online":
                    if time.monotonic() > deadline:
                        raise RuntimeError("the replica did not come online")
                    time.sleep(0.05)
                yield primary, replica
        finally:
            admin.close()


async def run_arm(arm: Arm, args: argparse.Namespace, logs: Path) -> ArmRun:
    with deployed(arm) as (primary, _):
        flags = ["--durable-ends", arm.spec, "--log-ttl-s", "60"]
        log = logs / f"worker-{arm.name.replace(' ', '').replace(',', '-')}-{time.monotonic_ns()}.log"
        worker: WorkerProcess = scripted_worker(primary.url, log, *flags, tokens_per_s=args.tokens_per_s)
        worker.start().wait_ready(timeout_s=120)
        admin = redis.Redis.from_url(primary.url)
        try:
            said = log.read_text()
            assert f"durable ends ({arm.spec})" in said or arm.spec == "off", said[-2000:]
            async with await StreamqClient.connect(primary.url, queue=worker.queue) as client:
                await closed_loop(client, admin, requests=16, concurrency=4, tokens=args.short_tokens)  # warm-up
                short = args.short_tokens
                c1 = await closed_loop(client, admin, requests=args.c1_requests, concurrency=1, tokens=short)
                c64 = await closed_loop(client, admin, requests=args.c64_requests, concurrency=64, tokens=short)
                long = await closed_loop(client, admin, requests=32, concurrency=16, tokens=args.long_tokens)
                result = ArmRun(arm, c1, c64, long)
                if arm.aof and shutil.which("strace") and primary.process is not None:
                    with traced_fsyncs(primary.process.pid) as counts:
                        traced = await closed_loop(
                            client, admin, requests=args.c64_requests // 2, concurrency=64, tokens=short
                        )
                    if counts:
                        result.fsyncs_per_s = sum(counts.values()) / traced.seconds
                        result.fsyncs_per_end = sum(counts.values()) / traced.requests
            return result
        finally:
            admin.close()
            code = worker.stop()
            if code != 0:
                raise RuntimeError(f"worker exited with {code}:\n{worker.log_tail()}")


def wait_costs(samples: int) -> dict[str, tuple[float, float]]:
    """p50 and p99 (ms) of a write followed by its wait, on idle servers: ``WAIT 1`` with a
    healthy replica, ``WAITAOF 1 0`` under ``appendfsync always`` and ``everysec``; the write
    alone beside them."""
    out: dict[str, tuple[float, float]] = {}

    def timed(client: redis.Redis, *wait: object) -> tuple[float, float]:
        times = []
        for i in range(samples):
            started = time.perf_counter()
            pipe = client.pipeline(transaction=False)
            pipe.set("durable-ends-probe", i)
            if wait:
                pipe.execute_command(*wait)
            pipe.execute()
            times.append((time.perf_counter() - started) * 1000)
        return percentile(times, 0.5), percentile(times, 0.99)

    with deployed(FSYNC_AOF) as (primary, _):
        client = redis.Redis.from_url(primary.url)
        try:
            out["SET alone"] = timed(client)
            out["SET; WAIT 1 5000 (a healthy replica)"] = timed(client, "WAIT", 1, 5000)
            out["SET; WAITAOF 1 0 5000, appendfsync always"] = timed(client, "WAITAOF", 1, 0, 5000)
            client.config_set("appendfsync", "everysec")
            out["SET; WAITAOF 1 0 5000, appendfsync everysec"] = timed(client, "WAITAOF", 1, 0, 5000)
        finally:
            client.close()
    return out


def median(values: list[float]) -> float:
    return float(statistics.median(values))


@dataclass(frozen=True)
class Row:
    label: str
    text: Callable[[list[ArmRun]], str]
    """The arm's cell, from its runs."""
    value: Callable[[ArmRun], float] | None = None
    """One run's figure, whose paired ratios make the ratio cells."""


def _ms(phase: str, values: str) -> Callable[[list[ArmRun]], str]:
    def text(runs: list[ArmRun]) -> str:
        measured = [getattr(getattr(run, phase), values) for run in runs]
        return " / ".join(f"{median([percentile(v, q) for v in measured]):.2f}" for q in (0.5, 0.99))

    return text


def _per_end(counted: str) -> Callable[[list[ArmRun]], str]:
    def text(runs: list[ArmRun]) -> str:
        return " / ".join(
            f"{median([getattr(getattr(r, ph), counted) / getattr(r, ph).requests for r in runs]):.2f}"
            for ph in ("c1", "c64")
        )

    return text


def _figure(value: Callable[[ArmRun], float], fmt: str) -> Callable[[list[ArmRun]], str]:
    return lambda runs: fmt.format(median([value(run) for run in runs]))


def _fsyncs(runs: list[ArmRun]) -> str:
    per_s = [r.fsyncs_per_s for r in runs if r.fsyncs_per_s is not None]
    per_end = [r.fsyncs_per_end for r in runs if r.fsyncs_per_end is not None]
    return f"{median(per_s):.0f} ({median(per_end):.2f})" if per_s else "-"


def _c1(run: ArmRun) -> float:
    return run.c1.per_s


def _c64(run: ArmRun) -> float:
    return run.c64.per_s


def _long(run: ArmRun) -> float:
    return run.long.tokens_per_s


ROWS = (
    Row("short, c=1: requests/s", _figure(_c1, "{:.1f}"), _c1),
    Row("short, c=1: end latency, last chunk → final, p50 / p99 (ms)", _ms("c1", "end_ms")),
    Row("short, c=1: first chunk → final, p50 / p99 (ms)", _ms("c1", "tail_ms")),
    Row("short, c=1: submit → final, p50 / p99 (ms)", _ms("c1", "request_ms")),
    Row("short, c=64: requests/s", _figure(_c64, "{:.1f}"), _c64),
    Row("short, c=64: end latency, last chunk → final, p50 / p99 (ms)", _ms("c64", "end_ms")),
    Row("short, c=64: first chunk → final, p50 / p99 (ms)", _ms("c64", "tail_ms")),
    Row("short, c=64: submit → final, p50 / p99 (ms)", _ms("c64", "request_ms")),
    Row("WAIT calls per end, c=1 / c=64", _per_end("waits")),
    Row("WAITAOF calls per end, c=1 / c=64", _per_end("waitaofs")),
    Row("long streams, c=16: tokens/s", _figure(_long, "{:.0f}"), _long),
    Row("primary's fsyncs/s at c=64, under strace (per end)", _fsyncs),
)


def report(runs: dict[str, list[ArmRun]], waits: dict[str, tuple[float, float]]) -> str:
    kind, version = server_version(server_binary())
    lines = [
        f"{kind} {'.'.join(map(str, version))}; {len(runs[OFF.name])} rounds; ratios: median of the rounds' (min–max)",
        "",
        "| measure | " + " | ".join(arm.name for arm in ARMS) + " | auto ÷ off | fsync=local ÷ off (AOF always) |",
        "|---|" + "---:|" * (len(ARMS) + 2),
    ]
    for row in ROWS:
        cells = [row.text(runs[arm.name]) for arm in ARMS]
        for base, waited in PAIRS:
            value = row.value
            if value is None:
                cells.append("")
                continue
            paired = [value(w) / value(b) for b, w in zip(runs[base.name], runs[waited.name], strict=True)]
            cells.append(f"{median(paired):.3f} ({min(paired):.3f}–{max(paired):.3f})")
        lines.append(f"| {row.label} | " + " | ".join(cells) + " |")
    lines += ["", "| one write and its wait, idle servers | p50 (ms) | p99 (ms) |", "|---|---:|---:|"]
    lines += [f"| {name} | {p50:.3f} | {p99:.3f} |" for name, (p50, p99) in waits.items()]
    return "\n".join(lines)


async def run(args: argparse.Namespace) -> str:
    logs = Path(tempfile.mkdtemp(prefix="bench-durable-ends-"))
    runs: dict[str, list[ArmRun]] = {arm.name: [] for arm in ARMS}
    for index in range(args.rounds):
        order = ARMS if index % 2 == 0 else tuple(reversed(ARMS))
        for arm in order:
            started = time.monotonic()
            result = await run_arm(arm, args, logs)
            runs[arm.name].append(result)
            print(
                f"round {index + 1}, {arm.name}: c=1 {result.c1.per_s:.1f} req/s, c=64 {result.c64.per_s:.1f} req/s, "
                f"long {result.long.tokens_per_s:.0f} tok/s ({time.monotonic() - started:.0f}s)",
                flush=True,
            )
    waits = await asyncio.to_thread(wait_costs, args.wait_samples)
    print(f"(worker logs: {logs})")
    return report(runs, waits)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.durable_ends", description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3, help="runs of every arm, alternating (default: %(default)s)")
    parser.add_argument(
        "--tokens-per-s",
        type=int,
        default=5000,
        help="the scripted engine's pace per request (default: %(default)s: the long streams are bound by the worker)",
    )
    parser.add_argument("--short-tokens", type=int, default=4, help="max_tokens of the short requests")
    parser.add_argument("--long-tokens", type=int, default=2000, help="max_tokens of the 32 long streams, 16 at once")
    parser.add_argument("--c1-requests", type=int, default=200, help="short requests at concurrency 1")
    parser.add_argument("--c64-requests", type=int, default=1280, help="short requests at concurrency 64")
    parser.add_argument("--wait-samples", type=int, default=300, help="writes timed per wait on idle servers")
    args = parser.parse_args(argv)
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    print(asyncio.run(run(args)))


if __name__ == "__main__":
    main()
