"""Longest silence of a stream, and leases lost, with every part in its own session.

``python -m bench.stalls`` starts Redis, one worker and this subscriber as separate services,
streams one long request and reports the longest gap between events, the worker's lost leases
and its tokens per second, once with ``--cpu-nice 0`` and once with the default, side by side.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from devkit.redis_server import RedisServer
from devkit.tiny_model import build_tiny_model
from devkit.worker_process import WorkerProcess, tiny_engine_flags
from producer.client import StreamqClient
from streamq.protocol import ChunkEvent, FinalEvent

CGROUP_V1_CPU = Path("/sys/fs/cgroup/cpu")


@dataclass
class StallRun:
    placement: str
    cpu_nice: int
    tokens: int
    seconds: float
    longest_gap_ms: float
    gaps_over_250ms: int
    attempts: int
    leases_lost: int

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds


def _worker_command(redis_url: str, flags: list[str], cpu_nice: int, cgroup: Path | None) -> list[str]:
    command = [sys.executable, "-m", "worker", "--redis-url", redis_url, "--metrics-port", "0"]
    command += ["--cpu-nice", str(cpu_nice), *flags]
    if cgroup is None:
        return command
    # Join the cgroup before exec, so the worker and its engine processes all run in it.
    return ["sh", "-c", f'echo $$ > {cgroup}/cgroup.procs && exec "$@"', "sh", *command]


async def _stream(redis_url: str, max_tokens: int) -> tuple[int, float, list[float], set[int]]:
    async with await StreamqClient.connect(redis_url) as client:
        handle = await client.submit("Tell me a long story", max_tokens=max_tokens, ignore_eos=True, temperature=0)
        arrivals: list[float] = []
        attempts: set[int] = set()
        tokens = 0
        async for event in handle:
            arrivals.append(time.monotonic())
            attempts.add(event.attempt)
            if isinstance(event, ChunkEvent):
                tokens += len(event.token_ids)
            elif not isinstance(event, FinalEvent):
                raise RuntimeError(f"request failed: {event}")
        gaps = [b - a for a, b in zip(arrivals, arrivals[1:], strict=False)]
        return tokens, arrivals[-1] - arrivals[0], gaps, attempts


def run_once(model: Path, placement: str, cpu_nice: int, max_tokens: int, workdir: Path) -> StallRun:
    cgroup = None
    if placement == "cgroup":
        cgroup = CGROUP_V1_CPU / f"streamq-stalls-{os.getpid()}"
        cgroup.mkdir(exist_ok=True)
    flags = tiny_engine_flags(model, max_model_len=max_tokens + 64)
    try:
        with RedisServer() as redis_server:
            log = workdir / f"worker-{placement}-nice{cpu_nice}.log"
            command = _worker_command(redis_server.url, flags, cpu_nice, cgroup)
            worker = WorkerProcess(redis_server.url, flags, log_path=log, command=command).start().wait_ready()
            try:
                asyncio.run(_stream(redis_server.url, 16))  # warm-up
                tokens, seconds, gaps, attempts = asyncio.run(_stream(redis_server.url, max_tokens))
            finally:
                worker.stop()
            lost = log.read_text(errors="replace").count("lease lost")
    finally:
        if cgroup is not None:
            with contextlib.suppress(OSError):
                cgroup.rmdir()
    return StallRun(
        placement, cpu_nice, tokens, seconds, max(gaps) * 1000, sum(g > 0.25 for g in gaps), len(attempts), lost
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-tokens", type=int, default=3000)
    parser.add_argument("--nice", type=int, nargs="+", default=[0, 10], help="worker --cpu-nice values to compare")
    parser.add_argument(
        "--placements",
        nargs="+",
        default=["session"] + (["cgroup"] if os.access(CGROUP_V1_CPU, os.W_OK) else []),
        help="session: the worker in a session of its own; cgroup: also in a cpu cgroup of its own (cgroup v1, root)",
    )
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="streamq-stalls-") as tmp:
        model = build_tiny_model(Path(tmp) / "model", max_position_embeddings=args.max_tokens + 64)
        runs = [
            run_once(model, placement, nice, args.max_tokens, Path(tmp))
            for placement in args.placements
            for nice in args.nice
        ]
    print("| worker placement | --cpu-nice | tokens | tok/s | longest gap | gaps > 250 ms | attempts | leases lost |")
    print("|---|---|---|---|---|---|---|---|")
    for r in runs:
        print(
            f"| {r.placement} | {r.cpu_nice} | {r.tokens} | {r.tokens_per_s:,.0f} | {r.longest_gap_ms:,.0f} ms "
            f"| {r.gaps_over_250ms} | {r.attempts} | {r.leases_lost} |"
        )


if __name__ == "__main__":
    main()
