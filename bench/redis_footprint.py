"""``python -m bench.redis_footprint``: the bytes of Redis a finished request keeps, by key
family, for the deployment's default retention: what sizes a Redis (docs/operations/redis.md).

Two kinds of request, each through a fresh Redis (its own session, as deployed), a scripted
worker with the defaults (``devkit.worker_process.scripted_worker``: the model does not change
what Redis keeps) and the producer library in this process:

- ``batch line``: ``--short-requests`` completions of ``--short-tokens`` (16) tokens that
  nobody streams (``stream=False``, as ``streamq batch`` sends each line);
- ``streamed``: ``--long-requests`` completions of ``--long-tokens`` (1,000) tokens, streamed.

Once every request has ended (and the worker's bookkeeping has settled), each key is weighed
with ``MEMORY USAGE`` (``SAMPLES 0``: every element), its name's request id replaced by
``<id>`` to group it, and Redis's ``used_memory`` is read before and after; both are divided
by the requests.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import tempfile
from collections import defaultdict
from pathlib import Path

import redis.asyncio as aioredis

from devkit.redis_server import RedisServer
from devkit.worker_process import scripted_worker
from producer.client import StreamqClient

ID = re.compile(rb"[0-9a-f]{32}")


async def weigh(url: str, requests: int) -> tuple[dict[str, float], float]:
    """Bytes per request by key family (keys naming no request are left out), and all of it."""
    redis = aioredis.Redis.from_url(url)
    try:
        families: dict[str, int] = defaultdict(int)
        async for key in redis.scan_iter(count=1000):
            if ID.search(key):
                size = await redis.memory_usage(key, samples=0) or 0
                families[ID.sub(b"<id>", key).decode()] += size
        per_request = {family: size / requests for family, size in sorted(families.items())}
        return per_request, sum(families.values()) / requests
    finally:
        await redis.aclose()


async def footprint(kind: str, requests: int, tokens: int, *, stream: bool) -> None:
    with RedisServer() as server, tempfile.TemporaryDirectory() as scratch:
        worker = scripted_worker(server.url, Path(scratch) / "worker.log", tokens_per_s=20_000)
        worker.start().wait_ready(timeout_s=120)
        try:
            admin = aioredis.Redis.from_url(server.url)
            before = int((await admin.info("memory"))["used_memory"])
            async with await StreamqClient.connect(server.url) as client:
                if stream:  # a subscriber reads every chunk
                    handles = [
                        await client.submit(f"request {i}", max_tokens=tokens, ignore_eos=True) for i in range(requests)
                    ]
                    for handle in handles:
                        assert (await handle.result()).completion_tokens == tokens
                        await handle.close()
                else:  # as ``streamq batch`` runs its lines
                    prompts = [f"request {i}" for i in range(requests)]
                    async for completion in client.generate_many(prompts, max_tokens=tokens, ignore_eos=True):
                        assert completion.completion_tokens == tokens
            await asyncio.sleep(2)  # the acknowledgements and lease releases of the last ones
            after = int((await admin.info("memory"))["used_memory"])
            await admin.aclose()
            per_request, total = await weigh(server.url, requests)
        finally:
            worker.stop()
    print(f"\n{kind}: {requests} requests of {tokens} tokens, {'streamed' if stream else 'not streamed'}")
    print(f"  {'key family':<40} {'bytes per request':>18}")
    for family, size in per_request.items():
        print(f"  {family:<40} {size:>18,.0f}")
    print(f"  {'all keys naming the request':<40} {total:>18,.0f}")
    print(f"  {'used_memory after - before':<40} {(after - before) / requests:>18,.0f}")


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.redis_footprint", description=__doc__)
    parser.add_argument("--short-requests", type=int, default=500)
    parser.add_argument("--short-tokens", type=int, default=16)
    parser.add_argument("--long-requests", type=int, default=50)
    parser.add_argument("--long-tokens", type=int, default=1000)
    args = parser.parse_args()
    asyncio.run(footprint("batch line", args.short_requests, args.short_tokens, stream=False))
    asyncio.run(footprint("streamed", args.long_requests, args.long_tokens, stream=True))


if __name__ == "__main__":
    main()
