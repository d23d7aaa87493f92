"""``python -m bench.pooling``: embeddings through the queue and the gateway, against vLLM's own.

The figures of docs/performance.md's "Pooling models" table in one run, every server a
process (and a session) of its own, one engine at a time, all on the tiny model of
``devkit.tiny_model`` run as an embedding model (``--runner pooling --convert embed``) with the
same engine flags, over the same ``--inputs`` texts of ``--input-len`` tokens (vLLM's ``random``
dataset):

- ``queue``: ``client.embed`` calls of ``--per-call`` inputs, ``--in-flight`` calls at once,
  through Redis and ``python -m worker``; inputs/s ÷ offline ``LLM.embed`` over every input
  at once (``bench/pooling_paths.py``, its own process);
- ``cpu``: the worker's CPU per input in that run less a bare ``AsyncLLM.encode`` driver's
  (``bench/pooling_paths.py``: one ``encode`` per input, the calls and concurrency the
  worker sees), each front end's own process only: the engine core processes excluded on both
  sides;
- ``http``: the same calls through the gateway's ``/v1/embeddings`` and through ``vllm serve``'s
  (``vllm.entrypoints.openai.api_server``), with the openai SDK's ``AsyncOpenAI``, the same
  concurrency: inputs/s of the gateway ÷ ``vllm serve``'s. A gateway that has no
  ``/v1/embeddings`` (a 404) leaves the part not run;
- ``redis``: the bytes Redis holds per 1,024-dimension vector once ``--redis-requests`` calls
  of 16 inputs have ended and their logs are kept for the default retention: ``used_memory``
  after less before, and ``MEMORY USAGE`` of the keys naming a request, by key family; with a
  one-layer variant of the tiny model whose hidden size is 1,024 (``.cache/tiny-llama-1024``).

Writes ``<results>/pooling-<time>.md`` and ``.json``, and every process's log beside them.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
PARTS = ("queue", "cpu", "http", "redis")
SERVED_NAME = "tiny-embed"
WIDE_DIR = Path(".cache/tiny-llama-1024")
WIDE_HIDDEN = 1024
WARM_UP_CALLS = 4
WORKER_FLAGS = ("--served-model-name", SERVED_NAME, "--cpu-nice", "0")
"""The worker at the CPU weight of the processes it is compared with (it lowers its own by
default, so that Redis and clients on its host are not starved: on a shared machine that
would measure the other tenants)."""
GOALS = {
    "queue_vs_offline": "≥ 0.9",
    "gateway_vs_serve": "≥ 1.0",
    "worker_us_beyond_bare": "≤ 100 µs",
    "redis_bytes_per_vector": "≤ 4.5 KB",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench.pooling", description=__doc__.splitlines()[0])
    parser.add_argument("--parts", default=",".join(PARTS), help="which to run (default %(default)s)")
    parser.add_argument("--inputs", type=int, default=20_000, help="texts embedded by each path (default %(default)s)")
    parser.add_argument("--input-len", type=int, default=64, help="tokens per text (default %(default)s)")
    parser.add_argument("--per-call", type=int, default=16, help="inputs per call (default %(default)s)")
    parser.add_argument("--in-flight", type=int, default=32, help="calls at once (default %(default)s)")
    parser.add_argument("--max-num-seqs", type=int, default=256, help="the engine's batch (default %(default)s)")
    parser.add_argument(
        "--max-num-batched-tokens", type=int, default=16384, help="the engine's tokens a step (default %(default)s)"
    )
    parser.add_argument("--redis-requests", type=int, default=200, help="calls of 16 for the Redis figure")
    parser.add_argument("--no-http", action="store_true", help="skip the gateway against vllm serve")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random dataset (default %(default)s)")
    parser.add_argument("--results-dir", type=Path, default=ROOT / "bench" / "results")
    return parser


def chosen_parts(text: str, *, no_http: bool = False) -> list[str]:
    """The parts named in ``--parts``, in the order they run; ``--no-http`` drops ``http``."""
    parts = [p.strip() for p in text.split(",") if p.strip()]
    unknown = [p for p in parts if p not in PARTS]
    if unknown:
        raise SystemExit(f"unknown parts: {', '.join(unknown)} (choose from {', '.join(PARTS)})")
    return [p for p in PARTS if p in parts and not (no_http and p == "http")]


def calls_of(inputs: Sequence[str], per_call: int) -> list[list[str]]:
    """``inputs`` in calls of ``per_call`` (the last may be shorter)."""
    if per_call < 1:
        raise ValueError("per_call must be at least 1")
    return [list(inputs[start : start + per_call]) for start in range(0, len(inputs), per_call)]


def engine_flags(model_dir: Path, max_num_seqs: int, max_num_batched_tokens: int) -> list[str]:
    """The engine flags every path runs with: the tiny model as an embedding model."""
    from devkit.worker_process import tiny_engine_flags

    return [
        *tiny_engine_flags(model_dir),
        "--runner",
        "pooling",
        "--convert",
        "embed",
        "--max-num-seqs",
        str(max_num_seqs),
        "--max-num-batched-tokens",
        str(max_num_batched_tokens),
    ]


def per_input_us(cpu_s: float, inputs: int) -> float:
    """CPU microseconds per input."""
    return 1e6 * cpu_s / inputs if inputs else 0.0


def beyond_bare_us(worker: dict[str, Any], bare: dict[str, Any]) -> float:
    """The worker process's CPU per input less the bare driver's front end's (engine cores
    excluded on both sides)."""
    return per_input_us(worker["cpu_s"]["worker"], worker["inputs"]) - per_input_us(
        bare["cpu_s"]["front_end"], bare["inputs"]
    )


def rate(result: dict[str, Any]) -> float:
    """Inputs per second of one path's result."""
    return float(result["inputs"] / result["wall_s"])


async def drive(
    calls: list[list[str]], in_flight: int, send: Callable[[list[str]], Awaitable[int]]
) -> tuple[float, int]:
    """``in_flight`` callers taking the next call each until none is left: the wall time and
    the inputs answered (``send`` returns how many vectors a call got back)."""
    pending = iter(calls)
    answered = [0]

    async def caller() -> None:
        for call in pending:
            got = await send(call)  # not `+= await`: that reads the count before the await
            answered[0] += got

    started = time.perf_counter()
    await asyncio.gather(*(caller() for _ in range(in_flight)))
    return time.perf_counter() - started, answered[0]


@dataclass
class Run:
    """Where one run writes, and what every part shares."""

    run_id: str
    results_dir: Path
    flags: list[str]
    inputs: list[str]
    per_call: int
    in_flight: int

    def path(self, suffix: str) -> Path:
        return self.results_dir / f"{self.run_id}-{suffix}"


def sample_inputs(model_dir: Path, count: int, input_len: int, seed: int) -> list[str]:
    """``count`` texts of ``input_len`` tokens: vLLM's ``random`` dataset's prompts."""
    from vllm.benchmarks.datasets import RandomDataset
    from vllm.tokenizers import get_tokenizer

    tokenizer = get_tokenizer(str(model_dir), tokenizer_mode="auto", trust_remote_code=False)
    requests = RandomDataset(random_seed=seed).sample(
        tokenizer=tokenizer, num_requests=count, input_len=input_len, output_len=1, range_ratio=0.0
    )
    return [str(r.prompt) for r in requests]


def build_wide_model(base_dir: Path, out_dir: Path = WIDE_DIR) -> Path:
    """A one-layer Llama of hidden size 1,024 with the tiny model's tokenizer: vectors of the
    size the Redis figure is asked for, at little compute."""
    marker = out_dir / "streamq-wide-model.json"
    if marker.exists():
        return out_dir
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(base_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(out_dir)
    torch.manual_seed(0)
    base = json.loads((base_dir / "config.json").read_text())
    config = LlamaConfig(
        vocab_size=base["vocab_size"],
        hidden_size=WIDE_HIDDEN,
        intermediate_size=1024,
        num_hidden_layers=1,
        num_attention_heads=16,  # head_dim 64, as the tiny model's
        num_key_value_heads=16,
        max_position_embeddings=base["max_position_embeddings"],
        bos_token_id=base.get("bos_token_id"),
        eos_token_id=base.get("eos_token_id"),
        pad_token_id=base.get("pad_token_id"),
        tie_word_embeddings=False,
        dtype="float32",
    )
    LlamaForCausalLM(config).save_pretrained(out_dir)
    marker.write_text(json.dumps({"hidden_size": WIDE_HIDDEN, "layers": 1}))
    return out_dir


def run_vllm_path(name: str, run: Run) -> dict[str, Any]:
    """``offline`` or ``bare`` (``bench/pooling_paths.py``) in a process of its own."""
    from devkit.worker_process import worker_env

    config = run.path("paths-config.json")
    if not config.exists():
        body = {"engine_flags": run.flags, "inputs": run.inputs, "per_call": run.per_call, "in_flight": run.in_flight}
        config.write_text(json.dumps(body))
    out, log = run.path(f"{name}.json"), run.path(f"{name}.log")
    command = [sys.executable, "-m", "bench.pooling_paths", name, str(config), str(out)]
    with open(log, "w") as log_file:
        code = subprocess.run(command, cwd=ROOT, env=worker_env(), stdout=log_file, stderr=subprocess.STDOUT).returncode
    if code != 0:
        raise SystemExit(f"path {name} failed with exit code {code}; see {log}")
    result: dict[str, Any] = json.loads(out.read_text())
    return result


async def queue_path(run: Run, redis_url: str, worker_pid: int, redis_pid: int) -> dict[str, Any]:
    """``client.embed`` calls through Redis and the worker, timed after a warm-up."""
    from bench.cpu import CpuWindow, descendants
    from producer.client import StreamqClient

    async with await StreamqClient.connect(redis_url) as client:

        async def send(call: list[str]) -> int:
            pooled = await client.embed(call, model=SERVED_NAME)
            return len(pooled.vectors)

        calls = calls_of(run.inputs, run.per_call)
        await drive(calls[:WARM_UP_CALLS], run.in_flight, send)
        roles = {
            "worker": [worker_pid],
            "engine_core": descendants(worker_pid),
            "redis": [redis_pid],
            "client": [os.getpid()],
        }
        cpu = CpuWindow(roles)
        cpu.start()
        wall_s, answered = await drive(calls, run.in_flight, send)
        window = cpu.stop()
    return {"wall_s": wall_s, "inputs": answered, "cpu_s": window.seconds}


async def http_path(run: Run, url: str, roles: dict[str, list[int]]) -> dict[str, Any]:
    """The same calls through an OpenAI-compatible ``/v1/embeddings`` with the openai SDK."""
    import openai

    from bench.cpu import CpuWindow

    async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="bench", max_retries=0, timeout=600) as sdk:

        async def send(call: list[str]) -> int:
            response = await sdk.embeddings.create(model=SERVED_NAME, input=call)
            return len(response.data)

        calls = calls_of(run.inputs, run.per_call)
        await drive(calls[:WARM_UP_CALLS], run.in_flight, send)
        cpu = CpuWindow({**roles, "client": [os.getpid()]})
        cpu.start()
        wall_s, answered = await drive(calls, run.in_flight, send)
        window = cpu.stop()
    return {"wall_s": wall_s, "inputs": answered, "cpu_s": window.seconds}


def serves_embeddings(url: str) -> bool:
    """The server answers ``/v1/embeddings`` (anything but a 404: the route is there)."""
    import httpx

    body = {"model": SERVED_NAME, "input": ["hello"]}
    return httpx.post(url + "/v1/embeddings", json=body, timeout=60).status_code != 404


def queue_and_gateway(run: Run, parts: list[str]) -> dict[str, Any]:
    """Redis and a worker: the queue path, then (``http``) the gateway in front of them."""
    from bench.cpu import descendants
    from devkit.gateway_process import GatewayProcess
    from devkit.redis_server import RedisServer
    from devkit.worker_process import WorkerProcess, worker_env

    done: dict[str, Any] = {}
    with RedisServer() as server:
        flags = [*run.flags, *WORKER_FLAGS]
        worker = WorkerProcess(server.url, flags, log_path=run.path("worker.log"), env=worker_env())
        try:
            worker.start().wait_ready()
            assert worker.process is not None and server.process is not None
            worker_pid, redis_pid = worker.process.pid, server.process.pid
            if "queue" in parts or "cpu" in parts:
                print("--- queue", flush=True)
                done["queue"] = asyncio.run(queue_path(run, server.url, worker_pid, redis_pid))
                print(f"    {rate(done['queue']):,.0f} inputs/s", flush=True)
            if "http" in parts:
                gateway = GatewayProcess(server.url, run.path("gateway.log")).wait_ready()
                try:
                    if serves_embeddings(gateway.url):
                        print("--- gateway", flush=True)
                        roles = {
                            "gateway": [gateway.process.pid],
                            "worker": [worker_pid],
                            "engine_core": descendants(worker_pid),
                            "redis": [redis_pid],
                        }
                        done["gateway"] = asyncio.run(http_path(run, gateway.url, roles))
                        print(f"    {rate(done['gateway']):,.0f} inputs/s", flush=True)
                    else:
                        print("--- gateway: no /v1/embeddings (404): the http part is not run", flush=True)
                        done["gateway_missing"] = True
                finally:
                    gateway.stop()
        finally:
            worker.stop()
    return done


def serve_path(run: Run) -> dict[str, Any]:
    """``vllm serve`` (its OpenAI API server module) on the same flags, the same calls."""
    import httpx

    from bench.cpu import descendants
    from devkit.redis_server import free_port
    from devkit.worker_process import worker_env

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", *run.flags]
    command += ["--served-model-name", SERVED_NAME, "--host", "127.0.0.1", "--port", str(port)]
    with open(run.path("vllm-serve.log"), "wb") as log:
        process = subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, env=worker_env(), start_new_session=True
        )
    try:
        deadline = time.monotonic() + 300
        while True:
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if process.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"vllm serve did not come up; see {run.path('vllm-serve.log')}")
            time.sleep(0.2)
        print("--- vllm serve", flush=True)
        roles = {"serve": [process.pid], "engine_core": descendants(process.pid)}
        result = asyncio.run(http_path(run, url, roles))
        print(f"    {rate(result):,.0f} inputs/s", flush=True)
        return result
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


async def _fill(url: str, requests: int, inputs: list[str]) -> tuple[int, int, dict[str, float], int]:
    """``requests`` calls of 16 inputs, 8 at once; ``used_memory`` before and after, the bytes
    of the keys naming a request by family (per request), and the vectors answered."""
    import redis.asyncio as aioredis

    from bench.redis_footprint import weigh
    from producer.client import StreamqClient

    admin = aioredis.Redis.from_url(url)
    try:
        before = int((await admin.info("memory"))["used_memory"])
        async with await StreamqClient.connect(url) as client:

            async def send(call: list[str]) -> int:
                pooled = await client.embed(call, model=SERVED_NAME)
                assert all(len(v) == WIDE_HIDDEN for v in pooled.vectors)
                return len(pooled.vectors)

            texts = itertools.cycle(inputs)
            calls = [[next(texts) for _ in range(16)] for _ in range(requests)]
            _, vectors = await drive(calls, 8, send)
        await asyncio.sleep(2)  # the acknowledgements and lease releases of the last ones
        after = int((await admin.info("memory"))["used_memory"])
    finally:
        await admin.aclose()
    families, _ = await weigh(url, requests)
    return before, after, families, vectors


def redis_part(run: Run, base_dir: Path, requests: int) -> dict[str, Any]:
    """A fresh Redis and a worker of the 1,024-wide model: Redis's bytes per vector."""
    from devkit.redis_server import RedisServer
    from devkit.worker_process import WorkerProcess, worker_env

    wide = build_wide_model(base_dir)
    flags = [str(wide) if flag == str(base_dir) else flag for flag in run.flags]
    print("--- redis (1,024 dimensions)", flush=True)
    with RedisServer() as server:
        worker = WorkerProcess(
            server.url,
            [*flags, "--served-model-name", SERVED_NAME],
            log_path=run.path("wide-worker.log"),
            env=worker_env(),
        )
        try:
            worker.start().wait_ready()
            before, after, families, vectors = asyncio.run(_fill(server.url, requests, run.inputs))
        finally:
            worker.stop()
    per_vector = {family: size * requests / vectors for family, size in families.items()}
    return {"requests": requests, "vectors": vectors, "used_memory_delta": after - before, "families": per_vector}


def report(config: dict[str, Any], results: dict[str, Any]) -> str:
    """The table of figures beside their goals, then the CPU of every process per input."""
    rows: list[tuple[str, str, str]] = []
    offline, queue, bare = results.get("offline"), results.get("queue"), results.get("bare")
    if offline and queue:
        rows.append(
            (
                "queue ÷ offline `LLM.embed`, inputs/s",
                GOALS["queue_vs_offline"],
                f"{rate(queue) / rate(offline):.2f} ({rate(queue):,.0f} ÷ {rate(offline):,.0f})",
            )
        )
    gateway, serve = results.get("gateway"), results.get("serve")
    if gateway and serve:
        rows.append(
            (
                "gateway ÷ `vllm serve`, `/v1/embeddings` inputs/s",
                GOALS["gateway_vs_serve"],
                f"{rate(gateway) / rate(serve):.2f} ({rate(gateway):,.0f} ÷ {rate(serve):,.0f})",
            )
        )
    elif results.get("gateway_missing"):
        rows.append(("gateway ÷ `vllm serve`", GOALS["gateway_vs_serve"], "not run: the gateway has no /v1/embeddings"))
    if queue and bare:
        worker_us = per_input_us(queue["cpu_s"]["worker"], queue["inputs"])
        bare_us = per_input_us(bare["cpu_s"]["front_end"], bare["inputs"])
        rows.append(
            (
                "worker CPU per input beyond bare `AsyncLLM.encode` (engine cores excluded)",
                GOALS["worker_us_beyond_bare"],
                f"{worker_us - bare_us:,.0f} µs ({worker_us:,.0f} − {bare_us:,.0f})",
            )
        )
    wide = results.get("redis")
    if wide:
        per_vector = wide["used_memory_delta"] / wide["vectors"]
        rows.append(
            (
                f"Redis bytes per {WIDE_HIDDEN}-dimension vector, logs kept (`used_memory` growth)",
                GOALS["redis_bytes_per_vector"],
                f"{per_vector:,.0f} B (raw float32: {4 * WIDE_HIDDEN:,} B)",
            )
        )
    lines = [
        f"{config['inputs']:,} inputs of {config['input_len']} tokens, {config['per_call']} per call, "
        f"{config['in_flight']} calls in flight; engine flags: {' '.join(config['flags'][2:])}",
        "",
        "| figure | goal | measured |",
        "|---|---|---|",
        *(f"| {name} | {goal} | {measured} |" for name, goal, measured in rows),
    ]
    measured = [(name, r) for name, r in results.items() if isinstance(r, dict) and "cpu_s" in r]
    if measured:
        lines += ["", "| path | inputs/s | CPU µs per input, by process |", "|---|---:|---|"]
        for name, result in measured:
            cpu = ", ".join(f"{role} {per_input_us(s, result['inputs']):,.0f}" for role, s in result["cpu_s"].items())
            lines.append(f"| {name} | {rate(result):,.0f} | {cpu} |")
    if wide:
        lines += ["", f"Redis, {wide['requests']} calls of 16 inputs ({wide['vectors']:,} vectors), bytes per vector:"]
        lines += [f"- `{family}`: {size:,.0f}" for family, size in wide["families"].items()]
        lines.append(f"- all keys naming a request: {sum(wide['families'].values()):,.0f}")
    return "\n".join(lines)


def main() -> None:
    args = build_parser().parse_args()
    parts = chosen_parts(args.parts, no_http=args.no_http)
    os.chdir(ROOT)
    from devkit.tiny_model import DEFAULT_DIR, build_tiny_model

    args.results_dir.mkdir(parents=True, exist_ok=True)
    model_dir = build_tiny_model(DEFAULT_DIR)
    run_id = "pooling-" + datetime.now().strftime("%Y%m%d-%H%M%S")
    inputs = sample_inputs(model_dir, args.inputs, args.input_len, args.seed)
    flags = engine_flags(model_dir, args.max_num_seqs, args.max_num_batched_tokens)
    run = Run(run_id, args.results_dir, flags, inputs, args.per_call, args.in_flight)
    started = time.monotonic()
    results: dict[str, Any] = {}
    if "queue" in parts:
        print("--- offline LLM.embed", flush=True)
        results["offline"] = run_vllm_path("offline", run)
        print(f"    {rate(results['offline']):,.0f} inputs/s", flush=True)
    if "cpu" in parts:
        print("--- bare AsyncLLM.encode", flush=True)
        results["bare"] = run_vllm_path("bare", run)
        print(f"    {rate(results['bare']):,.0f} inputs/s", flush=True)
    if {"queue", "cpu", "http"} & set(parts):
        results.update(queue_and_gateway(run, parts))
    if "gateway" in results:
        results["serve"] = serve_path(run)
    if "redis" in parts:
        results["redis"] = redis_part(run, model_dir, args.redis_requests)
    config = {
        "inputs": args.inputs,
        "input_len": args.input_len,
        "per_call": args.per_call,
        "in_flight": args.in_flight,
        "flags": flags,
    }
    text = report(config, results) + f"\n\nWall time of the run: {time.monotonic() - started:.0f} s"
    (args.results_dir / f"{run_id}.md").write_text(text + "\n")
    (args.results_dir / f"{run_id}.json").write_text(json.dumps({"config": config, "results": results}, indent=1))
    run.path("paths-config.json").unlink(missing_ok=True)  # every input again: not worth keeping
    print(text)


if __name__ == "__main__":
    main()
