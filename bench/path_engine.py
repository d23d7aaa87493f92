"""Path (a): the bare engine, the ceiling.

One ``AsyncLLM`` in this process, streamed the way vLLM's
``async_llm_streaming.py`` example streams: ``SamplingParams(output_kind=DELTA)``,
``async for output in engine.generate(...)``, stop at ``output.finished``. No
network, no serialization: what is left is the engine itself. Its CPU roles: this
process (``front_end``: AsyncLLM's own front end, and the loop that consumes it) and the
engine core it spawns.
"""

from __future__ import annotations

import asyncio
import os
import uuid
from collections.abc import AsyncIterator

from vllm import SamplingParams
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.sampling_params import RequestOutputKind
from vllm.utils.argparse_utils import FlexibleArgumentParser
from vllm.v1.engine.async_llm import AsyncLLM

from bench.config import BenchConfig
from bench.cpu import descendants
from bench.path_run import parse_path_args, write_results
from bench.prompts import Prompt, sample_prompts
from bench.timing import PathResult, measure_levels


def engine_args(config: BenchConfig) -> AsyncEngineArgs:
    """The engine arguments parsed from the same flags the worker and ``vllm serve`` get."""
    parser = FlexibleArgumentParser()
    AsyncEngineArgs.add_cli_args(parser)
    args: AsyncEngineArgs = AsyncEngineArgs.from_cli_args(parser.parse_args(config.engine_flags()))
    return args


async def measure(config: BenchConfig) -> list[PathResult]:
    engine = AsyncLLM.from_engine_args(engine_args(config))
    try:

        async def stream(prompt: Prompt) -> AsyncIterator[int]:
            params = SamplingParams(
                max_tokens=prompt.output_len, ignore_eos=True, temperature=0, output_kind=RequestOutputKind.DELTA
            )
            request_id = uuid.uuid4().hex
            async for output in engine.generate(request_id=request_id, prompt=prompt.text, sampling_params=params):
                tokens = sum(len(c.token_ids) for c in output.outputs)
                if tokens:
                    yield tokens
                if output.finished:
                    break

        roles = {"front_end": [os.getpid()], "engine_core": descendants(os.getpid())}
        return await measure_levels(
            "a", stream, lambda c: sample_prompts(config, config.prompts_for(c)), config.concurrencies, roles
        )
    finally:
        engine.shutdown()


def main() -> None:
    config, out = parse_path_args(__doc__.splitlines()[0])
    write_results(out, asyncio.run(measure(config)))


if __name__ == "__main__":
    main()
