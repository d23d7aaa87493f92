"""The gateway's CPU per streamed token: this tree's ``python -m gateway`` against another
checkout's (``--base``), on one Redis and one scripted worker, rounds alternating.

    .venv/bin/python -m bench.gateway_cpu --base /path/to/other/checkout [--rounds 3] [--seconds 10]

The scripted worker (``devkit/scripted_engine.py``: one token per chunk, no model compute)
keeps the gateway the busy process. Each arm streams ``--concurrency`` requests of 256
tokens in a closed loop; reported, not asserted: the gateway's CPU time (user + system,
from ``/proc``) per streamed token, and tok/s as the clients count them, the median of the
rounds. ``--profile`` records this tree's gateway with py-spy during its rounds.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from contextlib import ExitStack, nullcontext
from pathlib import Path

from bench.gateway_load import Round, measure
from bench.profiling import PySpyRecording
from devkit.gateway_process import GatewayProcess
from devkit.redis_server import RedisServer
from devkit.worker_process import SCRIPTED_MODEL, scripted_worker

MODEL = SCRIPTED_MODEL


async def measure_arm(arm: str, gateway: GatewayProcess, *, chat: bool, concurrency: int, seconds: float) -> Round:
    body: dict[str, object] = {"model": MODEL, "max_tokens": 256, "stream": True}
    if chat:
        body["messages"] = [{"role": "user", "content": "bench"}]
    else:
        body["prompt"] = "bench"
    path = "/v1/chat/completions" if chat else "/v1/completions"
    return await measure(arm, gateway, path, body, concurrency=concurrency, seconds=seconds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", type=Path, required=True, help="a checkout whose gateway is the other arm")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=10)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--chat", action="store_true", help="stream /v1/chat/completions instead")
    parser.add_argument("--tokens-per-s", type=int, default=400, help="the scripted engine's steps per second")
    parser.add_argument("--profile", action="store_true", help="py-spy this tree's gateway during its rounds")
    parser.add_argument("--results-dir", type=Path, default=Path("bench/results"))
    args = parser.parse_args()
    logs = args.results_dir / f"{time.strftime('%Y%m%d-%H%M%S')}-gateway-cpu"
    logs.mkdir(parents=True)
    with ExitStack() as stack:
        redis = stack.enter_context(RedisServer())
        worker = scripted_worker(redis.url, logs / "worker.log", tokens_per_s=args.tokens_per_s)
        worker.start().wait_ready(timeout_s=120)
        stack.callback(worker.stop)
        gateways: dict[str, GatewayProcess] = {}
        for arm, env in (("base", {"PYTHONPATH": str(args.base.resolve())}), ("this tree", {})):
            log = logs / f"gateway-{arm.replace(' ', '-')}.log"
            gateway = GatewayProcess(redis.url, log, "--log-level", "warning", env=env).wait_ready()
            stack.callback(gateway.stop)
            gateways[arm] = gateway
        rounds: list[Round] = []
        for index in range(args.rounds):
            for arm, gateway in gateways.items():
                profiling = args.profile and arm == "this tree"
                out = logs / f"gateway-round{index + 1}.pyspy.txt"
                with PySpyRecording(gateway.process.pid, out) if profiling else nullcontext():
                    result = asyncio.run(
                        measure_arm(arm, gateway, chat=args.chat, concurrency=args.concurrency, seconds=args.seconds)
                    )
                print(
                    f"round {index + 1} {arm}: {result.tokens / result.seconds:,.0f} tok/s, "
                    f"gateway {result.us_per_token:.1f} CPU us / token, {result.errors} errors",
                    flush=True,
                )
                rounds.append(result)
    print("| arm | gateway CPU us per token (median) | tok/s (median) | rounds |\n|---|---:|---:|---:|")
    for arm in gateways:
        mine = [r for r in rounds if r.arm == arm]
        cpu = statistics.median(r.us_per_token for r in mine)
        tok_s = statistics.median(r.tok_s for r in mine)
        print(f"| {arm} | {cpu:.1f} | {tok_s:,.0f} | {len(mine)} |")


if __name__ == "__main__":
    main()
