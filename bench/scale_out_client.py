"""One subscriber process of the scale-out run: keeps requests in flight, counts tokens.

The producer library in a closed loop: ``--concurrency`` slots, each submitting its next
request when the previous one ends (starts spread over ``--stagger`` seconds). The chunk
events and the tokens they carry (a worker may merge several tokens into one event) received
inside the shared measurement window, and each submit's time to first chunk, go to ``--out``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from producer.client import StreamqClient
from streamq.protocol import ChunkEvent, ErrorEvent


@dataclass
class ClientCounts:
    events_in_window: int = 0  # chunk events
    tokens_in_window: int = 0  # the token ids those events carry
    requests_completed: int = 0
    errors: int = 0
    ttft_s: list[float] = field(default_factory=list)  # submit to first chunk, requests sent in the window


async def run_slot(
    client: StreamqClient,
    output_len: int,
    delay_s: float,
    end: float,
    counts: ClientCounts,
    window: tuple[float, float],
) -> None:
    await asyncio.sleep(delay_s)
    while time.time() < end:
        sent = time.time()
        first = True
        handle = await client.submit("scale-out", max_tokens=output_len)
        async for event in handle:
            if isinstance(event, ChunkEvent):
                now = time.time()
                if first and window[0] <= sent:
                    counts.ttft_s.append(now - sent)
                first = False
                if window[0] <= now < window[1]:
                    counts.events_in_window += 1
                    counts.tokens_in_window += len(event.token_ids)
            elif isinstance(event, ErrorEvent):
                counts.errors += 1
        counts.requests_completed += 1


async def run(args: argparse.Namespace) -> ClientCounts:
    counts = ClientCounts()
    window = (args.start_at + args.warmup, args.start_at + args.warmup + args.measure)
    async with await StreamqClient.connect(args.redis_url) as client:
        await asyncio.sleep(max(0.0, args.start_at - time.time()))
        slots = [
            asyncio.create_task(
                run_slot(client, args.output_len, args.stagger * i / args.concurrency, window[1], counts, window)
            )
            for i in range(args.concurrency)
        ]
        await asyncio.sleep(max(0.0, window[1] - time.time()))
        for slot in slots:
            slot.cancel()
        results = await asyncio.gather(*slots, return_exceptions=True)
        failures = [r for r in results if isinstance(r, Exception) and not isinstance(r, asyncio.CancelledError)]
        counts.errors += len(failures)
        for failure in failures[:3]:
            print(f"slot failed: {failure!r}", flush=True)
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--redis-url", required=True)
    parser.add_argument("--concurrency", type=int, required=True)
    parser.add_argument("--output-len", type=int, required=True)
    parser.add_argument("--start-at", type=float, required=True, help="wall-clock time (time.time()) to start")
    parser.add_argument("--stagger", type=float, required=True)
    parser.add_argument("--warmup", type=float, required=True)
    parser.add_argument("--measure", type=float, required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    args.out.write_text(json.dumps(asdict(asyncio.run(run(args)))))


if __name__ == "__main__":
    main()
