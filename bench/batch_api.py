"""``python -m bench.batch_api``: the OpenAI Batch API at the gateway, measured side by side.

The figures of the Batch API's "Measured" table (docs/performance.md), in one run, every
server a process (and a session) of its own, as deployed:

- ``throughput``: one batch file of ``--num-prompts`` chat lines x ``--output-len`` tokens
  (vLLM's ``random`` dataset, greedy, ``ignore_eos``) through ``/v1/batches`` with the openai
  SDK (upload, create, a retrieve every ``--poll-s``, download: timed from the upload's start
  to the download's end), through ``streamq batch`` on the same worker and Redis, and through
  vLLM's offline ``LLM.chat`` (``bench/batch_paths.py``, before the worker starts: one engine
  at a time), all with the same engine flags;
- ``ttft``: ``--ttft-requests`` streamed chat requests one after another, time to their first
  token, with no batch, then while a batch of ``--ttft-batch-lines`` fills the worker (sent
  once the worker reports ``--max-num-seqs`` requests in flight, less the slots a batch leaves
  free for online requests (``--batch-online-reserve``); the batch is cancelled
  after);
- ``memory``: the gateway's resident memory (``VmRSS``, sampled every 50 ms) before, at its
  peak during, and after a file of ``--memory-lines`` lines (each size on a fresh gateway)
  through a scripted worker (``devkit/scripted_engine.py``: no model), after a 10-line batch
  (what a gateway loads for its first batch is not counted against the file);
- ``takeover``: a gateway SIGKILLed mid-batch (scripted worker), a second one on the same
  Redis and files: seconds from the kill until the batch's ``request_counts`` move again, read
  through the second gateway, and whether every ``custom_id`` is answered once in the end.

Prints the figures and the ratios beside their goals; writes
``<results>/batch-api-<time>.md`` and ``.json``, and every process's log beside them.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import statistics
import tempfile
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import openai
import redis

from bench.batch import WARM_UP_LINES, run_batch_command, run_vllm_path
from bench.batch_config import BatchBenchConfig, completion_text
from bench.cpu import CpuWindow, descendants
from devkit.gateway_process import GatewayProcess
from devkit.redis_server import RedisServer, free_port
from devkit.tiny_model import DEFAULT_DIR, build_tiny_model
from devkit.worker_process import SCRIPTED_MODEL, WorkerProcess, scripted_worker, worker_env
from gateway.batch_api import names
from gateway.batch_api.config import DEFAULT_ONLINE_RESERVE

ROOT = Path(__file__).resolve().parents[1]
PARTS = ("throughput", "ttft", "memory", "takeover")
FINAL_STATES = frozenset({"completed", "failed", "expired", "cancelled"})
RSS_SAMPLE_S = 0.05
GOALS = {
    "api_vs_streamq_batch": "≥ 0.97",
    "api_vs_offline": "≥ 0.97",
    "ttft_ratio": "≤ 1.5",
    "gateway_memory": "bounded, not growing with the file",
    "takeover_s": "≤ 5 s",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench.batch_api", description=__doc__.splitlines()[0])
    parser.add_argument("--parts", default=",".join(PARTS), help="which to run (default %(default)s)")
    parser.add_argument("--num-prompts", type=int, default=384, help="lines of the batch (default %(default)s)")
    parser.add_argument("--input-len", type=int, default=32, help="prompt tokens (default %(default)s)")
    parser.add_argument("--output-len", type=int, default=256, help="output tokens, ignore_eos (default %(default)s)")
    parser.add_argument("--max-num-seqs", type=int, default=128, help="the engine's batch (default %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random dataset (default %(default)s)")
    parser.add_argument(
        "--rounds", type=int, default=1, help="streamq batch and /v1/batches, each first in turn (default %(default)s)"
    )
    parser.add_argument("--poll-s", type=float, default=0.5, help="between two retrieves (default %(default)s)")
    parser.add_argument("--model-dir", type=Path, default=DEFAULT_DIR, help="tiny model, built if absent")
    parser.add_argument("--results-dir", type=Path, default=ROOT / "bench" / "results")
    parser.add_argument("--worker-args", default="", help="more arguments for every worker")
    parser.add_argument("--gateway-args", default="", help="more arguments for every gateway")
    group = parser.add_argument_group("ttft")
    group.add_argument("--ttft-requests", type=int, default=20, help="online requests per arm (default %(default)s)")
    group.add_argument("--ttft-output-len", type=int, default=16, help="their max tokens (default %(default)s)")
    group.add_argument(
        "--ttft-batch-lines",
        type=int,
        help="lines of the batch that fills the worker meanwhile, cancelled once measured "
        "(default: the larger of 4 x --num-prompts and 40 x --max-num-seqs, to outlast the requests)",
    )
    group = parser.add_argument_group("memory (scripted engine)")
    group.add_argument(
        "--memory-lines", default="5000,50000", help="file sizes, comma-separated, each on a fresh gateway"
    )
    group.add_argument("--memory-line-bytes", type=int, default=1000, help="bytes a line, about (default %(default)s)")
    group.add_argument("--memory-tokens", type=int, default=4, help="tokens a line (default %(default)s)")
    group = parser.add_argument_group("takeover (scripted engine)")
    group.add_argument("--takeover-lines", type=int, default=3000, help="lines of its batch (default %(default)s)")
    group.add_argument("--takeover-tokens", type=int, default=200, help="tokens a line (default %(default)s)")
    group.add_argument(
        "--scripted-tokens-per-s", type=int, default=100, help="each scripted request's rate (default %(default)s)"
    )
    return parser


# --- the pieces ---------------------------------------------------------------------------


def rss_kib(pid: int) -> int:
    """``pid``'s resident memory now, in KiB (0 once it is gone)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return 0
    match = re.search(r"^VmRSS:\s+(\d+) kB", status, re.MULTILINE)
    return int(match.group(1)) if match else 0


class RssSampler:
    """The peak of a process's resident memory between ``start()`` and ``stop()``."""

    def __init__(self, pid: int) -> None:
        self.pid, self.peak_kib, self.samples = pid, 0, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak_kib = max(self.peak_kib, rss_kib(self.pid))
            self.samples += 1
            self._stop.wait(RSS_SAMPLE_S)

    def start(self) -> RssSampler:
        self._thread.start()
        return self

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.peak_kib


def sdk_of(gateway: GatewayProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=gateway.url + "/v1", api_key="bench", max_retries=0, timeout=600)


def done_count(batch: Any) -> int:
    counts = batch.request_counts
    return 0 if counts is None else int(counts.completed + counts.failed)


def wait_final(sdk: openai.OpenAI, batch_id: str, poll_s: float, timeout_s: float = 3600) -> Any:
    deadline = time.monotonic() + timeout_s
    batch = sdk.batches.retrieve(batch_id)
    while batch.status not in FINAL_STATES:
        if time.monotonic() > deadline:
            raise SystemExit(f"batch {batch_id} still {batch.status} after {timeout_s:.0f} s")
        time.sleep(poll_s)
        batch = sdk.batches.retrieve(batch_id)
    return batch


def submit(sdk: openai.OpenAI, path: Path, endpoint: str) -> Any:
    """Upload ``path`` and create a batch of it."""
    with path.open("rb") as file:
        uploaded = sdk.files.create(file=file, purpose="batch")
    return sdk.batches.create(input_file_id=uploaded.id, endpoint=endpoint, completion_window="24h")  # type: ignore[arg-type]


def run_api_batch(
    sdk: openai.OpenAI, path: Path, poll_s: float, endpoint: str = "/v1/chat/completions"
) -> dict[str, Any]:
    """The SDK's whole flow over ``path``: upload, create, poll, download; timed end to end."""
    started = time.perf_counter()
    batch = wait_final(sdk, submit(sdk, path, endpoint).id, poll_s)
    if batch.status != "completed" or batch.output_file_id is None:
        raise SystemExit(f"batch {batch.id} ended {batch.status}: {batch.errors}")
    content = sdk.files.content(batch.output_file_id).content
    wall_s = time.perf_counter() - started
    texts, tokens, failed = {}, 0, 0
    for raw in content.splitlines():
        line = json.loads(raw)
        body = (line.get("response") or {}).get("body")
        if line.get("error") or body is None or line["response"]["status_code"] != 200:
            failed += 1
            continue
        texts[line["custom_id"]] = completion_text(body)
        tokens += body["usage"]["completion_tokens"]
    failed += batch.request_counts.failed if batch.request_counts else 0
    stages = {  # where the batch's time went, by its own timestamps (whole seconds)
        "validating_s": (batch.in_progress_at or batch.created_at) - batch.created_at,
        "in_progress_s": (batch.finalizing_at or 0) - (batch.in_progress_at or 0),
        "finalizing_s": (batch.completed_at or 0) - (batch.finalizing_at or 0),
    }
    result = {"wall_s": wall_s, "tokens": tokens, "texts": texts, "failed": failed, "batch_id": batch.id}
    return result | {"stages": stages}


def in_flight(metrics_port: int) -> float:
    """The worker's ``streamq_requests_in_flight``."""
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as response:
        text = response.read().decode()
    match = re.search(r"^streamq_requests_in_flight (\S+)$", text, re.MULTILINE)
    return float(match.group(1)) if match else 0.0


def ttft_s(sdk: openai.OpenAI, model: str, prompts: list[str], max_tokens: int) -> list[float]:
    """Each prompt as a streamed chat, one after the other: seconds to the first chunk that
    carries a token (``continuous_usage_stats``: its ``completion_tokens`` 1 or more; a
    token's text can be empty, a byte of a character still to come)."""
    times = []
    for prompt in prompts:
        started = time.perf_counter()
        first = None
        stream = sdk.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": prompt}],  # as conversation() builds it
            max_tokens=max_tokens,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}},
        )
        for chunk in stream:
            if first is None and chunk.usage is not None and chunk.usage.completion_tokens >= 1:
                first = time.perf_counter() - started
        if first is None:
            raise SystemExit("an online request streamed no token")
        times.append(first)
    return times


def completion_lines(count: int, tokens: int, line_bytes: int, prefix: str = "line") -> Iterator[str]:
    """Completion lines for the scripted model, each about ``line_bytes`` long."""
    for index in range(count):
        body: dict[str, Any] = {"model": SCRIPTED_MODEL, "prompt": f"{prefix} {index} ", "max_tokens": tokens}
        row = {"custom_id": f"{prefix}-{index}", "method": "POST", "url": "/v1/completions", "body": body}
        body["prompt"] += "x" * max(0, line_bytes - len(json.dumps(row)) - 1)  # less its newline
        yield json.dumps(row)


def write_lines(path: Path, lines: Iterator[str] | list[str]) -> Path:
    with path.open("w") as file:
        for line in lines:
            file.write(line + "\n")
    return path


def _extra(text: str) -> list[str]:
    return text.split()


@dataclass
class Servers:
    """Redis, one worker and gateways, each a process of its own; stopped in reverse."""

    redis: RedisServer
    worker: WorkerProcess
    gateways: list[GatewayProcess] = field(default_factory=list)

    def stop(self) -> None:
        for gateway in self.gateways:
            if gateway.process.poll() is None:
                gateway.stop()
        self.worker.stop()


@contextlib.contextmanager
def scripted_servers(scratch: Path, name: str, tokens_per_s: int, worker_args: list[str]) -> Iterator[Servers]:
    with RedisServer() as server:
        worker = scripted_worker(
            server.url,
            scratch / f"{name}-worker.log",
            *worker_args,
            tokens_per_s=tokens_per_s,
            metrics_port=free_port(),
        )
        servers = Servers(server, worker)
        try:
            worker.start().wait_ready(timeout_s=120)
            yield servers
        finally:
            servers.stop()


def start_gateway(servers: Servers, log: Path, files_dir: Path, extra: list[str]) -> GatewayProcess:
    gateway = GatewayProcess(
        servers.redis.url, log, "--log-level", "warning", "--files-url", str(files_dir), *extra
    ).wait_ready()
    servers.gateways.append(gateway)
    return gateway


# --- the parts ----------------------------------------------------------------------------


def run_throughput_and_ttft(args: argparse.Namespace, config: BatchBenchConfig, parts: list[str]) -> dict[str, Any]:
    """Offline first (its own process, then gone); then Redis, one worker and a gateway:
    ``streamq batch`` and ``/v1/batches`` over the same file, then the TTFT arms."""
    results_dir = Path(config.results_dir)
    out: dict[str, Any] = {}
    config_path = results_dir / f"{config.run_id}-config.json"
    batch_file = results_dir / f"{config.run_id}-batch.jsonl"
    warm_up = results_dir / f"{config.run_id}-warm-up.jsonl"
    if "throughput" in parts:
        print("--- offline LLM.chat", flush=True)
        out["offline"] = run_vllm_path("offline", config, config_path)
        print(f"    {out['offline']['tokens'] / out['offline']['wall_s']:,.0f} tok/s", flush=True)
    metrics_port = free_port()
    with RedisServer() as server, tempfile.TemporaryDirectory() as files_dir:
        flags = [*config.engine_flags(), "--metrics-port", str(metrics_port), *_extra(args.worker_args)]
        worker = WorkerProcess(
            server.url,
            flags,
            log_path=results_dir / f"{config.run_id}-worker.log",
            env=worker_env(),
            metrics_port=metrics_port,
        )
        servers = Servers(server, worker)
        try:
            worker.start().wait_ready()
            gateway = start_gateway(
                servers,
                results_dir / f"{config.run_id}-gateway.log",
                Path(files_dir),
                _extra(args.gateway_args),
            )
            sdk = sdk_of(gateway)
            assert worker.process is not None and server.process is not None
            roles = {
                "worker": [worker.process.pid],
                "engine_core": descendants(worker.process.pid),
                "redis": [server.process.pid],
                "gateway": [gateway.process.pid],
            }
            run_api_batch(sdk, warm_up, args.poll_s)  # the gateway's and the worker's first batch
            if "throughput" in parts:
                warm_out = results_dir / f"{config.run_id}-streamq-wu.jsonl"
                warm_out.unlink(missing_ok=True)
                run_batch_command(config, server.url, worker.queue, warm_up, warm_out, [])
                rounds: list[dict[str, Any]] = []
                for number in range(args.rounds):  # each goes first in turn: the machine's drift shared
                    order = ("streamq_batch", "api") if number % 2 == 0 else ("api", "streamq_batch")
                    done: dict[str, Any] = {}
                    for path in order:
                        print(f"--- round {number + 1}: {dict(_PATH_NAMES)[path]}", flush=True)
                        if path == "api":
                            cpu = CpuWindow(roles)
                            cpu.start()
                            done[path] = run_api_batch(sdk, batch_file, args.poll_s)
                            done[path]["cpu_s"] = cpu.stop().seconds
                        else:
                            done[path] = run_streamq_batch(config, server.url, worker.queue, batch_file, roles)
                        print(f"    {_rate(done[path]):,.0f} tok/s", flush=True)
                    rounds.append(done)
                out["rounds"] = rounds
            if "ttft" in parts:
                out["ttft"] = run_ttft(args, config, sdk, metrics_port)
        finally:
            servers.stop()
    return out


def filler_lines(config: BatchBenchConfig) -> int:
    """Enough lines that the batch still runs after the last online request (it is cancelled)."""
    return max(4 * config.num_prompts, 40 * config.max_num_seqs)


def run_streamq_batch(
    config: BatchBenchConfig, redis_url: str, queue: str, batch_file: Path, roles: dict[str, list[int]]
) -> dict[str, Any]:
    """``streamq batch`` over the file (bench/batch.py's run), timed from its start to its exit."""
    out = Path(config.results_dir) / f"{config.run_id}-streamq-out.jsonl"
    out.unlink(missing_ok=True)  # a file left by an earlier round would be resumed: nothing to do
    cpu = CpuWindow(roles)
    cpu.start()
    run = run_batch_command(config, redis_url, queue, batch_file, out, [])
    window = cpu.stop()
    texts, tokens = {}, 0
    for raw in out.read_text().splitlines():
        line = json.loads(raw)
        texts[line["custom_id"]] = completion_text(line["response"]["body"])
        tokens += line["response"]["body"]["usage"]["completion_tokens"]
    return {
        "wall_s": run.wall_s,
        "tokens": tokens,
        "texts": texts,
        "cpu_s": {**window.seconds, "batch_command": run.cpu_s},
    }


def run_ttft(
    args: argparse.Namespace, config: BatchBenchConfig, sdk: openai.OpenAI, metrics_port: int
) -> dict[str, Any]:
    """Online TTFT with no batch, then while a batch fills the worker (cancelled after)."""
    count = args.ttft_requests
    online_config = BatchBenchConfig(**{**asdict(config), "num_prompts": 2 * count + 1, "seed": config.seed + 1})
    online = online_config.prompts()  # prompts of their own: nothing of the batch's in the prefix cache
    model = config.model_dir
    ttft_s(sdk, model, online[-1:], args.ttft_output_len)  # the gateway's first streamed chat: not counted
    print("--- online TTFT, no batch", flush=True)
    idle = ttft_s(sdk, model, online[:count], args.ttft_output_len)
    lines = args.ttft_batch_lines or filler_lines(config)
    prompts = config.prompts()
    filler = [
        json.dumps({**json.loads(config.batch_lines([prompts[i % len(prompts)]])[0]), "custom_id": f"fill-{i}"})
        for i in range(lines)
    ]
    path = write_lines(Path(config.results_dir) / f"{config.run_id}-fill.jsonl", filler)
    batch = submit(sdk, path, "/v1/chat/completions")
    deadline = time.monotonic() + 120
    full = min(config.max_num_seqs - min(DEFAULT_ONLINE_RESERVE, config.max_num_seqs // 8), lines)  # the reserve
    while in_flight(metrics_port) < full and time.monotonic() < deadline:
        time.sleep(0.1)
    filled = in_flight(metrics_port)
    print(f"--- online TTFT, the worker running {filled:.0f} of the batch's requests", flush=True)
    busy = ttft_s(sdk, model, online[count : 2 * count], args.ttft_output_len)
    during = sdk.batches.retrieve(batch.id)
    with contextlib.suppress(openai.APIError):
        sdk.batches.cancel(batch.id)
    with contextlib.suppress(SystemExit):
        wait_final(sdk, batch.id, args.poll_s, timeout_s=300)
    return {
        "idle_s": idle,
        "busy_s": busy,
        "in_flight_at_start": filled,
        "batch_status_after": during.status,
        "batch_done_after": done_count(during),
        "batch_lines": lines,
    }


def run_memory(args: argparse.Namespace, run_id: str, results_dir: Path) -> list[dict[str, Any]]:
    """Each file size through a fresh gateway (same Redis and scripted worker): its RSS."""
    rows = []
    with tempfile.TemporaryDirectory() as scratch_dir:
        scratch = Path(scratch_dir)
        with scripted_servers(results_dir, f"{run_id}-memory", 2000, _extra(args.worker_args)) as servers:
            for count in int_list(args.memory_lines):
                path = write_lines(
                    scratch / f"memory-{count}.jsonl",
                    completion_lines(count, args.memory_tokens, args.memory_line_bytes, prefix=f"m{count}"),
                )
                log = results_dir / f"{run_id}-memory-{count}-gateway.log"
                gateway = start_gateway(servers, log, scratch / "files", _extra(args.gateway_args))
                sdk = sdk_of(gateway)
                pid = gateway.process.pid
                warm_up = write_lines(scratch / "warm-up.jsonl", completion_lines(10, 1, 200, prefix=f"w{count}"))
                run_api_batch(sdk, warm_up, args.poll_s, endpoint="/v1/completions")  # its first batch: imports
                time.sleep(1.0)
                before = rss_kib(pid)
                print(f"--- memory: {count:,} lines ({path.stat().st_size / 2**20:,.0f} MiB)", flush=True)
                sampler = RssSampler(pid).start()
                result = run_api_batch(sdk, path, args.poll_s, endpoint="/v1/completions")
                peak = sampler.stop()
                time.sleep(2.0)
                after = rss_kib(pid)
                rows.append(
                    {
                        "lines": count,
                        "file_bytes": path.stat().st_size,
                        "before_kib": before,
                        "peak_kib": peak,
                        "after_kib": after,
                        "answered": len(result["texts"]),
                        "failed": result["failed"],
                        "wall_s": result["wall_s"],
                    }
                )
                print(f"    RSS {before / 1024:.0f} -> peak {peak / 1024:.0f} -> {after / 1024:.0f} MiB", flush=True)
                gateway.stop()
                path.unlink()
    return rows


def run_takeover(args: argparse.Namespace, run_id: str, results_dir: Path) -> dict[str, Any]:
    """Gateway A runs a batch; B joins; A is SIGKILLed: until the counts move, read via B."""
    with tempfile.TemporaryDirectory() as scratch_dir:
        scratch = Path(scratch_dir)
        path = write_lines(
            scratch / "takeover.jsonl",
            completion_lines(args.takeover_lines, args.takeover_tokens, 200, prefix="t"),
        )
        with scripted_servers(
            results_dir, f"{run_id}-takeover", args.scripted_tokens_per_s, _extra(args.worker_args)
        ) as servers:
            files = scratch / "files"
            a = start_gateway(servers, results_dir / f"{run_id}-takeover-a.log", files, _extra(args.gateway_args))
            sdk_a = sdk_of(a)
            batch = submit(sdk_a, path, "/v1/completions")
            print(f"--- takeover: {args.takeover_lines} lines on gateway A", flush=True)
            deadline = time.monotonic() + 120
            while done_count(sdk_a.batches.retrieve(batch.id)) == 0:
                if time.monotonic() > deadline:
                    raise SystemExit("the takeover batch did not start within 120 s")
                time.sleep(0.1)
            b = start_gateway(servers, results_dir / f"{run_id}-takeover-b.log", files, _extra(args.gateway_args))
            sdk_b = sdk_of(b)
            admin = redis.Redis.from_url(servers.redis.url)
            lease_key = names.batch_lease_key(batch.id)
            lease_before = admin.get(lease_key)
            before_kill = sdk_b.batches.retrieve(batch.id)
            if before_kill.status in FINAL_STATES or done_count(before_kill) >= args.takeover_lines:
                raise SystemExit("the takeover batch ended before the kill: give it more lines or tokens")
            os.killpg(a.process.pid, signal.SIGKILL)
            killed_at = time.perf_counter()
            a.process.wait()
            time.sleep(0.1)  # what A sent before it died, Redis has run by now
            at_kill = done_count(sdk_b.batches.retrieve(batch.id))
            lease_s = resumed_s = None
            deadline = time.monotonic() + 120
            while resumed_s is None and time.monotonic() < deadline:
                now = time.perf_counter() - killed_at
                if lease_s is None and admin.get(lease_key) not in (None, lease_before):
                    lease_s = now
                if done_count(sdk_b.batches.retrieve(batch.id)) > at_kill:
                    resumed_s = now
                time.sleep(0.05)
            admin.close()
            final = wait_final(sdk_b, batch.id, args.poll_s)
            answers: Counter[str] = Counter()
            if final.output_file_id:
                for raw in sdk_b.files.content(final.output_file_id).content.splitlines():
                    answers[json.loads(raw)["custom_id"]] += 1
            if final.error_file_id:
                for raw in sdk_b.files.content(final.error_file_id).content.splitlines():
                    answers[json.loads(raw)["custom_id"]] += 1
    result = {
        "lines": args.takeover_lines,
        "done_at_kill": at_kill,
        "lease_taken_s": lease_s,
        "resumed_s": resumed_s,
        "final_status": final.status,
        "answered": len(answers),
        "answered_twice": sum(1 for n in answers.values() if n > 1),
        "missing": args.takeover_lines - len(answers),
    }
    print(f"    moved again {resumed_s} s after the kill; {result}", flush=True)
    return result


# --- the report ---------------------------------------------------------------------------


def int_list(text: str) -> list[int]:
    return [int(part) for part in text.split(",") if part.strip()]


def _rate(result: dict[str, Any]) -> float:
    return float(result["tokens"]) / float(result["wall_s"])


def _p50_ms(seconds: list[float]) -> float:
    return 1000 * statistics.median(seconds)


def _mib(kib: float) -> str:
    return f"{kib / 1024:,.0f}"


def report(config: BatchBenchConfig, results: dict[str, Any]) -> str:
    """The figures, then the ratios beside their goals, as markdown."""
    lines = [
        f"Batch API bench {config.run_id}: {config.num_prompts} chat lines x {config.output_len} tokens "
        f"(input {config.input_len}), greedy, engine flags: {' '.join(config.engine_flags()[2:])}",
        "",
    ]
    ratios: list[tuple[str, str, str]] = []
    rounds: list[dict[str, Any]] = results.get("rounds", [])
    offline_result = results.get("offline")
    if offline_result or rounds:
        reference = (offline_result or {}).get("texts", {})
        lines += [
            "| round | path | tok/s | wall s | ÷ offline | texts equal to offline |",
            "|---|---|---:|---:|---:|---:|",
        ]
        numbered = [("-", "offline", offline_result)] if offline_result else []
        numbered += [(str(n), key, r[key]) for n, r in enumerate(rounds, start=1) for key, _ in _PATH_NAMES if key in r]
        for number, key, result in numbered:
            offline = f"{_rate(result) / _rate(offline_result):.3f}" if offline_result else "-"
            equal = sum(result["texts"].get(k) == v for k, v in reference.items())
            lines.append(
                f"| {number} | {dict(_PATH_NAMES)[key]} | {_rate(result):,.0f} | {result['wall_s']:.2f} | {offline} "
                f"| {equal}/{len(reference)} |"
            )
        lines.append("")
        stages = [r["api"]["stages"] for r in rounds if "stages" in r.get("api", {})]
        if stages:
            lines += [
                "`/v1/batches` by the batch's own timestamps (whole seconds), each round: "
                + "; ".join(", ".join(f"{k.removesuffix('_s')} {v} s" for k, v in one.items()) for one in stages),
                "",
            ]
        apis = [r for r in rounds if "api" in r]
        if apis and all("streamq_batch" in r for r in apis):
            values = "; ".join(f"{_rate(r['api']) / _rate(r['streamq_batch']):.3f}" for r in apis)
            ratios.append(("`/v1/batches` tok/s ÷ `streamq batch`", GOALS["api_vs_streamq_batch"], values))
        if apis and offline_result:
            values = "; ".join(f"{_rate(r['api']) / _rate(offline_result):.3f}" for r in apis)
            ratios.append(("`/v1/batches` tok/s ÷ offline `LLM.chat`", GOALS["api_vs_offline"], values))
    if "ttft" in results:
        ttft = results["ttft"]
        idle, busy = _p50_ms(ttft["idle_s"]), _p50_ms(ttft["busy_s"])
        lines += [
            f"Online TTFT p50 over {len(ttft['idle_s'])} streamed chats: {idle:.0f} ms with no batch, {busy:.0f} ms "
            f"while a batch of {ttft['batch_lines']} lines ran ({ttft['in_flight_at_start']:.0f} of its requests "
            f"in flight at the start; after the last one it was {ttft['batch_status_after']} with "
            f"{ttft['batch_done_after']} done)",
            "",
        ]
        measured = f"{busy / idle:.2f}"
        if ttft["batch_status_after"] in FINAL_STATES:
            measured += " (not valid: the batch ended before the last online request; give it more lines)"
        ratios.append(("online chat TTFT p50, batch running ÷ none", GOALS["ttft_ratio"], measured))
    if "memory" in results:
        lines += [
            "| lines | file MiB | gateway RSS before MiB | peak MiB | after MiB | answered | failed | wall s |",
            "|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for row in results["memory"]:
            lines.append(
                f"| {row['lines']:,} | {row['file_bytes'] / 2**20:,.0f} | {_mib(row['before_kib'])} "
                f"| {_mib(row['peak_kib'])} | {_mib(row['after_kib'])} | {row['answered']:,} | {row['failed']} "
                f"| {row['wall_s']:.1f} |"
            )
        lines.append("")
        peaks = ", ".join(
            f"{_mib(r['peak_kib'] - r['before_kib'])} MiB at {r['lines']:,} lines" for r in results["memory"]
        )
        ratios.append(("gateway peak RSS above its start through the file", GOALS["gateway_memory"], peaks))
    if "takeover" in results:
        t = results["takeover"]
        resumed = "never (within 120 s)" if t["resumed_s"] is None else f"{t['resumed_s']:.2f} s"
        lease = "-" if t["lease_taken_s"] is None else f"{t['lease_taken_s']:.2f} s"
        lines += [
            f"Takeover: {t['lines']} lines, {t['done_at_kill']} done when gateway A was SIGKILLed; the lease taken "
            f"after {lease}, the counts moved after {resumed}; the batch ended {t['final_status']}: "
            f"{t['answered']} custom_ids answered, {t['answered_twice']} twice, {t['missing']} missing",
            "",
        ]
        ratios.append(("a gateway SIGKILLed mid-batch: until the batch moves again", GOALS["takeover_s"], resumed))
    lines += ["| figure | goal | measured |", "|---|---|---|"]
    lines += [f"| {name} | {goal} | {value} |" for name, goal, value in ratios]
    return "\n".join(lines)


_PATH_NAMES = (("offline", "offline `LLM.chat`"), ("streamq_batch", "`streamq batch`"), ("api", "`/v1/batches`"))


def make_config(args: argparse.Namespace, run_id: str) -> BatchBenchConfig:
    return BatchBenchConfig(
        model_dir=str(args.model_dir),
        num_prompts=args.num_prompts,
        input_len=args.input_len,
        output_len=args.output_len,
        max_num_seqs=args.max_num_seqs,
        seed=args.seed,
        results_dir=str(args.results_dir),
        run_id=run_id,
    )


def chosen_parts(text: str) -> list[str]:
    parts = [p.strip() for p in text.split(",") if p.strip()]
    unknown = sorted(set(parts) - set(PARTS))
    if unknown:
        raise SystemExit(f"unknown parts: {', '.join(unknown)} (choose from {', '.join(PARTS)})")
    return parts


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    parts = chosen_parts(args.parts)
    os.chdir(ROOT)
    args.results_dir.mkdir(parents=True, exist_ok=True)
    run_id = "batch-api-" + datetime.now().strftime("%Y%m%d-%H%M%S")
    config = make_config(args, run_id)
    results: dict[str, Any] = {}
    if {"throughput", "ttft"} & set(parts):
        if not (args.model_dir / "config.json").exists():
            build_tiny_model(args.model_dir)
        config.save(args.results_dir / f"{run_id}-config.json")
        prompts = config.prompts()
        write_lines(args.results_dir / f"{run_id}-batch.jsonl", config.batch_lines(prompts))
        write_lines(args.results_dir / f"{run_id}-warm-up.jsonl", config.batch_lines(prompts[:WARM_UP_LINES]))
        results |= run_throughput_and_ttft(args, config, parts)
    if "memory" in parts:
        results["memory"] = run_memory(args, run_id, args.results_dir)
    if "takeover" in parts:
        results["takeover"] = run_takeover(args, run_id, args.results_dir)
    text = report(config, results)
    (args.results_dir / f"{run_id}.md").write_text(text + "\n")
    for done in results.get("rounds", []):
        for path in done.values():
            path.pop("texts", None)
    compact = {
        k: ({kk: vv for kk, vv in v.items() if kk != "texts"} if isinstance(v, dict) else v) for k, v in results.items()
    }
    (args.results_dir / f"{run_id}.json").write_text(json.dumps({"args": _jsonable(vars(args)), **compact}, indent=1))
    print(text)


def _jsonable(values: dict[str, Any]) -> dict[str, Any]:
    return {k: str(v) if isinstance(v, Path) else v for k, v in values.items()}


if __name__ == "__main__":
    main()
