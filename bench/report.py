"""The run's outputs: JSON, a markdown table of the targets beside the figures measured, a PNG plot."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from bench.redis_capacity import CapacityResult, capacity_table, pooled
from bench.scale_out import ScaleOutResult
from bench.timing import PathResult

PATH_NAMES = {
    "a": "(a) bare AsyncLLM",
    "b": "(b) streamq",
    "b-interval": "(b) streamq, stream_interval",
    "e": "(e) streamq, 2 front ends",
    "c": "(c) vllm serve",
    "d": "(d) streamq gateway",
}


def ratio_to_engine(results: Sequence[PathResult]) -> dict[tuple[str, int], float | None]:
    """Output tok/s of each row over path (a)'s at the same concurrency."""
    ceiling = {r.concurrency: r.output_tok_s for r in results if r.path == "a"}
    return {
        (r.path, r.concurrency): (r.output_tok_s / ceiling[r.concurrency] if r.concurrency in ceiling else None)
        for r in results
    }


def paths_table(results: Sequence[PathResult]) -> str:
    ratios = ratio_to_engine(results)
    lines = [
        "| path | concurrency | TTFT p50 (ms) | TTFT p99 (ms) | ITL p50 (ms) | ITL p99 (ms) | output tok/s "
        "| ratio to (a) | chunks per token |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in sorted(results, key=lambda r: (r.concurrency, r.path)):
        ratio = ratios[(r.path, r.concurrency)]
        lines.append(
            f"| {PATH_NAMES[r.path]} | {r.concurrency} | {r.ttft_p50_ms:.2f} | {r.ttft_p99_ms:.2f} | "
            f"{r.itl_p50_ms:.2f} | {r.itl_p99_ms:.2f} | {r.output_tok_s:,.0f} | "
            f"{'' if ratio is None else f'{ratio:.3f}'} | "
            f"{'' if r.chunks_per_token is None else f'{r.chunks_per_token:.2f}'} |"
        )
    return "\n".join(lines)


CPU_ROLES = {
    "front_end": "front end",
    "beyond_a": "front end beyond (a)'s",
    "engine_core": "engine core",
    "redis": "Redis",
    "gateway": "gateway",
    "client": "client",
}
"""The columns of the CPU table: what ``bench.cpu`` measured per role, and the front end's
cost beyond bare AsyncLLM's (computed here)."""


def front_end_costs(result: PathResult) -> list[float]:
    """The CPU per token of each front-end process of a row: one, or path (e)'s several
    (roles ``front_end_0``, ``front_end_1``, ...)."""
    costs = result.cpu_us_per_token
    if "front_end" in costs:
        return [costs["front_end"]]
    return [us for role, us in sorted(costs.items()) if role.startswith("front_end_")]


def with_front_end_total(result: PathResult) -> dict[str, float]:
    """A row's CPU per token by role, its front ends summed as ``front_end``."""
    each = front_end_costs(result)
    costs = {role: us for role, us in result.cpu_us_per_token.items() if not role.startswith("front_end_")}
    return costs | ({"front_end": sum(each)} if each else {})


def front_end_beyond_engine(results: Sequence[PathResult]) -> dict[tuple[str, int], float]:
    """Each row's front-end CPU per token (all its front ends) minus path (a)'s at the same
    concurrency: what the worker (b, d, e) or ``vllm serve``'s API server (c) adds to
    AsyncLLM's own front end."""
    bare = {r.concurrency: sum(front_end_costs(r)) for r in results if r.path == "a" and r.cpu_us_per_token}
    return {
        (r.path, r.concurrency): sum(front_end_costs(r)) - bare[r.concurrency]
        for r in results
        if r.path != "a" and r.concurrency in bare and front_end_costs(r)
    }


def cpu_table(results: Sequence[PathResult]) -> str:
    beyond = front_end_beyond_engine(results)
    lines = [
        "| path | concurrency | " + " | ".join(CPU_ROLES.values()) + " | all processes | CPU % of a core, all |",
        "|---|---:|" + "---:|" * (len(CPU_ROLES) + 2),
    ]
    for r in sorted(results, key=lambda r: (r.concurrency, r.path)):
        if not r.cpu_us_per_token:
            continue
        costs = with_front_end_total(r)
        costs |= {"beyond_a": beyond[key]} if (key := (r.path, r.concurrency)) in beyond else {}
        cells = [f"{costs[role]:.1f}" if role in costs else "" for role in CPU_ROLES]
        if len(each := front_end_costs(r)) > 1:
            cells[0] += " (" + " + ".join(f"{us:.1f}" for us in each) + ")"
        lines.append(
            f"| {PATH_NAMES[r.path]} | {r.concurrency} | {' | '.join(cells)} | "
            f"{sum(r.cpu_us_per_token.values()):.1f} | {sum(r.cpu_percent.values()):.0f} |"
        )
    return "\n".join(lines)


CPU_LEGEND = (
    "CPU microseconds (user + system, from `/proc/<pid>/stat`) per delivered output token, over each "
    "level's measured batch (not its warm-up). Front end: the AsyncLLM process itself in (a) (with the loop "
    "that consumes it), the worker in (b) and (d), the API server in (c); where an engine has several front "
    "ends ((e), and (c) and (d) with `--front-ends`) their sum, each in brackets, the process that started "
    "them counted with the engine core; engine core: the process the front end spawns; client: the "
    "benchmark's own process (the subscriber in (b) and (e), `vllm bench serve` in (c) and (d)). \"Beyond "
    "(a)'s\" is the front end minus (a)'s front end at the same concurrency. The last column sums every "
    "process's share of one core over the window: it cannot exceed 100 x the CPUs."
)


def scale_out_table(results: Sequence[ScaleOutResult]) -> str:
    base = next((r.delivered_tokens_s for r in results if r.workers == 1), None)
    lines = [
        "| workers | subscriber processes | requests in flight | offered tokens/s | delivered tokens/s | vs 1 worker | "
        "events per token | time to first chunk p50/p99 (ms) | errors | CPU us per token: workers, Redis, "
        "subscribers | CPU % (100 = one core) |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    for r in results:
        speedup = f"{r.delivered_tokens_s / base:.2f}x" if base else ""
        cpu = ", ".join(f"{role} {pct:.0f}" for role, pct in r.cpu_percent.items())
        us = r.cpu_us_per_token
        costs = f"{us.get('workers', 0):.1f}, {us.get('redis', 0):.1f}, {us.get('subscribers', 0):.1f}"
        lines.append(
            f"| {r.workers} | {r.subscribers} | {r.requests_in_flight} | {r.offered_tokens_s:,.0f} | "
            f"{r.delivered_tokens_s:,.0f} | {speedup} | {r.events_per_token:.3f} | "
            f"{r.ttft_ms()} | {r.errors} | {costs} | {cpu} |"
        )
    return "\n".join(lines)


def target_checks(
    results: Sequence[PathResult],
    scale_out: Sequence[ScaleOutResult],
    capacity: Sequence[CapacityResult] = (),
) -> list[tuple[str, str, bool]]:
    """The targets this run's data covers, each as (target, measured, met)."""
    by = {(r.path, r.concurrency): r for r in results}
    ratios = ratio_to_engine(results)
    checks: list[tuple[str, str, bool]] = []
    levels = sorted({r.concurrency for r in results})
    b_ratios = [(c, ratios[("b", c)]) for c in levels if ("b", c) in by and ratios[("b", c)] is not None]
    if b_ratios:
        measured = ", ".join(f"c={c}: {ratio:.3f}" for c, ratio in b_ratios)
        checks.append(
            (
                "(b)/(a) output tok/s >= 0.95 at every concurrency",
                measured,
                all(ratio is not None and ratio >= 0.95 for _, ratio in b_ratios),
            )
        )
    if ("a", 1) in by and ("b", 1) in by:
        delta = by[("b", 1)].ttft_p50_ms - by[("a", 1)].ttft_p50_ms
        checks.append(("(b) TTFT p50 - (a) TTFT p50 <= 2 ms at c=1", f"{delta:+.2f} ms", delta <= 2.0))
    top = max(levels, default=0)
    if ("b", top) in by and ("c", top) in by:
        b, c = by[("b", top)].output_tok_s, by[("c", top)].output_tok_s
        checks.append((f"(b) >= (c) output tok/s at c={top}", f"{b:,.0f} vs {c:,.0f} ({b / c:.3f})", b >= c))
    d_levels = [c for c in levels if ("c", c) in by and ("d", c) in by]
    if d_levels:
        tok = {c: by[("d", c)].output_tok_s / by[("c", c)].output_tok_s for c in d_levels}
        checks.append(
            (
                "(d)/(c) output tok/s >= 1.0 at every concurrency",
                ", ".join(f"c={c}: {tok[c]:.3f}" for c in d_levels),
                all(r >= 1.0 for r in tok.values()),
            )
        )
        ttft = {c: (by[("d", c)].ttft_p50_ms, by[("c", c)].ttft_p50_ms) for c in d_levels}
        checks.append(
            (
                "(d) TTFT p50 <= (c) TTFT p50 at every concurrency",
                ", ".join(f"c={c}: {d:.1f} vs {cc:.1f} ms" for c, (d, cc) in ttft.items()),
                all(d <= cc for d, cc in ttft.values()),
            )
        )
    beyond = front_end_beyond_engine(results)
    if ("b", top) in beyond:
        us = beyond[("b", top)]
        checks.append((f"(b) worker CPU per token beyond (a)'s front end <= 5 us at c={top}", f"{us:.1f} us", us <= 5))
    tokens = {r.workers: r.delivered_tokens_s for r in scale_out}
    if 1 in tokens:
        checks.append(
            ("1 worker >= 150,000 delivered tokens/s (scripted engine)", f"{tokens[1]:,.0f}", tokens[1] >= 150_000)
        )
    if 1 in tokens and 2 in tokens:
        speedup = tokens[2] / tokens[1]
        checks.append(("2 workers >= 1.7x one", f"{speedup:.2f}x", speedup >= 1.7))
    redis = [(r.workers, r.cpu_us_per_token["redis"]) for r in scale_out if "redis" in r.cpu_us_per_token]
    if redis:
        measured = ", ".join(f"{w} worker(s): {us:.1f} us" for w, us in redis)
        checks.append(
            ("Redis CPU per delivered token <= 3 us (scripted engine)", measured, all(us <= 3 for _, us in redis))
        )
    for arm, _ in pooled(capacity):
        checks.append(
            (
                f"one Redis core >= 500,000 tokens/s, project scripts, {arm.tokens_per_event} token(s) per event",
                f"{arm.one_core_tokens_s:,.0f} ({arm.redis_us_per_token:.2f} us per token)",
                arm.one_core_tokens_s >= 500_000,
            )
        )
    return checks


def markdown(
    results: Sequence[PathResult],
    scale_out: Sequence[ScaleOutResult],
    header: str,
    capacity: Sequence[CapacityResult] = (),
    capacity_note: str = "",
) -> str:
    parts = [header]
    if results:
        parts += ["## Side by side", paths_table(results)]
        if any(r.cpu_us_per_token for r in results):
            parts += ["## CPU per delivered token (us)", CPU_LEGEND, cpu_table(results)]
    if scale_out:
        parts += ["## Scale-out (scripted engine)", scale_out_table(scale_out)]
    if capacity:
        parts += ["## Redis capacity (project scripts, no engine)", capacity_note, capacity_table(capacity)]
    checks = target_checks(results, scale_out, capacity)
    if checks:
        rows = ["| target | measured | met |", "|---|---|---|"]
        rows += [f"| {target} | {measured} | {'yes' if met else '**no**'} |" for target, measured, met in checks]
        parts += ["## Targets", "\n".join(rows)]
    return "\n\n".join(parts) + "\n"


def write_json(
    path: Path,
    meta: dict[str, Any],
    results: Sequence[PathResult],
    scale_out: Sequence[ScaleOutResult],
    capacity: Sequence[CapacityResult] = (),
) -> None:
    ratios = ratio_to_engine(results)
    beyond = front_end_beyond_engine(results)
    payload = {
        **meta,
        "paths": [
            {
                **asdict(r),
                "ratio_to_a": ratios[(r.path, r.concurrency)],
                "cpu_us_per_token_front_end_beyond_a": beyond.get((r.path, r.concurrency)),
            }
            for r in results
        ],
        "scale_out": [asdict(r) | {"events_per_token": r.events_per_token} for r in scale_out],
        "redis_capacity": [asdict(r) for r in capacity],
        "targets": [
            {"target": t, "measured": m, "met": met} for t, m, met in target_checks(results, scale_out, capacity)
        ],
    }
    path.write_text(json.dumps(payload, indent=1))


def write_plot(path: Path, results: Sequence[PathResult], scale_out: Sequence[ScaleOutResult]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [("output_tok_s", "output tokens/s"), ("ttft_p50_ms", "TTFT p50 (ms)"), ("itl_p50_ms", "ITL p50 (ms)")]
    fig, axes = plt.subplots(1, 4, figsize=(20, 4.5))
    for ax, (attribute, title) in zip(axes[:3], panels, strict=True):
        for key, name in PATH_NAMES.items():
            rows = sorted((r for r in results if r.path == key), key=lambda r: r.concurrency)
            if rows:
                ax.plot([r.concurrency for r in rows], [getattr(r, attribute) for r in rows], marker="o", label=name)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrency")
        ax.set_title(title)
        ax.grid(True, alpha=0.3)
        ax.legend()
    ax = axes[3]
    if scale_out:
        ax.bar([str(r.workers) for r in scale_out], [r.delivered_tokens_s for r in scale_out], color="tab:orange")
        ax.axhline(150_000, color="grey", linestyle="--", label="target, 1 worker")
        ax.legend()
    ax.set_xlabel("workers (scripted engine)")
    ax.set_title("tokens/s delivered to subscribers")
    ax.grid(True, axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
