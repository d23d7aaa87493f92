"""``python -m bench.batch``: a batch file through the queue against vLLM's own batch paths.

The same prompts (vLLM's ``random`` dataset), greedy, ``output_len`` tokens each, with the
same engine flags everywhere, one engine at a time, each path in processes of its own:

- ``offline``: ``vllm.LLM.generate`` over every prompt at once (``bench/batch_paths.py``);
- ``run-batch``: ``vllm run-batch``'s ``run_batch`` over the batch file;
- ``final-only``: a bare ``AsyncLLM``, every prompt at once, ``FINAL_ONLY``: the yardstick
  of the worker's CPU per token;
- ``streamq``: a throwaway Redis, one ``python -m worker`` and ``streamq batch`` over the
  same file, each a session of its own, as deployed; timed from the command's start to its
  exit (the worker's engine was started and warmed up before).

Printed side by side: tokens/s and each path's ratio to ``offline`` and ``run-batch``, texts
equal to ``offline``'s, CPU µs per token of every process, and for ``streamq`` the Redis
commands and the events per request. ``--rounds N`` runs every path N times, in turn.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import urllib.request
from datetime import datetime
from pathlib import Path
from typing import Any

import redis
from prometheus_client.parser import text_string_to_metric_families

from bench.batch_config import BatchBenchConfig, completion_text
from bench.command import CommandRun, run_measured
from bench.cpu import CpuWindow, descendants
from bench.profiling import PySpyRecording
from devkit.redis_server import RedisServer, free_port
from devkit.tiny_model import DEFAULT_DIR, build_tiny_model
from devkit.worker_process import WorkerProcess, worker_env

ROOT = Path(__file__).resolve().parents[1]
PATHS = ("offline", "run-batch", "final-only", "streamq")
WARM_UP_LINES = 8


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench.batch", description=__doc__.splitlines()[0])
    parser.add_argument("--num-prompts", type=int, default=384, help="lines of the batch (default %(default)s)")
    parser.add_argument("--input-len", type=int, default=32, help="prompt tokens (default %(default)s)")
    parser.add_argument("--output-len", type=int, default=256, help="output tokens, ignore_eos (default %(default)s)")
    parser.add_argument("--max-num-seqs", type=int, default=128, help="the engine's batch (default %(default)s)")
    parser.add_argument(
        "--endpoint",
        choices=("chat", "completions"),
        default="chat",
        help="chat lines against LLM.chat, or completion lines against LLM.generate (no run-batch path)",
    )
    parser.add_argument("--paths", default=",".join(PATHS), help="which to run (default %(default)s)")
    parser.add_argument("--rounds", type=int, default=1, help="times every path runs, in turn (default %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random dataset (default %(default)s)")
    parser.add_argument("--model-dir", type=Path, default=DEFAULT_DIR, help="tiny model, built if absent")
    parser.add_argument("--results-dir", type=Path, default=ROOT / "bench" / "results")
    parser.add_argument("--worker-args", default="", help="more arguments for the worker, e.g. '--max-jobs 256'")
    parser.add_argument(
        "--profile", action="store_true", help="record the worker with py-spy, the thread holding the GIL (perturbs it)"
    )
    parser.add_argument("--batch-args", default="", help="more arguments for streamq batch, e.g. '--max-in-flight 128'")
    return parser


def run_vllm_path(path: str, config: BatchBenchConfig, config_path: Path) -> dict[str, Any]:
    """One of vLLM's paths in its own process (``bench/batch_paths.py``)."""
    out = Path(config.results_dir) / f"{config.run_id}-{path}.json"
    log = Path(config.results_dir) / f"{config.run_id}-{path}.log"
    command = [sys.executable, "-m", "bench.batch_paths", path, str(config_path), str(out)]
    with open(log, "w") as log_file:
        code = subprocess.run(command, cwd=ROOT, env=worker_env(), stdout=log_file, stderr=subprocess.STDOUT).returncode
    if code != 0:
        raise SystemExit(f"path {path} failed with exit code {code}; see {log}")
    result: dict[str, Any] = json.loads(out.read_text())
    return result


def _commands(client: redis.Redis) -> dict[str, int]:
    stats: dict[str, Any] = client.info("commandstats")  # type: ignore[assignment]
    return {name.removeprefix("cmdstat_"): int(value["calls"]) for name, value in stats.items()}


def _worker_counts(port: int) -> dict[str, float]:
    """From the worker's metrics: ``events``, the ``streamq_request_events`` sum over requests
    that are not streamed, and its Redis round trips on the request path by purpose."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    counts: dict[str, float] = {"events": 0.0}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "streamq_request_events_sum" and sample.labels == {"streamed": "false"}:
                counts["events"] = float(sample.value)
            elif sample.name == "streamq_redis_round_trips_total":
                counts[f"round_trips_{sample.labels['purpose']}"] = float(sample.value)
    return counts


def run_batch_command(
    config: BatchBenchConfig, redis_url: str, queue: str, batch: Path, out: Path, extra: list[str]
) -> CommandRun:
    """``streamq batch`` as a user runs it, a session of its own."""
    command = [sys.executable, "-m", "producer", "batch", str(batch), str(out), "--no-progress"]
    run = run_measured([*command, "--redis-url", redis_url, "--queue", queue, *extra], cwd=ROOT)
    if run.returncode != 0:
        raise SystemExit(f"streamq batch failed with exit code {run.returncode}:\n{run.output}")
    return run


def run_streamq(
    config: BatchBenchConfig, batch_args: list[str], worker_args: list[str], *, profile: bool = False
) -> dict[str, Any]:
    """Redis, a worker and ``streamq batch`` over the batch file."""
    results = Path(config.results_dir)
    metrics_port = free_port()
    with RedisServer() as server:
        flags = [*config.engine_flags(), "--metrics-port", str(metrics_port), *worker_args]
        log = results / f"{config.run_id}-streamq-worker.log"
        worker = WorkerProcess(server.url, flags, log_path=log, env=worker_env(), metrics_port=metrics_port)
        try:
            worker.start().wait_ready()
            assert worker.process is not None and server.process is not None
            warm_up, warm_out = (
                results / f"{config.run_id}-warm-up.jsonl",
                results / f"{config.run_id}-streamq-wu.jsonl",
            )
            warm_out.unlink(missing_ok=True)  # a file left by an earlier round would be resumed: nothing to do
            run_batch_command(config, server.url, worker.queue, warm_up, warm_out, batch_args)
            client = redis.Redis.from_url(server.url)
            commands_before = _commands(client)
            counts_before = _worker_counts(metrics_port)
            roles = {
                "worker": [worker.process.pid],
                "engine_core": descendants(worker.process.pid),
                "redis": [server.process.pid],
            }
            out = results / f"{config.run_id}-streamq-out.jsonl"
            out.unlink(missing_ok=True)
            cpu = CpuWindow(roles)
            cpu.start()
            with contextlib.ExitStack() as stack:
                if profile:
                    stack.enter_context(
                        PySpyRecording(worker.process.pid, results / f"{config.run_id}-worker.pyspy", gil=True)
                    )
                batch_run = run_batch_command(
                    config, server.url, worker.queue, results / f"{config.run_id}-batch.jsonl", out, batch_args
                )
                window = cpu.stop()
            commands = {k: v - commands_before.get(k, 0) for k, v in _commands(client).items()}
            counts = {k: v - counts_before.get(k, 0.0) for k, v in _worker_counts(metrics_port).items()}
            client.close()
        finally:
            worker.stop()
    texts, tokens = {}, 0
    for raw in out.read_text().splitlines():
        line = json.loads(raw)
        body = line["response"]["body"]
        if body is None:
            raise SystemExit(f"a line failed: {line}")
        texts[line["custom_id"]] = completion_text(body)
        tokens += body["usage"]["completion_tokens"]
    return {
        "wall_s": batch_run.wall_s,
        "tokens": tokens,
        "texts": texts,
        "cpu_s": {**window.seconds, "batch_command": batch_run.cpu_s},
        "batch_peak_kib": batch_run.peak_kib,
        "redis_commands": {k: v for k, v in commands.items() if v},
        "events_per_request": counts.pop("events") / config.num_prompts,
        "round_trips_per_request": {
            k.removeprefix("round_trips_"): v / config.num_prompts for k, v in counts.items() if v
        },
    }


def report(config: BatchBenchConfig, rounds: list[dict[str, dict[str, Any]]]) -> str:
    """The tables: per round, tokens/s and ratios; the median round's CPU and Redis figures."""
    lines = [
        f"Batch of {config.num_prompts} prompts x {config.output_len} tokens (input {config.input_len}), greedy, "
        f"engine flags: {' '.join(config.engine_flags()[2:])}",
        "",
        "| round | path | tok/s | requests/s | ÷ offline | ÷ run-batch | texts equal to offline |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for number, paths in enumerate(rounds, start=1):
        rate = {name: r["tokens"] / r["wall_s"] for name, r in paths.items()}
        reference = paths.get("offline", {}).get("texts", {})
        for name, result in paths.items():
            equal = sum(result["texts"].get(k) == v for k, v in reference.items())
            offline = f"{rate[name] / rate['offline']:.3f}" if "offline" in rate else "-"
            run_batch = f"{rate[name] / rate['run-batch']:.3f}" if "run-batch" in rate else "-"
            lines.append(
                f"| {number} | {name} | {rate[name]:,.0f} | {config.num_prompts / result['wall_s']:,.0f} "
                f"| {offline} | {run_batch} | {equal}/{len(reference)} |"
            )
    lines += ["", "CPU µs per output token, by process (median over rounds):", ""]
    lines += ["| path | " + " | ".join(("front end / worker", "engine core", "redis", "batch command")) + " |"]
    lines += ["|---|---:|---:|---:|---:|"]
    for name in rounds[0]:
        per_round = [
            {role: 1e6 * s / paths[name]["tokens"] for role, s in paths[name]["cpu_s"].items()} for paths in rounds
        ]
        cells = []
        for roles in (("front_end", "worker"), ("engine_core",), ("redis",), ("batch_command",)):
            values = [next((r[role] for role in roles if role in r), None) for r in per_round]
            known = [v for v in values if v is not None]
            cells.append(f"{statistics.median(known):.1f}" if known else "-")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    streamq = [paths["streamq"] for paths in rounds if "streamq" in paths]
    if streamq:
        if any("final-only" in paths for paths in rounds):
            beyond = [
                1e6 * (p["streamq"]["cpu_s"]["worker"] / p["streamq"]["tokens"])
                - 1e6 * (p["final-only"]["cpu_s"]["front_end"] / p["final-only"]["tokens"])
                for p in rounds
                if "streamq" in p and "final-only" in p
            ]
            per_request = [b * config.output_len for b in beyond]
            lines += [
                "",
                f"Worker CPU per token beyond bare AsyncLLM (FINAL_ONLY): {', '.join(f'{b:.2f}' for b in beyond)} µs; "
                f"per request: {', '.join(f'{r:.0f}' for r in per_request)} µs",
            ]
        for number, result in enumerate(streamq, start=1):
            commands = result["redis_commands"]
            top = sorted(commands.items(), key=lambda kv: -kv[1])[:8]
            per_request = sum(commands.values()) / config.num_prompts
            lines += [
                "",
                f"streamq, round {number}: {per_request:.1f} Redis commands per request "
                f"({', '.join(f'{k} {v / config.num_prompts:.2f}' for k, v in top)}), "
                f"{result['events_per_request']:.2f} events per request, worker round trips to Redis per "
                f"request {sum(result['round_trips_per_request'].values()):.3f} "
                f"({', '.join(f'{k} {v:.3f}' for k, v in result['round_trips_per_request'].items())}), "
                f"streamq batch peak RSS {result['batch_peak_kib'] / 1024:.0f} MiB",
            ]
    return "\n".join(lines)


def main() -> None:
    args = build_parser().parse_args()
    os.chdir(ROOT)
    paths = [p for p in args.paths.split(",") if p]
    unknown = sorted(set(paths) - set(PATHS))
    if unknown:
        raise SystemExit(f"unknown paths: {', '.join(unknown)} (choose from {', '.join(PATHS)})")
    if args.endpoint == "completions" and "run-batch" in paths:
        raise SystemExit("vllm run-batch reads no /v1/completions lines: leave run-batch out of --paths")
    args.results_dir.mkdir(parents=True, exist_ok=True)
    if not (args.model_dir / "config.json").exists():
        build_tiny_model(args.model_dir)
    config = BatchBenchConfig(
        model_dir=str(args.model_dir),
        num_prompts=args.num_prompts,
        input_len=args.input_len,
        output_len=args.output_len,
        max_num_seqs=args.max_num_seqs,
        seed=args.seed,
        results_dir=str(args.results_dir),
        run_id="batch-" + datetime.now().strftime("%Y%m%d-%H%M%S"),
        endpoint=args.endpoint,
    )
    config_path = args.results_dir / f"{config.run_id}-config.json"
    config.save(config_path)
    prompts = config.prompts()
    (args.results_dir / f"{config.run_id}-batch.jsonl").write_text("\n".join(config.batch_lines(prompts)) + "\n")
    warm_up = config.batch_lines(prompts[:WARM_UP_LINES])
    (args.results_dir / f"{config.run_id}-warm-up.jsonl").write_text("\n".join(warm_up) + "\n")
    rounds: list[dict[str, dict[str, Any]]] = []
    for number in range(args.rounds):
        order = paths[number % len(paths) :] + paths[: number % len(paths)]  # each path goes first in turn
        done: dict[str, dict[str, Any]] = {}
        for path in order:
            print(f"--- round {number + 1}: {path}", flush=True)
            if path == "streamq":
                done[path] = run_streamq(
                    config, args.batch_args.split(), args.worker_args.split(), profile=args.profile
                )
            else:
                done[path] = run_vllm_path(path, config, config_path)
            print(f"    {done[path]['tokens'] / done[path]['wall_s']:,.0f} tok/s", flush=True)
        rounds.append({path: done[path] for path in paths})
    text = report(config, rounds)
    (args.results_dir / f"{config.run_id}.md").write_text(text + "\n")
    compact = [{p: {k: v for k, v in r.items() if k != "texts"} for p, r in paths.items()} for paths in rounds]
    (args.results_dir / f"{config.run_id}.json").write_text(json.dumps(compact, indent=1))
    print(text)


if __name__ == "__main__":
    main()
