"""Prefix-aware pickup: multi-turn chats on two real workers, affinity on against off.

``python -m bench.affinity`` starts one Redis and ``--workers`` (2) ``python -m worker``
processes on the tiny random Llama (real vLLM CPU engine, prefix caching on: vLLM's default),
each serving ``/metrics`` on a port of its own. It then runs the same workload twice on those
workers, prefix-aware pickup on (the client's default) and off (``affinity=False`` on every
submit), with fresh texts each time, so the second run gets nothing cached by the first:
``--conversations`` (8) chats at once, ``--turns`` (5) turns each, ``--rounds`` (4) times per
mode, the modes taking turns to go first. Every conversation opens
with a system message shared by all of the run's conversations (the few-shot part,
``--shared-chars``) and a long system message of its own (``--system-chars``); each turn sends
the whole conversation, then appends the reply the worker wrote (as the assistant message) and
a new user message (``--user-chars``). ``max_tokens`` is ``--max-tokens`` with ``ignore_eos``,
temperature 0, so turns are comparable.

Per mode it reports the follow-ups' (turns 2 and later) time from submit to first chunk at the
client (p50, p90), how often a follow-up ran on the worker of its conversation's previous turn
(``FinalEvent.worker``), vLLM's prefix-cache hit rate (the deltas of
``vllm:prefix_cache_hits`` over ``vllm:prefix_cache_queries``, tokens, both workers summed),
the workers' ``streamq_affinity_hits/misses/expired`` deltas, and completion tokens over the
mode's wall time; then off/on of the TTFT p50 and on/off of tok/s, beside the goals that make
pickup by prefix worth its cost (``TARGET_*``: most follow-ups on their worker, a clearly faster
first token, no throughput lost).
Writes ``bench/results/<run>-affinity.json`` and ``.md``; worker logs land beside them.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shlex
import subprocess
import sys
import time
import urllib.request
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np
import redis.asyncio as aioredis
from prometheus_client.parser import text_string_to_metric_families

from bench.config import ENGINE_FLAGS_ENV, SERVE_MAX_NUM_BATCHED_TOKENS
from bench.scale_out import READY_LINE, wait_logged
from devkit.redis_server import RedisServer, free_ports
from devkit.tiny_model import build_tiny_model
from devkit.worker_process import WorkerProcess, tiny_engine_flags, worker_env
from producer.client import StreamqClient
from streamq.protocol import ChunkEvent, ErrorEvent, FinalEvent
from streamq.protocol.names import AFFINITY_WINDOW_MS, RESULT_KEY_PREFIX

ROOT = Path(__file__).resolve().parent.parent
MODEL_DIR = ROOT / ".cache" / "tiny-llama-8k"
"""The benchmark's tiny model (same weights and byte-level tokenizer, ``build_tiny_model``'s
defaults) with 8,192 positions instead of 1,024: the tokenizer makes about one token of 1.3
characters of these texts, so a conversation of the default sizes runs to about 6,000 tokens."""
MAX_POSITIONS = 8192
BIND_ENV = "VLLM_CPU_OMP_THREADS_BIND"

COUNTERS = {
    "queries": "vllm:prefix_cache_queries",
    "hits": "vllm:prefix_cache_hits",
    "affinity_hits": "streamq_affinity_hits",
    "affinity_misses": "streamq_affinity_misses",
    "affinity_expired": "streamq_affinity_expired",
}
"""What is scraped from each worker's ``/metrics``: the counter families (their ``_total``
samples, summed over label sets), by the name this module gives them."""
ENGINE_HISTOGRAMS = {
    "engine_ttft": "vllm:time_to_first_token_seconds",
    "engine_waiting": "vllm:request_queue_time_seconds",
    "engine_prefill": "vllm:request_prefill_time_seconds",
}
"""vLLM's own per-request timings (histograms: their ``_sum`` and ``_count`` are scraped as
``<name>_sum`` and ``<name>_count``): first token from the request's arrival at the engine,
time in the engine's waiting queue, and prefill, so that a follow-up's time at the client
splits into the engine's part and the queue path's (the rest)."""
SCRAPED = [*COUNTERS, *(f"{name}_{part}" for name in ENGINE_HISTOGRAMS for part in ("sum", "count"))]

TARGET_SAME_WORKER = 0.90
TARGET_TTFT_RATIO = 1.5
TARGET_TOK_S_RATIO = 0.98

_WORD_LIST = (
    "river stone lantern harbor meadow copper violet thunder garden winter ladder orchard silver canyon "
    "pocket window market candle forest island marble anchor feather glacier compass saddle pepper velvet "
    "tunnel cobalt falcon timber kettle mirror basket quartz heron bridge cotton desert pillow rocket "
    "shadow walnut cradle engine fabric goblet hollow jungle kennel lemon magnet needle oyster parrot quiver "
    "ribbon summit tavern umbrella valley wagon yarrow zephyr amber blossom cinder dune ember fjord grove"
)
_WORDS = _WORD_LIST.split()


# --- the workload ---------------------------------------------------------------------------


def words(rng: random.Random, chars: int) -> str:
    """Random words from a fixed list, at least ``chars`` characters in all."""
    out: list[str] = []
    length = -1
    while length < chars:
        word = rng.choice(_WORDS)
        out.append(word)
        length += len(word) + 1
    return " ".join(out)


@dataclass(frozen=True)
class Workload:
    """One mode's conversations: sizes in characters, and a seed that makes its texts."""

    conversations: int = 8
    turns: int = 5
    shared_chars: int = 1000
    system_chars: int = 6000
    user_chars: int = 200
    max_tokens: int = 32
    seed: int = 0


@dataclass
class Conversation:
    """A chat that grows by turns: its messages so far, ending with a user message, and the
    user messages still to come."""

    index: int
    messages: list[dict[str, str]]
    pending: list[str]

    def add_turn(self, reply: str) -> None:
        """The reply to the last user message, then the next user message."""
        self.messages.append({"role": "assistant", "content": reply})
        self.messages.append({"role": "user", "content": self.pending.pop(0)})


def build_conversations(workload: Workload, tag: str) -> list[Conversation]:
    """``workload.conversations`` chats whose texts depend on ``tag`` (the mode) and the seed:
    a system message the mode's conversations share (its start names the mode, so no two
    modes share a cached block), a system message of each conversation's own and the first
    user message; the later user messages wait in ``pending``."""
    rng = random.Random(f"{workload.seed}:{tag}")
    shared = f"Run {tag}. You answer in the style of these examples. " + words(rng, workload.shared_chars)
    shared = shared[: workload.shared_chars]
    conversations = []
    for i in range(workload.conversations):
        system = f"Conversation {tag}-{i}. Background for this user: " + words(rng, workload.system_chars)
        users = [f"Question {k + 1}: " + words(rng, workload.user_chars) for k in range(workload.turns)]
        messages = [
            {"role": "system", "content": shared},
            {"role": "system", "content": system[: workload.system_chars]},
            {"role": "user", "content": users[0][: workload.user_chars]},
        ]
        conversations.append(Conversation(i, messages, [u[: workload.user_chars] for u in users[1:]]))
    return conversations


@dataclass(frozen=True)
class Turn:
    """One request of a conversation, as the client saw it."""

    conversation: int
    turn: int  # 1 = the conversation's first request
    ttft_s: float  # submit to first chunk event
    worker: str | None  # FinalEvent.worker
    prompt_tokens: int
    completion_tokens: int
    request_id: str = ""
    queue_wait_s: float | None = None
    """From its enqueue to its start on a worker (arq's result: ``st - et``, one machine's clock)."""


async def run_conversation(
    client: StreamqClient, conversation: Conversation, turns: int, max_tokens: int, affinity: bool
) -> list[Turn]:
    """Send the conversation's turns one after the other, each as soon as the previous ended."""
    out = []
    for k in range(1, turns + 1):
        started = time.perf_counter()
        handle = await client.submit(
            messages=conversation.messages, max_tokens=max_tokens, ignore_eos=True, temperature=0, affinity=affinity
        )
        first: float | None = None
        text: list[str] = []
        async for event in handle:
            if isinstance(event, ChunkEvent):
                first = time.perf_counter() if first is None else first
                text.append(event.text)
            elif isinstance(event, FinalEvent):
                assert first is not None, "a final event before any chunk"
                out.append(
                    Turn(
                        conversation.index,
                        k,
                        first - started,
                        event.worker,
                        event.prompt_tokens,
                        event.completion_tokens,
                        handle.request_id,
                    )
                )
            elif isinstance(event, ErrorEvent):
                raise RuntimeError(f"conversation {conversation.index} turn {k} failed: {event.code}: {event.message}")
        if k < turns:
            conversation.add_turn("".join(text))
    return out


# --- the figures ----------------------------------------------------------------------------


def scrape(port: int) -> dict[str, float]:
    """The ``COUNTERS`` of the worker serving ``/metrics`` on ``port``."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        return counters(response.read().decode())


def counters(text: str) -> dict[str, float]:
    """The ``COUNTERS`` and ``ENGINE_HISTOGRAMS`` in a Prometheus text exposition, each summed
    over its label sets (0 when absent)."""
    totals = dict.fromkeys(SCRAPED, 0.0)
    short = {family: key for key, family in COUNTERS.items()}
    histograms = {family: key for key, family in ENGINE_HISTOGRAMS.items()}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if family.name in short and sample.name == family.name + "_total":
                totals[short[family.name]] += sample.value
            elif family.name in histograms and sample.name in (family.name + "_sum", family.name + "_count"):
                totals[histograms[family.name] + sample.name.removeprefix(family.name)] += sample.value
    return totals


def delta(before: Sequence[Mapping[str, float]], after: Sequence[Mapping[str, float]]) -> dict[str, float]:
    """What the counters grew by, all workers summed."""
    return {key: sum(a[key] - b[key] for b, a in zip(before, after, strict=True)) for key in SCRAPED}


def percentile_ms(values: Sequence[float], q: float) -> float | None:
    """numpy's linear percentile of seconds, in ms (as ``bench.timing``); None for no values."""
    return 1000 * float(np.percentile(values, q)) if values else None


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    return None if numerator is None or not denominator else numerator / denominator


@dataclass
class ModeResult:
    """One mode's figures (``summarize``)."""

    mode: str  # "on" or "off"
    requests: int
    follow_ups: int
    first_ttft_p50_ms: float | None
    follow_up_ttft_p50_ms: float | None
    follow_up_ttft_p90_ms: float | None
    same_worker: int  # follow-ups on their previous turn's worker
    completion_tokens: int
    wall_s: float
    max_prompt_tokens: int
    counters: dict[str, float]  # the COUNTERS' deltas over the mode, all workers
    queue_wait_p50_ms: float | None = None
    queue_wait_max_ms: float | None = None
    requests_by_worker: dict[str, int] = field(default_factory=dict)
    ttft_mean_ms: float | None = None
    """At the client, all turns (to set beside the engine's)."""
    same_worker_ttft_p50_ms: float | None = None
    """Of the follow-ups on their previous turn's worker (held there, or there by chance)."""
    same_worker_queue_wait_p50_ms: float | None = None

    @property
    def same_worker_rate(self) -> float | None:
        return ratio(self.same_worker, self.follow_ups)

    @property
    def cache_hit_rate(self) -> float | None:
        return ratio(self.counters["hits"], self.counters["queries"])

    @property
    def tok_s(self) -> float:
        return self.completion_tokens / self.wall_s if self.wall_s else 0.0

    def engine_mean_ms(self, name: str) -> float | None:
        """The mean of one of ``ENGINE_HISTOGRAMS`` over the mode's requests (all turns)."""
        mean = ratio(self.counters.get(f"{name}_sum", 0.0), self.counters.get(f"{name}_count", 0.0))
        return None if mean is None else mean * 1000


def summarize(
    mode: str,
    turns: Iterable[Turn],
    wall_s: float,
    counter_deltas: Mapping[str, float],
    worker_ids: Sequence[str] = (),
) -> ModeResult:
    """A mode's figures from its turns; ``requests_by_worker`` lists ``worker_ids`` first, in
    that order, at 0 if they ran none."""
    rows = sorted(turns, key=lambda t: (t.conversation, t.turn))
    previous = {(t.conversation, t.turn): t.worker for t in rows}
    follow_ups = [t for t in rows if t.turn > 1]
    stayed = [t for t in follow_ups if t.worker is not None and previous.get((t.conversation, t.turn - 1)) == t.worker]
    firsts = [t.ttft_s for t in rows if t.turn == 1]
    later = [t.ttft_s for t in follow_ups]
    waits = [t.queue_wait_s for t in rows if t.queue_wait_s is not None]
    return ModeResult(
        mode=mode,
        requests=len(rows),
        follow_ups=len(follow_ups),
        first_ttft_p50_ms=percentile_ms(firsts, 50),
        follow_up_ttft_p50_ms=percentile_ms(later, 50),
        follow_up_ttft_p90_ms=percentile_ms(later, 90),
        same_worker=len(stayed),
        completion_tokens=sum(t.completion_tokens for t in rows),
        wall_s=wall_s,
        max_prompt_tokens=max((t.prompt_tokens for t in rows), default=0),
        counters=dict(counter_deltas),
        requests_by_worker=dict.fromkeys(worker_ids, 0) | dict(Counter(t.worker or "?" for t in rows)),
        queue_wait_p50_ms=percentile_ms(waits, 50),
        queue_wait_max_ms=percentile_ms(waits, 100),
        ttft_mean_ms=1000 * float(np.mean([t.ttft_s for t in rows])) if rows else None,
        same_worker_ttft_p50_ms=percentile_ms([t.ttft_s for t in stayed], 50),
        same_worker_queue_wait_p50_ms=percentile_ms([t.queue_wait_s for t in stayed if t.queue_wait_s is not None], 50),
    )


def _ms(value: float | None) -> str:
    return "n/a" if value is None else f"{value:,.0f}"


def _pct(value: float | None) -> str:
    return "n/a" if value is None else f"{100 * value:.1f}%"


def _x(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}x"


def _met(ok: bool | None) -> str:
    return "" if ok is None else ("yes" if ok else "**no**")


def target_checks(
    on: ModeResult, off: ModeResult, window_ms: int = AFFINITY_WINDOW_MS
) -> dict[str, tuple[float | None, bool | None]]:
    """Each goal (``TARGET_*``, the window for the extra wait): the measured figure, and
    whether it is met (None: not measured).
    The longest extra wait from affinity is read as the longest queue wait with it beyond the
    longest without it."""
    same = on.same_worker_rate
    ttft = ratio(off.follow_up_ttft_p50_ms, on.follow_up_ttft_p50_ms)
    tok = ratio(on.tok_s, off.tok_s)
    extra = None
    if on.queue_wait_max_ms is not None and off.queue_wait_max_ms is not None:
        extra = max(0.0, on.queue_wait_max_ms - off.queue_wait_max_ms)
    return {
        "longest_extra_queue_wait_ms": (extra, None if extra is None else extra <= window_ms),
        "same_worker_rate_on": (same, None if same is None else same >= TARGET_SAME_WORKER),
        "follow_up_ttft_p50_off_over_on": (ttft, None if ttft is None else ttft >= TARGET_TTFT_RATIO),
        "tok_s_on_over_off": (tok, None if tok is None else tok >= TARGET_TOK_S_RATIO),
    }


def table(on: ModeResult, off: ModeResult, workers: int, window_ms: int = AFFINITY_WINDOW_MS) -> str:
    """The two modes side by side, the ratios and the targets."""
    checks = target_checks(on, off, window_ms)
    extra, extra_met = checks["longest_extra_queue_wait_ms"]
    ttft_ratio, ttft_met = checks["follow_up_ttft_p50_off_over_on"]
    same_rate, same_met = checks["same_worker_rate_on"]
    tok_ratio, tok_met = checks["tok_s_on_over_off"]

    def affinity(r: ModeResult) -> str:
        c = r.counters
        return f"{c['affinity_hits']:.0f} / {c['affinity_misses']:.0f} / {c['affinity_expired']:.0f}"

    def cache(r: ModeResult) -> str:
        return f"{_pct(r.cache_hit_rate)} ({r.counters['hits']:,.0f} / {r.counters['queries']:,.0f})"

    def split(r: ModeResult) -> str:
        return " / ".join(str(n) for n in r.requests_by_worker.values())

    def stayed(r: ModeResult) -> str:
        return f"{_ms(r.same_worker_ttft_p50_ms)} / {_ms(r.same_worker_queue_wait_p50_ms)}"

    def engine_split(r: ModeResult) -> str:
        return f"{_ms(r.ttft_mean_ms)} / {_ms(r.engine_mean_ms('engine_ttft'))}"

    def engine_phases(r: ModeResult) -> str:
        return f"{_ms(r.engine_mean_ms('engine_waiting'))} / {_ms(r.engine_mean_ms('engine_prefill'))}"

    rows = [
        ("follow-up TTFT p50 (ms)", _ms(on.follow_up_ttft_p50_ms), _ms(off.follow_up_ttft_p50_ms),
         f"off/on {_x(ttft_ratio)}", f"off/on >= {TARGET_TTFT_RATIO}x", _met(ttft_met)),
        ("follow-up TTFT p90 (ms)", _ms(on.follow_up_ttft_p90_ms), _ms(off.follow_up_ttft_p90_ms),
         f"off/on {_x(ratio(off.follow_up_ttft_p90_ms, on.follow_up_ttft_p90_ms))}", "", ""),
        ("first-turn TTFT p50 (ms)", _ms(on.first_ttft_p50_ms), _ms(off.first_ttft_p50_ms), "", "", ""),
        ("same-worker rate of follow-ups", f"{_pct(same_rate)} ({on.same_worker}/{on.follow_ups})",
         f"{_pct(off.same_worker_rate)} ({off.same_worker}/{off.follow_ups})", "",
         f"on >= {TARGET_SAME_WORKER:.0%} (off: ~1 in {workers})", _met(same_met)),
        ("vLLM prefix-cache hit rate (hit / queried tokens)", cache(on), cache(off), "", "", ""),
        ("streamq affinity hits / misses / expired", affinity(on), affinity(off), "", "", ""),
        ("requests per worker (same order in both)", split(on), split(off), "", "", ""),
        ("completion tokens / wall s", f"{on.completion_tokens:,} / {on.wall_s:.1f}",
         f"{off.completion_tokens:,} / {off.wall_s:.1f}", "", "", ""),
        ("output tok/s", f"{on.tok_s:,.1f}", f"{off.tok_s:,.1f}", f"on/off {_x(tok_ratio)}",
         f"on/off >= {TARGET_TOK_S_RATIO}x", _met(tok_met)),
        ("follow-ups on their previous turn's worker: TTFT / queue wait p50 (ms)", stayed(on), stayed(off),
         "", "", ""),
        ("TTFT mean, all turns: at the client / in the engine (ms)", engine_split(on), engine_split(off), "", "", ""),
        ("engine: waiting / prefill mean (ms)", engine_phases(on), engine_phases(off), "", "", ""),
        ("queue wait p50 / longest (ms)", f"{_ms(on.queue_wait_p50_ms)} / {_ms(on.queue_wait_max_ms)}",
         f"{_ms(off.queue_wait_p50_ms)} / {_ms(off.queue_wait_max_ms)}", f"extra {_ms(extra)}",
         f"extra <= the window ({window_ms} ms)", _met(extra_met)),
    ]  # fmt: skip
    lines = ["| | affinity on | affinity off | ratio | target | met |", "|---|---:|---:|---:|---|---|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


# --- the run --------------------------------------------------------------------------------


@dataclass(frozen=True)
class AffinityConfig:
    workload: Workload
    workers: int
    model_dir: str
    max_model_len: int
    results_dir: Path
    run_id: str
    affinity_window_ms: int = AFFINITY_WINDOW_MS  # the client's
    rounds: int = 4  # of each mode, taking turns
    bind_engines: bool = True  # each engine on a CPU of its own (engine_env)

    def engine_flags(self) -> list[str]:
        """The benchmark's engine flags (``bench.config``) with this run's context length."""
        return [
            *tiny_engine_flags(self.model_dir, max_model_len=self.max_model_len),
            "--max-num-seqs",
            str(max(128, self.workload.conversations)),
            "--max-num-batched-tokens",
            str(SERVE_MAX_NUM_BATCHED_TOKENS),
            *shlex.split(os.environ.get(ENGINE_FLAGS_ENV, "")),
        ]


async def with_queue_waits(redis_url: str, turns: list[Turn]) -> list[Turn]:
    """``turns`` with their queue waits, from arq's stored results (written as a job ends,
    which its final event precedes: waited for a moment)."""
    redis = aioredis.Redis.from_url(redis_url)
    try:
        out = []
        for turn in turns:
            raw = None
            for _ in range(100):
                if (raw := await redis.get(RESULT_KEY_PREFIX + turn.request_id)) is not None:
                    break
                await asyncio.sleep(0.02)
            result = json.loads(raw) if raw is not None else {}
            wait = (result["st"] - result["et"]) / 1000 if "st" in result and "et" in result else None
            out.append(replace(turn, queue_wait_s=wait))
        return out
    finally:
        await redis.aclose()


@dataclass
class ModeRun:
    """What one mode's rounds gathered: every turn, their wall time, the counters' deltas."""

    turns: list[Turn] = field(default_factory=list)
    wall_s: float = 0.0
    counters: Counter[str] = field(default_factory=Counter)


async def run_mode(
    config: AffinityConfig, redis_url: str, ports: Sequence[int], mode: str, round_: int, into: ModeRun
) -> None:
    """One round of a mode ("on" or "off"): its conversations (texts of the mode's and round's
    own, numbered after the earlier rounds'), all at once, between two scrapes of every worker;
    what it measured is added to ``into``."""
    workload = config.workload
    conversations = build_conversations(workload, f"{mode}-{round_}")
    async with await StreamqClient.connect(redis_url, affinity_window_s=config.affinity_window_ms / 1000) as client:
        before = [scrape(port) for port in ports]
        started = time.perf_counter()
        per_conversation = await asyncio.gather(
            *(run_conversation(client, c, workload.turns, workload.max_tokens, mode == "on") for c in conversations)
        )
        wall_s = time.perf_counter() - started
        await asyncio.sleep(0.5)  # vLLM counts a request's cache figures on its next stats step
        after = [scrape(port) for port in ports]
    offset = round_ * workload.conversations
    turns = [replace(t, conversation=t.conversation + offset) for done in per_conversation for t in done]
    turns = await with_queue_waits(redis_url, turns)
    result = summarize(mode, turns, wall_s, delta(before, after))
    print(
        f"[affinity] {mode}, round {round_ + 1}: {result.requests} requests in {wall_s:.1f} s, follow-up TTFT p50 "
        f"{_ms(result.follow_up_ttft_p50_ms)} ms, same worker {_pct(result.same_worker_rate)}, cache hits "
        f"{_pct(result.cache_hit_rate)}, longest prompt {result.max_prompt_tokens} tokens",
        flush=True,
    )
    into.turns += turns
    into.wall_s += wall_s
    into.counters.update(delta(before, after))


async def warm_up(redis_url: str, workload: Workload, workers: int, rounds: int = 10) -> list[str]:
    """Requests shaped like a first turn (texts of their own, no affinity, 4 tokens), a round of
    ``workers`` at a time, until every worker has run one, so each engine has prefilled a long
    prompt before the clock (the first mode would pay for it otherwise); the workers' ids, as
    first seen."""
    seen: list[str] = []
    shape = replace(workload, conversations=workers, turns=1)
    async with await StreamqClient.connect(redis_url) as client:
        for round_ in range(rounds):
            handles = [
                await client.submit(messages=c.messages, max_tokens=4, ignore_eos=True, affinity=False)
                for c in build_conversations(shape, f"warm-up-{round_}")
            ]
            for handle in handles:
                worker = (await handle.result()).worker_id
                if worker is not None and worker not in seen:
                    seen.append(worker)
            if len(seen) >= workers:
                break
    if len(seen) < workers:
        print(f"[affinity] warm-up reached {len(seen)} of {workers} workers", flush=True)
    return seen


def engine_env(index: int, cpus: int, bind: bool) -> dict[str, str]:
    """Worker ``index``'s environment: with ``bind``, its engine's OpenMP threads on CPU
    ``index % cpus`` (``VLLM_CPU_OMP_THREADS_BIND``, unless set already; GPU builds ignore it).
    vLLM's ``auto`` puts every engine of a machine on the same cores (here all on CPU 0, one
    kept for the rest), so two engines would share one core: not two workers' worth of compute."""
    if not bind or BIND_ENV in os.environ:
        return worker_env()
    return worker_env(**{BIND_ENV: str(index % max(cpus, 1))})


def run(config: AffinityConfig) -> tuple[list[ModeResult], dict[str, list[Turn]]]:
    ports = free_ports(config.workers)
    results: list[ModeResult] = []
    turns: dict[str, list[Turn]] = {}
    with RedisServer() as redis_server:
        workers = [
            WorkerProcess(
                redis_server.url,
                config.engine_flags(),
                log_path=config.results_dir / f"{config.run_id}-affinity-worker{i}.log",
                env=engine_env(i, os.cpu_count() or 1, config.bind_engines),
                metrics_port=port,
            ).start()
            for i, port in enumerate(ports)
        ]
        try:
            for worker in workers:
                wait_logged(worker, READY_LINE, timeout_s=300)
            worker_ids = asyncio.run(warm_up(redis_server.url, config.workload, config.workers))
            runs = {"on": ModeRun(), "off": ModeRun()}
            for round_ in range(config.rounds):
                # The modes take turns going first, so neither always runs on a warmer machine.
                for mode in ("on", "off") if round_ % 2 == 0 else ("off", "on"):
                    asyncio.run(run_mode(config, redis_server.url, ports, mode, round_, runs[mode]))
            for mode, gathered in runs.items():
                results.append(summarize(mode, gathered.turns, gathered.wall_s, gathered.counters, worker_ids))
                turns[mode] = gathered.turns
        finally:
            for i, worker in enumerate(workers):
                code = worker.stop()
                if code != 0:
                    print(f"[affinity] worker {i} exited with {code}; see {worker.log_path}", flush=True)
    return results, turns


def code_version() -> str:
    """The commit the workers and the client run, ``+ changes`` if the code they load
    (worker, producer, streamq) differs from it; "unknown" outside a git checkout."""
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout.strip()
        changes = subprocess.run(
            ["git", "status", "--porcelain", "--", "worker", "producer", "streamq"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return commit + (" + changes" if changes else "")


def build_parser() -> argparse.ArgumentParser:
    defaults = Workload()
    parser = argparse.ArgumentParser(prog="python -m bench.affinity", description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2, help="worker processes (default %(default)s)")
    parser.add_argument(
        "--conversations", type=int, default=defaults.conversations, help="at once (default %(default)s)"
    )
    parser.add_argument("--turns", type=int, default=defaults.turns, help="per conversation (default %(default)s)")
    parser.add_argument(
        "--shared-chars",
        type=int,
        default=defaults.shared_chars,
        help="the shared system message (default %(default)s)",
    )
    parser.add_argument(
        "--system-chars",
        type=int,
        default=defaults.system_chars,
        help="each conversation's own system message (default %(default)s)",
    )
    parser.add_argument(
        "--user-chars", type=int, default=defaults.user_chars, help="each user message (default %(default)s)"
    )
    parser.add_argument(
        "--max-tokens", type=int, default=defaults.max_tokens, help="per turn, ignore_eos (default %(default)s)"
    )
    parser.add_argument("--seed", type=int, default=defaults.seed, help="of the texts (default %(default)s)")
    parser.add_argument(
        "--rounds",
        type=int,
        default=AffinityConfig.rounds,
        help="of each mode, taking turns to go first, fresh texts each (default %(default)s)",
    )
    parser.add_argument(
        "--affinity-window-ms",
        type=int,
        default=AFFINITY_WINDOW_MS,
        help="the client's affinity_window_ms (default %(default)s, the client's)",
    )
    parser.add_argument(
        "--max-model-len", type=int, default=MAX_POSITIONS, help="the engines' context (default %(default)s)"
    )
    parser.add_argument(
        "--shared-engine-cores",
        action="store_true",
        help=f"leave {BIND_ENV} to vLLM ('auto': every engine on the same cores) instead of one CPU per engine",
    )
    parser.add_argument(
        "--model-dir", type=Path, default=MODEL_DIR, help=f"built if absent ({MAX_POSITIONS} positions)"
    )
    parser.add_argument("--results-dir", type=Path, default=ROOT / "bench" / "results")
    return parser


def main(argv: Sequence[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    os.chdir(ROOT)
    args.results_dir.mkdir(parents=True, exist_ok=True)
    run_id = time.strftime("%Y%m%d-%H%M%S")
    model_dir = build_tiny_model(args.model_dir, max_position_embeddings=max(MAX_POSITIONS, args.max_model_len))
    workload = Workload(
        conversations=args.conversations,
        turns=args.turns,
        shared_chars=args.shared_chars,
        system_chars=args.system_chars,
        user_chars=args.user_chars,
        max_tokens=args.max_tokens,
        seed=args.seed,
    )
    config = AffinityConfig(
        workload=workload,
        workers=args.workers,
        model_dir=str(model_dir),
        max_model_len=args.max_model_len,
        results_dir=args.results_dir,
        run_id=run_id,
        affinity_window_ms=args.affinity_window_ms,
        rounds=args.rounds,
        bind_engines=not args.shared_engine_cores,
    )
    started = time.monotonic()
    version = code_version()
    (on, off), turns = run(config)
    engines = (
        f"{BIND_ENV} {os.environ[BIND_ENV]!r} for both engines"
        if BIND_ENV in os.environ or not config.bind_engines
        else f"each engine on a CPU of its own ({BIND_ENV} 0, 1, ...)"
    )
    if not config.bind_engines and BIND_ENV not in os.environ:
        engines = f"{BIND_ENV} left to vLLM ('auto')"
    header = (
        f"# Prefix-aware pickup {run_id}\n\n`{shlex.join(['python', '-m', 'bench.affinity', *sys.argv[1:]])}`: "
        f"{config.workers} workers on one Redis, tiny random Llama ({model_dir}, engine flags "
        f"`{' '.join(config.engine_flags())}`, {engines}); {config.rounds} rounds of each mode (taking turns "
        f"to go first) of {workload.conversations} conversations at once x "
        f"{workload.turns} turns, system messages of {workload.shared_chars} characters (shared) and "
        f"{workload.system_chars} (each conversation's), user messages of {workload.user_chars}, "
        f"max_tokens {workload.max_tokens} (ignore_eos); longest prompt "
        f"{max(on.max_prompt_tokens, off.max_prompt_tokens)} tokens; code at {version}; {os.cpu_count()} CPUs; "
        f"{time.monotonic() - started:.0f} s in all."
    )
    text = f"{header}\n\n{table(on, off, config.workers, config.affinity_window_ms)}\n"
    base = args.results_dir / f"{run_id}-affinity"
    base.with_suffix(".md").write_text(text)
    checks = target_checks(on, off, config.affinity_window_ms)
    payload = {
        "run_id": run_id,
        "code": version,
        "config": {**asdict(config), "results_dir": str(config.results_dir)},
        "modes": [
            asdict(r) | {"same_worker_rate": r.same_worker_rate, "cache_hit_rate": r.cache_hit_rate, "tok_s": r.tok_s}
            for r in (on, off)
        ],  # fmt: skip
        "targets": {name: {"measured": value, "met": met} for name, (value, met) in checks.items()},
        "turns": {mode: [asdict(t) for t in rows] for mode, rows in turns.items()},
    }
    base.with_suffix(".json").write_text(json.dumps(payload, indent=1))
    print("\n" + text)
    print(f"written: {base}.json, {base}.md", flush=True)


if __name__ == "__main__":
    main()
