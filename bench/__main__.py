"""``python -m bench``: the whole benchmark, in one run.

Paths (a) bare ``AsyncLLM``, (b) streamq, (c) ``vllm serve`` and (d) streamq's gateway (both
driven by ``vllm bench serve``) on the same model, flags and prompts, one path at a time, each
in its own process; then the scale-out run and the Redis capacity run. Writes
``<results>/<run>.json``, ``.md`` and ``.png``.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

from bench.config import BenchConfig, int_list
from bench.path_run import read_results
from bench.redis_capacity import CapacityConfig, CapacityResult, describe, run_redis_capacity
from bench.report import markdown, write_json, write_plot
from bench.scale_out import ScaleOutConfig, ScaleOutResult, run_scale_out
from bench.timing import PathResult
from devkit.tiny_model import DEFAULT_DIR, build_tiny_model
from devkit.worker_process import worker_env

ROOT = Path(__file__).resolve().parent.parent
PATH_MODULES = {
    "a": "bench.path_engine",
    "b": "bench.path_queue",
    "c": "bench.path_serve",
    "d": "bench.path_gateway",
    "e": "bench.path_front_ends",
}
QUICK = {
    "concurrency": "1,4",
    "num_prompts": 8,
    "output_len": 16,
    "scale_out_workers": "1",
    "scale_out_output_len": 200,
    "scale_out_warmup_s": 2.0,
    "scale_out_measure_s": 3.0,
    "capacity_rounds": 1,
}
DEFAULTS = {
    "concurrency": "1,16,64",
    "num_prompts": None,
    "output_len": 64,
    "scale_out_workers": "1,2,4",
    "scale_out_output_len": 1000,
    "scale_out_warmup_s": 5.0,
    "scale_out_measure_s": 10.0,
    "capacity_rounds": 2,
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", help=f"levels, comma-separated (default {DEFAULTS['concurrency']})")
    parser.add_argument("--num-prompts", type=int, help="requests per level (default: max(64, 16 x concurrency))")
    parser.add_argument("--input-len", type=int, default=32, help="prompt tokens (default %(default)s)")
    parser.add_argument("--output-len", type=int, help=f"output tokens, ignore_eos (default {DEFAULTS['output_len']})")
    parser.add_argument("--paths", default="a,b,c,d,e", help="which of a,b,c,d,e to run (default %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random dataset (default %(default)s)")
    parser.add_argument("--model-dir", type=Path, default=DEFAULT_DIR, help="tiny model, built if absent")
    parser.add_argument("--results-dir", type=Path, default=ROOT / "bench" / "results")
    parser.add_argument(
        "--profile",
        action="store_true",
        help="record path (b)'s worker (with its engine core) and the scale-out's worker 0 with py-spy "
        "(perturbs their figures; use a separate run)",
    )
    parser.add_argument(
        "--stream-interval",
        type=int,
        default=8,
        help="also run path (b) with a chunk every N tokens (vLLM's stream_interval); 0 to skip (default %(default)s)",
    )
    parser.add_argument(
        "--front-ends",
        type=int,
        default=1,
        help="front-end processes per engine in paths (c) and (d): vllm serve's --api-server-count and the "
        "worker's --front-ends, to compare them at the same count (default %(default)s)",
    )
    group = parser.add_argument_group("scale-out (scripted engine)")
    group.add_argument(
        "--scale-out-workers",
        help=f"worker counts, comma-separated, '' to skip (default {DEFAULTS['scale_out_workers']})",
    )
    group.add_argument(
        "--scale-out-subscribers", type=int, default=2, help="subscriber processes (default %(default)s)"
    )
    group.add_argument(
        "--scripted-tokens-per-s", type=float, default=250.0, help="tokens/s of each request (default %(default)s)"
    )
    group.add_argument(
        "--scripted-max-num-seqs", type=int, default=256, help="requests per worker at once (default %(default)s)"
    )
    group.add_argument("--scale-out-output-len", type=int, help="tokens per request (default 1000)")
    group.add_argument("--scale-out-warmup-s", type=float, help="seconds before the window (default 5)")
    group.add_argument("--scale-out-measure-s", type=float, help="seconds measured (default 10)")
    parser.add_argument(
        "--capacity-rounds",
        type=int,
        help="rounds of the Redis capacity run (its other settings: bench.redis_capacity's defaults); 0 skips it "
        f"(default {DEFAULTS['capacity_rounds']})",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="a short smoke run: " + ", ".join(f"{k.replace('_', '-')}={v}" for k, v in QUICK.items()),
    )
    return parser


def resolve(args: argparse.Namespace) -> argparse.Namespace:
    """Fill what the user left unset from --quick's values or the full run's."""
    for key, value in (QUICK if args.quick else DEFAULTS).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    return args


def run_path(path: str, config: BenchConfig) -> list[PathResult]:
    """Run one path's module in its own process; its log goes to the results dir,
    its progress lines (``[a] ...``) to the console."""
    results_dir = Path(config.results_dir)
    config_path = results_dir / f"{config.run_id}-config.json"
    config.save(config_path)
    out = results_dir / f"{config.run_id}-{path}.json"
    log_path = results_dir / f"{config.run_id}-{path}.log"
    print(f"--- path ({path}): {PATH_MODULES[path]} (log: {log_path})", flush=True)
    command = [sys.executable, "-m", PATH_MODULES[path], str(config_path), str(out)]
    with open(log_path, "w") as log:
        child = subprocess.Popen(
            command, cwd=ROOT, env=worker_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        assert child.stdout is not None
        for line in child.stdout:
            log.write(line)
            if line.startswith(f"[{path}") or line.startswith("top ") or "samples on CPU" in line:
                print(line, end="", flush=True)
    if child.wait() != 0:
        raise SystemExit(f"path ({path}) failed with exit code {child.returncode}; see {log_path}")
    return read_results(out)


def main() -> None:
    args = resolve(build_parser().parse_args())
    os.chdir(ROOT)
    args.results_dir.mkdir(parents=True, exist_ok=True)
    run_id = time.strftime("%Y%m%d-%H%M%S")
    model_dir = build_tiny_model(args.model_dir)
    config = BenchConfig(
        model_dir=str(model_dir),
        input_len=args.input_len,
        output_len=args.output_len,
        concurrencies=int_list(args.concurrency),
        num_prompts=args.num_prompts,
        seed=args.seed,
        results_dir=str(args.results_dir),
        run_id=run_id,
        profile=args.profile,
        stream_interval=args.stream_interval,
        front_ends=args.front_ends,
    )
    started = time.monotonic()
    results: list[PathResult] = []
    for path in [p.strip() for p in args.paths.split(",") if p.strip()]:
        results += run_path(path, config)
    scale_out: list[ScaleOutResult] = []
    if int_list(args.scale_out_workers):
        print("--- scale-out", flush=True)
        scale_out = run_scale_out(
            ScaleOutConfig(
                workers=int_list(args.scale_out_workers),
                tokens_per_s=args.scripted_tokens_per_s,
                max_num_seqs=args.scripted_max_num_seqs,
                output_len=args.scale_out_output_len,
                subscribers=args.scale_out_subscribers,
                warmup_s=args.scale_out_warmup_s,
                measure_s=args.scale_out_measure_s,
                results_dir=args.results_dir,
                run_id=run_id,
                model_dir=str(model_dir),
                profile=args.profile,
            )
        )
    capacity: list[CapacityResult] = []
    capacity_config = CapacityConfig(rounds=args.capacity_rounds, results_dir=args.results_dir, run_id=run_id)
    if args.capacity_rounds:
        print("--- Redis capacity", flush=True)
        capacity = run_redis_capacity(capacity_config)
    header = (
        f"# streamq benchmark {run_id}\n\nTiny random Llama ({model_dir}), input {config.input_len} tokens, "
        f"output {config.output_len} tokens (ignore_eos, temperature 0), engine flags "
        f"`{' '.join(config.engine_flags())}`; {config.front_ends} front end(s) per engine in (c) and (d); "
        f"{os.cpu_count()} CPUs; "
        f"{time.monotonic() - started:.0f} s in all."
    )
    table = markdown(results, scale_out, header, capacity, describe(capacity_config))
    base = args.results_dir / run_id
    base.with_suffix(".md").write_text(table)
    settings = vars(args) | {"results_dir": str(args.results_dir), "model_dir": str(model_dir)}
    write_json(base.with_suffix(".json"), {"run_id": run_id, "config": settings}, results, scale_out, capacity)
    write_plot(base.with_suffix(".png"), results, scale_out)
    print("\n" + table)
    print(f"written: {base}.json, {base}.md, {base}.png", flush=True)


if __name__ == "__main__":
    main()
