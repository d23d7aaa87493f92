"""What one benchmark run measures, shared by the parent and every path's subprocess.

Each engine path runs in its own process, so that two engines (each spawning processes)
never compete at once; the parent hands this configuration over as JSON.
"""

from __future__ import annotations

import json
import os
import shlex
from dataclasses import asdict, dataclass
from pathlib import Path

from devkit.worker_process import tiny_engine_flags

ENGINE_FLAGS_ENV = "STREAMQ_BENCH_ENGINE_FLAGS"
"""Engine flags added after the benchmark's own, for every path (the last of a flag wins):
a GPU run's ``--dtype bfloat16 --no-enforce-eager --load-format dummy``."""

SERVE_MAX_NUM_BATCHED_TOKENS = 2048
"""``vllm serve``'s own CPU default. The worker resolves unset limits as ``vllm serve`` does,
but path (a)'s ``AsyncLLM.from_engine_args`` does not (vLLM's defaults depend on the usage
context), so the benchmark spells them out for all paths."""


def int_list(text: str) -> tuple[int, ...]:
    """``"1,16,64"`` -> ``(1, 16, 64)``: the command lines' comma-separated levels."""
    return tuple(int(x) for x in text.split(",") if x.strip())


@dataclass(frozen=True)
class BenchConfig:
    """One side-by-side run: the model, the request shape and the load levels."""

    model_dir: str
    input_len: int
    output_len: int
    concurrencies: tuple[int, ...]
    num_prompts: int | None  # None: enough for several waves at each concurrency
    seed: int
    results_dir: str
    run_id: str  # names this run's files in results_dir
    profile: bool = False  # record path (b)'s worker with py-spy (perturbs its figures)
    stream_interval: int = 8  # path (b) again with a chunk every this many tokens; 0: skip
    front_ends: int = 1  # vllm serve's --api-server-count in (c), the worker's --front-ends in (d)

    def prompts_for(self, concurrency: int) -> int:
        """Requests sent at ``concurrency``: at least 16 waves, at least 64 requests,
        so ramp-up and ramp-down are a small part of the wall time."""
        return self.num_prompts or max(64, 16 * concurrency)

    def engine_flags(self) -> list[str]:
        """The engine flags of all three paths, exactly as ``vllm serve`` spells them."""
        return [
            *tiny_engine_flags(self.model_dir),
            "--max-num-seqs",
            str(max(128, *self.concurrencies)),
            "--max-num-batched-tokens",
            str(SERVE_MAX_NUM_BATCHED_TOKENS),
            *shlex.split(os.environ.get(ENGINE_FLAGS_ENV, "")),
        ]

    def save(self, path: Path) -> None:
        path.write_text(json.dumps(asdict(self)))

    @classmethod
    def load(cls, path: Path) -> BenchConfig:
        raw = json.loads(path.read_text())
        raw["concurrencies"] = tuple(raw["concurrencies"])
        return cls(**raw)
