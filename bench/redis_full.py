"""``python -m bench.redis_full``: a batch against a Redis that fills mid-batch, for real.

Redis (its own session, as deployed) with ``maxmemory-policy noeviction`` and a limit
``--budget-bytes`` above what it holds once a worker and a gateway run: the batch's own
requests fill it (their keys for the default retention: docs/operations/redis.md). A scripted
worker (the model does not change what Redis does) runs with default flags. Two runs of
``--lines`` 16-token completions, each on a fresh Redis:

- ``streamq batch``, 8 in flight: once it says Redis is full, memory is freed (``maxmemory
  0``), the batch ends, and a rerun does what is left;
- the gateway, 8 clients each sending its share one after the other: a request is answered
  (200) or refused (503 ``redis_full``); once 20 are refused, memory is freed and the refused
  ones are sent again.

Printed: lines answered in each run, refused, answered twice, missing; whether anything of a
refused request was stored; whether the worker stayed alive throughout, and what its
``/ready`` answered while Redis was full.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import tempfile
import urllib.error
import urllib.request
import uuid
from collections import Counter
from pathlib import Path

import httpx
import redis.asyncio as aioredis

from devkit.gateway_process import GatewayProcess
from devkit.redis_server import RedisServer, free_port
from devkit.worker_process import SCRIPTED_MODEL, WorkerProcess, scripted_worker

REFUSALS_BEFORE_FREEING = 20


def ready_status(worker: WorkerProcess) -> int:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{worker.metrics_port}/ready", timeout=5) as response:
            return int(response.status)
    except urllib.error.HTTPError as error:
        return error.code


class Watch:
    """Whether the worker process stayed alive, sampled every 50 ms."""

    def __init__(self, worker: WorkerProcess) -> None:
        self.worker, self.died = worker, False
        self._task = asyncio.ensure_future(self._run())

    async def _run(self) -> None:
        while True:
            assert self.worker.process is not None
            self.died |= self.worker.process.poll() is not None
            await asyncio.sleep(0.05)

    def stop(self) -> str:
        self._task.cancel()
        return "no: it died" if self.died else "yes"


async def fill(admin: aioredis.Redis, budget: int) -> None:
    await admin.config_set("maxmemory-policy", "noeviction")
    used = int((await admin.info("memory"))["used_memory"])
    await admin.config_set("maxmemory", used + budget)


def answered(out_path: Path) -> list[str]:
    if not out_path.exists():
        return []
    return [json.loads(line)["custom_id"] for line in out_path.read_text().splitlines()]


async def through_batch(lines: int, tokens: int, budget: int) -> None:
    with RedisServer() as server, tempfile.TemporaryDirectory() as scratch_dir:
        scratch = Path(scratch_dir)
        worker = scripted_worker(server.url, scratch / "worker.log", tokens_per_s=2000, metrics_port=free_port())
        worker.start().wait_ready(timeout_s=120)
        admin = aioredis.Redis.from_url(server.url)
        in_path, out_path, err_path = scratch / "in.jsonl", scratch / "out.jsonl", scratch / "batch.err"
        body = {"model": SCRIPTED_MODEL, "max_tokens": tokens}
        rows = [
            {"custom_id": f"c{i}", "method": "POST", "url": "/v1/completions", "body": {**body, "prompt": f"p{i}"}}
            for i in range(lines)
        ]
        in_path.write_text("".join(json.dumps(row) + "\n" for row in rows))
        command = [sys.executable, "-m", "producer", "batch", str(in_path), str(out_path), "--no-progress"]
        command += ["--redis-url", server.url, "--max-in-flight", "8"]
        watch = Watch(worker)
        try:
            await fill(admin, budget)
            with err_path.open("w") as err:
                batch = subprocess.Popen(command, stdout=err, stderr=subprocess.STDOUT, text=True)
            while "Redis is full" not in err_path.read_text() and batch.poll() is None:
                await asyncio.sleep(0.05)
            at_full = len(answered(out_path))
            ready_when_full = await asyncio.to_thread(ready_status, worker)
            await admin.config_set("maxmemory", 0)
            status = await asyncio.to_thread(batch.wait, 600)
            first = answered(out_path)
            rerun = await asyncio.to_thread(subprocess.run, command, capture_output=True, text=True, timeout=600)
            counts = Counter(answered(out_path))
            alive = watch.stop()
        finally:
            await admin.aclose()
            worker.stop()
    print(f"\nstreamq batch: {lines} lines of {tokens} tokens, Redis limit {budget:,} bytes above its start")
    print(f"  'Redis is full' said with {at_full} lines answered; the worker's /ready then: {ready_when_full}")
    print(f"  first run: exit {status}, {len(first)} lines answered, {lines - len(first)} left for the rerun")
    print(f"  rerun: exit {rerun.returncode}, {len(counts) - len(set(first))} lines answered")
    twice = sum(1 for n in counts.values() if n > 1)
    print(f"  every line: {len(counts)} answered, {twice} answered twice, {lines - len(counts)} missing")
    print(f"  worker alive throughout: {alive}")


async def through_gateway(lines: int, tokens: int, budget: int) -> None:
    with RedisServer() as server, tempfile.TemporaryDirectory() as scratch_dir:
        scratch = Path(scratch_dir)
        worker = scripted_worker(server.url, scratch / "worker.log", tokens_per_s=2000, metrics_port=free_port())
        worker.start().wait_ready(timeout_s=120)
        gateway = GatewayProcess(server.url, scratch / "gateway.log").wait_ready()
        admin = aioredis.Redis.from_url(server.url)
        ids = [f"fill-{i}-{uuid.uuid4().hex[:8]}" for i in range(lines)]
        ok: Counter[str] = Counter()
        refused: list[str] = []
        stored: list[str] = []
        ready_when_full = 0
        watch = Watch(worker)
        try:
            await fill(admin, budget)
            async with httpx.AsyncClient(base_url=gateway.url, timeout=600) as http:

                async def send(request_id: str) -> None:
                    request = {"model": SCRIPTED_MODEL, "prompt": request_id, "max_tokens": tokens}
                    headers = {"x-streamq-request-id": request_id}
                    response = await http.post("/v1/completions", json=request, headers=headers)
                    if response.status_code == 503 and response.json()["error"]["code"] == "redis_full":
                        refused.append(request_id)
                    else:
                        response.raise_for_status()
                        ok[request_id] += 1

                async def client(mine: list[str]) -> None:
                    for request_id in mine:
                        await send(request_id)

                async def free_once_refused() -> None:
                    nonlocal ready_when_full
                    while len(refused) < REFUSALS_BEFORE_FREEING:
                        await asyncio.sleep(0.05)
                    ready_when_full = await asyncio.to_thread(ready_status, worker)
                    for request_id in refused:
                        if await admin.exists(f"arq:job:{request_id}", f"streamq:events:{request_id}"):
                            stored.append(request_id)
                    await admin.config_set("maxmemory", 0)

                freeing = asyncio.ensure_future(free_once_refused())
                await asyncio.gather(*(client(ids[i::8]) for i in range(8)))
                first_ok, first_refused = len(ok), len(refused)
                if refused:
                    await freeing
                else:
                    freeing.cancel()
                for request_id in list(refused):
                    await send(request_id)
            alive = watch.stop()
        finally:
            await admin.aclose()
            gateway.stop()
            worker.stop()
    print(f"\ngateway: {lines} requests of {tokens} tokens, 8 clients, Redis limit {budget:,} bytes above its start")
    print(f"  first pass: {first_ok} answered (200), {first_refused} refused (503 redis_full)")
    print(f"  refused requests with anything stored: {len(stored)}; the worker's /ready then: {ready_when_full}")
    twice = sum(1 for n in ok.values() if n > 1)
    print(f"  refused ones sent again once memory was freed: every prompt {len(ok)} answered, {twice} twice")
    print(f"  worker alive throughout: {alive}")


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.redis_full", description=__doc__)
    parser.add_argument("--lines", type=int, default=3000)
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--budget-bytes", type=int, default=1_700_000, help="about 1,000 finished lines' keys")
    args = parser.parse_args()
    asyncio.run(through_batch(args.lines, args.tokens, args.budget_bytes))
    asyncio.run(through_gateway(args.lines, args.tokens, args.budget_bytes))


if __name__ == "__main__":
    main()
