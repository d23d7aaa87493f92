"""guidellm against ``vllm serve`` and the gateway, side by side, with guidellm's defaults.

guidellm is the benchmark vLLM's and llm-d's teams publish their figures with; a gateway
it cannot drive loses a team its numbers. This runs it as they do (``--profile
concurrent``, synthetic prompts, its default request body: chat completions streamed with
``stream_options.continuous_usage_stats``) at one concurrency against three servers of the
same engine flags, one at a time, each a service of its own:

- ``vllm serve`` (``bench/vllm_serve.py``), chat completions;
- the gateway (``python -m gateway`` → Redis → ``python -m worker``), chat completions;
- the same gateway, the Responses API (guidellm's ``request_format=/v1/responses``).

It prints, per server, the requests answered and the output tokens per second, with the
ratios that say what a move costs (gateway ÷ ``vllm serve``: what putting the queue in
front of the engine costs; Responses ÷ chat completions: what the Responses API's typed
events cost over the same requests), and the CPU each process spent per output token,
the figure that holds across noisy runs. guidellm runs from
a virtual environment of its own (``make guidellm-venv``: ``.venv-guidellm``), since it pins
packages below this project's (click, multidict).

    .venv/bin/python -m bench.guidellm_run [--streams 16] [--requests 128] [--tokens 64]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.config import BenchConfig
from bench.cpu import CpuWindow, descendants
from bench.path_gateway import wait_for_model
from bench.path_serve import start_server, wait_healthy
from devkit.gateway_process import GatewayProcess
from devkit.redis_server import RedisServer, free_port
from devkit.tiny_model import DEFAULT_DIR, build_tiny_model
from devkit.worker_process import WorkerProcess, worker_env

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_GUIDELLM = ROOT / ".venv-guidellm" / "bin" / "guidellm"
CHAT, RESPONSES = "/v1/chat/completions", "/v1/responses"


@dataclass(frozen=True)
class Run:
    """One guidellm benchmark: what it answered and how fast, and the CPU of the server's processes."""

    server: str
    request_format: str
    successful: int
    total: int
    output_tokens_per_s: float
    output_tokens: int
    cpu_us_per_token: dict[str, float]


def guidellm(
    binary: Path, target: str, request_format: str, args: argparse.Namespace, out: Path, model_dir: Path
) -> dict[str, Any]:
    """Run guidellm once against ``target`` and return its JSON report's one benchmark."""
    command = [
        str(binary),
        "run",
        "--backend",
        f"kind=openai_http,target={target},request_format={request_format}",
        "--profile",
        f"kind=concurrent,streams={args.streams}",
        "--data",
        f"kind=synthetic_text,prompt_tokens={args.tokens},output_tokens={args.tokens}",
        "--tokenizer",
        f"kind=hf_auto,model={model_dir}",
        "--constraint",
        f"kind=max_requests,count={args.requests}",
        "--disable-progress",
        "--output",
        f"kind=json,path={out}",
    ]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0 or not out.exists():
        raise RuntimeError(f"guidellm failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return dict(json.loads(out.read_text())["benchmarks"][0])


def measured(server: str, request_format: str, report: dict[str, Any], cpu: CpuWindow) -> Run:
    """The run's figures from guidellm's report and the CPU window opened before it."""
    metrics = report["metrics"]
    totals = metrics["request_totals"]
    tokens = int(metrics["output_token_count"]["successful"]["total_sum"])
    window = cpu.stop()
    return Run(
        server=server,
        request_format=request_format,
        successful=int(totals["successful"]),
        total=int(totals["total"]),
        output_tokens_per_s=float(metrics["output_tokens_per_second"]["successful"]["mean"]),
        output_tokens=tokens,
        cpu_us_per_token=window.us_per_token(tokens),
    )


def run_vllm_serve(args: argparse.Namespace, config: BenchConfig, binary: Path, results: Path) -> Run:
    port = free_port()
    log = results / "guidellm-vllm-serve.log"
    server = start_server(config, port, log)
    try:
        wait_healthy(server, port, log)
        roles = {"vllm serve": [server.pid, *descendants(server.pid)]}
        cpu = CpuWindow(roles)
        cpu.start()
        report = guidellm(
            binary, f"http://127.0.0.1:{port}", CHAT, args, results / "guidellm-vllm-serve.json", args.model_dir
        )
        return measured("vllm serve", CHAT, report, cpu)
    finally:
        server.terminate()
        server.wait(timeout=60)


def run_gateway(args: argparse.Namespace, config: BenchConfig, binary: Path, results: Path) -> list[Run]:
    runs = []
    with RedisServer() as redis_server:
        worker = WorkerProcess(
            redis_server.url, config.engine_flags(), log_path=results / "guidellm-worker.log", env=worker_env()
        )
        gateway = GatewayProcess(redis_server.url, results / "guidellm-gateway.log", "--log-level", "warning")
        try:
            worker.start().wait_ready()
            gateway.wait_ready()
            wait_for_model(gateway, config.model_dir)
            assert worker.process is not None and gateway.process is not None and redis_server.process is not None
            roles = {
                "worker": [worker.process.pid, *descendants(worker.process.pid)],
                "gateway": [gateway.process.pid],
                "redis": [redis_server.process.pid],
            }
            for request_format in (CHAT, RESPONSES):
                cpu = CpuWindow(roles)
                cpu.start()
                name = request_format.rsplit("/", 1)[1]
                out = results / f"guidellm-gateway-{name}.json"
                report = guidellm(binary, gateway.url, request_format, args, out, args.model_dir)
                runs.append(measured("gateway", request_format, report, cpu))
        finally:
            gateway.stop()
            worker.stop()
    return runs


def ratio(run: Run, base: Run) -> str:
    """``run``'s output tokens/s over ``base``'s; a dash where ``base`` answered nothing."""
    return f"{run.output_tokens_per_s / base.output_tokens_per_s:.2f}" if base.output_tokens_per_s else "-"


def table(runs: list[Run]) -> str:
    """The runs side by side, with the two ratios the goals name."""
    serve = next(run for run in runs if run.server == "vllm serve")
    chat = next(run for run in runs if run.server == "gateway" and run.request_format == CHAT)
    lines = [
        "| server | API | answered | output tok/s | ÷ vllm serve | ÷ gateway chat | CPU µs per output token |",
        "|---|---|---|---|---|---|---|",
    ]
    for run in runs:
        cpu = ", ".join(f"{role} {us:.0f}" for role, us in run.cpu_us_per_token.items())
        lines.append(
            f"| {run.server} | {run.request_format} | {run.successful}/{run.total} | {run.output_tokens_per_s:.0f} "
            f"| {ratio(run, serve)} | {ratio(run, chat)} | {cpu} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=16, help="guidellm's concurrent streams")
    parser.add_argument("--requests", type=int, default=128, help="requests per server")
    parser.add_argument("--tokens", type=int, default=64, help="synthetic prompt and output tokens")
    parser.add_argument("--guidellm", type=Path, default=DEFAULT_GUIDELLM, help="the guidellm command")
    parser.add_argument("--model-dir", type=Path, default=DEFAULT_DIR)
    parser.add_argument("--results-dir", type=Path, default=ROOT / "bench" / "results")
    args = parser.parse_args()
    if not args.guidellm.exists():
        parser.error(f"no guidellm at {args.guidellm}: run `make guidellm-venv`, or pass --guidellm")
    model_dir = build_tiny_model(args.model_dir)
    args.model_dir = model_dir
    run_id = time.strftime("%Y%m%d-%H%M%S")
    results = args.results_dir / f"guidellm-{run_id}"
    results.mkdir(parents=True, exist_ok=True)
    config = BenchConfig(
        model_dir=str(model_dir),
        input_len=args.tokens,
        output_len=args.tokens,
        concurrencies=(args.streams,),
        num_prompts=args.requests,
        seed=0,
        results_dir=str(results),
        run_id=run_id,
    )
    runs = [run_vllm_serve(args, config, args.guidellm, results), *run_gateway(args, config, args.guidellm, results)]
    text = table(runs)
    (results / "report.md").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
