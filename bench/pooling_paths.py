"""vLLM's own ways to embed, the yardsticks of ``python -m bench.pooling``, each run in a
process of its own (one engine at a time): ``python -m bench.pooling_paths PATH CONFIG OUT``.

- ``offline``: ``vllm.LLM(...).embed(inputs)``, every input at once: the throughput ceiling.
- ``bare``: a bare ``AsyncLLM`` driven as the worker drives it (``worker/pooling.py``): one
  ``encode`` per input, task ``embed``, calls of ``per_call`` inputs gathered, ``in_flight``
  calls at once. What the worker's process spends beyond this process's is what the queue
  adds to the engine's own front end.

Each is timed from its first input to its last result, after a warm-up of a few calls; the
engine's start is not counted. CPU: this process (``front_end``) and its children
(``engine_core``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from vllm import LLM, PoolingParams
from vllm.engine.arg_utils import AsyncEngineArgs, EngineArgs
from vllm.utils.argparse_utils import FlexibleArgumentParser
from vllm.v1.engine.async_llm import AsyncLLM

from bench.cpu import CpuWindow, descendants

WARM_UP_CALLS = 4


def _engine_args(flags: list[str], kind: type[EngineArgs]) -> EngineArgs:
    parser = FlexibleArgumentParser()
    kind.add_cli_args(parser)
    args: EngineArgs = kind.from_cli_args(parser.parse_args(flags))
    return args


def _roles() -> dict[str, list[int]]:
    return {"front_end": [os.getpid()], "engine_core": descendants(os.getpid())}


def _calls(inputs: list[str], per_call: int) -> list[list[str]]:
    return [inputs[start : start + per_call] for start in range(0, len(inputs), per_call)]


def offline(config: dict[str, Any]) -> dict[str, Any]:
    """``LLM.embed`` over every input at once: vLLM's offline path."""
    args = _engine_args(config["engine_flags"], EngineArgs)
    defaults = EngineArgs(model=args.model)
    given = {
        f.name: getattr(args, f.name)
        for f in dataclasses.fields(EngineArgs)
        if f.init and getattr(args, f.name) != getattr(defaults, f.name) and f.name != "model"
    }
    llm = LLM(model=args.model, **given)
    inputs: list[str] = config["inputs"]
    llm.embed(inputs[: WARM_UP_CALLS * config["per_call"]], use_tqdm=False)
    cpu = CpuWindow(_roles())
    cpu.start()
    started = time.perf_counter()
    outputs = llm.embed(inputs, use_tqdm=False)
    wall_s = time.perf_counter() - started
    window = cpu.stop()
    return {
        "wall_s": wall_s,
        "inputs": len(outputs),
        "dims": len(outputs[0].outputs.embedding),
        "prompt_tokens": sum(len(o.prompt_token_ids) for o in outputs),
        "cpu_s": window.seconds,
    }


async def _bare(config: dict[str, Any]) -> dict[str, Any]:
    engine = AsyncLLM.from_engine_args(_engine_args(config["engine_flags"], AsyncEngineArgs))  # type: ignore[arg-type]
    params = PoolingParams(task="embed")
    counter = iter(range(10**9))
    dims: list[int] = []

    async def one(text: str) -> int:
        output = None
        async for last in engine.encode(text, params, f"bare-{next(counter)}"):  # one output, when done
            output = last
        assert output is not None
        if not dims:
            dims.append(len(output.outputs.data))
        return len(output.prompt_token_ids or ())

    async def run(calls: list[list[str]]) -> list[int]:
        """``in_flight`` callers, each taking the next call and gathering its inputs."""
        pending = iter(calls)
        done: list[int] = []

        async def caller() -> None:
            for call in pending:
                done.extend(await asyncio.gather(*(one(text) for text in call)))

        await asyncio.gather(*(caller() for _ in range(config["in_flight"])))
        return done

    try:
        calls = _calls(config["inputs"], config["per_call"])
        await run(calls[:WARM_UP_CALLS])
        cpu = CpuWindow(_roles())
        cpu.start()
        started = time.perf_counter()
        tokens = await run(calls)
        wall_s = time.perf_counter() - started
        window = cpu.stop()
    finally:
        engine.shutdown()
    return {
        "wall_s": wall_s,
        "inputs": len(tokens),
        "dims": dims[0],
        "prompt_tokens": sum(tokens),
        "cpu_s": window.seconds,
    }


PATHS = {"offline": offline, "bare": lambda config: asyncio.run(_bare(config))}


def main() -> None:
    path, config_path, out = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
    config = json.loads(config_path.read_text())
    result = PATHS[path](config)
    print(f"[{path}] {result['inputs']} inputs in {result['wall_s']:.2f}s", flush=True)
    out.write_text(json.dumps(result))


if __name__ == "__main__":
    main()
