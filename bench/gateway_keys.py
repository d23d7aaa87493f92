"""What API keys and per-key limits cost the gateway: streams at concurrency 16 through
``python -m gateway`` with a key and limits (rpm, tpm, max_streams, an allow-list: all
checked, none binding) against the same gateway open, rounds alternating.

    .venv/bin/python -m bench.gateway_keys [--rounds 3] [--seconds 15] [--concurrency 16]

Each arm has its own Redis and a scripted worker (``devkit/scripted_engine.py``: no model
compute), so the gateway is what is busy. Reported, not asserted: output tok/s as the
clients count them, and the gateway's CPU time per 1,000 tokens (user + system, from
``/proc``), the median of the rounds.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import json
import statistics
import time
from contextlib import ExitStack
from dataclasses import asdict
from pathlib import Path

from bench.gateway_load import Round, measure
from devkit.gateway_process import GatewayProcess
from devkit.redis_server import RedisServer
from devkit.worker_process import SCRIPTED_MODEL, scripted_worker
from producer.keys_cli import run_keys

MODEL = SCRIPTED_MODEL


async def measure_arm(arm: str, gateway: GatewayProcess, key: str | None, concurrency: int, seconds: float) -> Round:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    body: dict[str, object] = {"model": MODEL, "prompt": "bench", "max_tokens": 256, "stream": True}
    return await measure(
        arm, gateway, "/v1/completions", body, concurrency=concurrency, seconds=seconds, headers=headers
    )


def create_key(redis_url: str) -> str:
    """A key whose every limit is checked and none is reached in the run."""
    args = argparse.Namespace(
        action="create",
        name="bench",
        rpm=1_000_000,
        tpm=1_000_000_000,
        max_streams=1_000,
        models=[MODEL],
        redis_url=redis_url,
    )
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert asyncio.run(run_keys(args)) == 0
    return out.getvalue().strip()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=15)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--tokens-per-s", type=int, default=400, help="the scripted engine's steps per second")
    parser.add_argument("--results-dir", type=Path, default=Path("bench/results"))
    args = parser.parse_args()
    args.results_dir.mkdir(parents=True, exist_ok=True)
    run_id = time.strftime("%Y%m%d-%H%M%S")
    logs = args.results_dir / f"{run_id}-gateway-keys"
    logs.mkdir()
    with ExitStack() as stack:
        gateways: dict[str, tuple[GatewayProcess, str | None]] = {}
        for arm in ("keys off", "keys and limits on"):
            redis = stack.enter_context(RedisServer())
            slug = arm.split()[-1]
            worker = scripted_worker(redis.url, logs / f"worker-{slug}.log", tokens_per_s=args.tokens_per_s)
            worker.start().wait_ready(timeout_s=120)
            stack.callback(worker.stop)
            key = create_key(redis.url) if arm != "keys off" else None
            gateway = GatewayProcess(redis.url, logs / f"gateway-{slug}.log", "--log-level", "warning").wait_ready()
            stack.callback(gateway.stop)
            gateways[arm] = (gateway, key)
        rounds: list[Round] = []
        for index in range(args.rounds):
            for arm, (gateway, key) in gateways.items():
                result = asyncio.run(measure_arm(arm, gateway, key, args.concurrency, args.seconds))
                print(
                    f"round {index + 1} {arm}: {result.tok_s:,.0f} tok/s, "
                    f"gateway {result.us_per_token:.1f} CPU ms / 1k tokens, {result.errors} errors",
                    flush=True,
                )
                rounds.append(result)
    lines = ["| arm | output tok/s (median) | gateway CPU ms per 1k tokens (median) | rounds |", "|---|---:|---:|---:|"]
    summary = {}
    for arm in gateways:
        mine = [r for r in rounds if r.arm == arm]
        tok_s = statistics.median(r.tok_s for r in mine)
        cpu = statistics.median(r.us_per_token for r in mine)  # µs per token = ms per 1k tokens
        summary[arm] = {"tok_s": tok_s, "cpu_ms_per_1k_tokens": cpu}
        lines.append(f"| {arm} | {tok_s:,.0f} | {cpu:.1f} | {len(mine)} |")
    table = "\n".join(lines)
    print(table)
    result_path = args.results_dir / f"{run_id}-gateway-keys.json"
    result_path.write_text(
        json.dumps(
            {
                "args": {k: str(v) for k, v in vars(args).items()},
                "rounds": [asdict(r) for r in rounds],
                "summary": summary,
            },
            indent=2,
        )
    )
    (args.results_dir / f"{run_id}-gateway-keys.md").write_text(table + "\n")


if __name__ == "__main__":
    main()
