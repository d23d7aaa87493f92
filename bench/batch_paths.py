"""vLLM's own ways to run a batch, the yardsticks of ``python -m bench.batch``, each run in a
process of its own (one engine at a time): ``python -m bench.batch_paths PATH CONFIG OUT``.

- ``offline``: ``vllm.LLM(...).chat(conversations, params)`` (``generate`` after the chat
  template), or ``generate(prompts, params)`` for completions, every prompt at once.
- ``run-batch``: ``vllm run-batch``'s own ``run_batch`` over the batch file, on the engine
  client its ``main`` builds.
- ``final-only``: a bare ``AsyncLLM`` with every prompt at once (a chat rendered with the
  chat template in the window, as the worker renders it; a completion's text as given) and
  ``RequestOutputKind.FINAL_ONLY``: what a worker's process adds to the engine's own front
  end is measured against this process.

Every prompt is one user message of a chat (``vllm run-batch`` has no other generation
endpoint), or with ``--endpoint completions`` a completion's prompt (no ``run-batch`` path).

Each is timed from its first request to its last output, after a warm-up batch; the engine's
start is not counted. CPU: this process (``front_end``) and its children (``engine_core``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import sys
import time
import uuid
from argparse import Namespace
from pathlib import Path
from typing import Any

from vllm import LLM, SamplingParams
from vllm.engine.arg_utils import AsyncEngineArgs, EngineArgs
from vllm.inputs import TokensPrompt
from vllm.sampling_params import RequestOutputKind
from vllm.utils.argparse_utils import FlexibleArgumentParser
from vllm.v1.engine.async_llm import AsyncLLM

from bench.batch_config import BatchBenchConfig, completion_text, conversation
from bench.cpu import CpuWindow, descendants

WARM_UP_PROMPTS = 8


def _engine_args(config: BatchBenchConfig, kind: type[EngineArgs]) -> EngineArgs:
    parser = FlexibleArgumentParser()
    kind.add_cli_args(parser)
    args: EngineArgs = kind.from_cli_args(parser.parse_args(config.engine_flags()))
    return args


def _roles() -> dict[str, list[int]]:
    return {"front_end": [os.getpid()], "engine_core": descendants(os.getpid())}


def _params(config: BatchBenchConfig, **extra: Any) -> SamplingParams:
    return SamplingParams(max_tokens=config.output_len, temperature=0, ignore_eos=True, **extra)


def offline(config: BatchBenchConfig) -> dict[str, Any]:
    """``LLM.chat`` over every prompt at once: vLLM's offline batch inference."""
    args = _engine_args(config, EngineArgs)
    defaults = EngineArgs(model=args.model)
    given = {
        f.name: getattr(args, f.name)
        for f in dataclasses.fields(EngineArgs)
        if f.init and getattr(args, f.name) != getattr(defaults, f.name)
    }
    llm = LLM(model=args.model, **{k: v for k, v in given.items() if k != "model"})
    if config.endpoint == "completions":
        prompts: list[Any] = config.prompts()
        run = llm.generate
    else:
        prompts = [conversation(p) for p in config.prompts()]
        run = llm.chat  # type: ignore[assignment]
    run(prompts[:WARM_UP_PROMPTS], _params(config), use_tqdm=False)
    cpu = CpuWindow(_roles())
    cpu.start()
    started = time.perf_counter()
    outputs = run(prompts, _params(config), use_tqdm=False)
    wall_s = time.perf_counter() - started
    window = cpu.stop()
    texts = {config.custom_id(i): output.outputs[0].text for i, output in enumerate(outputs)}
    tokens = sum(len(output.outputs[0].token_ids) for output in outputs)
    return {"wall_s": wall_s, "tokens": tokens, "texts": texts, "cpu_s": window.seconds}


async def _run_batch(config: BatchBenchConfig) -> dict[str, Any]:
    from vllm.entrypoints.launchers.api_server.entry import build_async_engine_client
    from vllm.entrypoints.launchers.run_batch import make_arg_parser, run_batch, validate_run_batch_args
    from vllm.usage.usage_lib import UsageContext

    results = Path(config.results_dir)
    warm_up, batch = results / f"{config.run_id}-warm-up.jsonl", results / f"{config.run_id}-batch.jsonl"
    warm_out, out = (
        results / f"{config.run_id}-run-batch-warm-up-out.jsonl",
        results / f"{config.run_id}-run-batch-out.jsonl",
    )
    parser = make_arg_parser(FlexibleArgumentParser())
    args: Namespace = parser.parse_args(["-i", str(batch), "-o", str(out), *config.engine_flags()])
    validate_run_batch_args(args)
    async with build_async_engine_client(args, usage_context=UsageContext.OPENAI_BATCH_RUNNER) as engine_client:
        await run_batch(
            engine_client, Namespace(**{**vars(args), "input_file": str(warm_up), "output_file": str(warm_out)})
        )
        cpu = CpuWindow(_roles())
        cpu.start()
        started = time.perf_counter()
        await run_batch(engine_client, args)
        wall_s = time.perf_counter() - started
        window = cpu.stop()
    texts, tokens = {}, 0
    for raw in out.read_text().splitlines():
        line = json.loads(raw)
        body = line["response"]["body"]
        texts[line["custom_id"]] = completion_text(body)
        tokens += body["usage"]["completion_tokens"]
    return {"wall_s": wall_s, "tokens": tokens, "texts": texts, "cpu_s": window.seconds}


async def _final_only(config: BatchBenchConfig) -> dict[str, Any]:
    engine = AsyncLLM.from_engine_args(_engine_args(config, AsyncEngineArgs))  # type: ignore[arg-type]
    params = _params(config, output_kind=RequestOutputKind.FINAL_ONLY)

    tokenizer: Any = engine.get_tokenizer()

    async def one(prompt: str) -> tuple[str, int]:
        given: str | TokensPrompt = prompt  # a completion's text, tokenized by vLLM
        if config.endpoint != "completions":
            text = tokenizer.apply_chat_template(conversation(prompt), tokenize=False, add_generation_prompt=True)
            given = TokensPrompt(prompt_token_ids=tokenizer.encode(text, add_special_tokens=False))
        async for output in engine.generate(request_id=uuid.uuid4().hex, prompt=given, sampling_params=params):
            if output.finished:
                return output.outputs[0].text, len(output.outputs[0].token_ids)
        raise RuntimeError("the engine ended a request without a finished output")

    try:
        prompts = config.prompts()
        await asyncio.gather(*(one(p) for p in prompts[:WARM_UP_PROMPTS]))
        cpu = CpuWindow(_roles())
        cpu.start()
        started = time.perf_counter()
        done = await asyncio.gather(*(one(p) for p in prompts))
        wall_s = time.perf_counter() - started
        window = cpu.stop()
    finally:
        engine.shutdown()
    texts = {config.custom_id(i): text for i, (text, _) in enumerate(done)}
    return {"wall_s": wall_s, "tokens": sum(t for _, t in done), "texts": texts, "cpu_s": window.seconds}


PATHS = {
    "offline": offline,
    "run-batch": lambda config: asyncio.run(_run_batch(config)),
    "final-only": lambda config: asyncio.run(_final_only(config)),
}


def main() -> None:
    path, config_path, out = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
    config = BatchBenchConfig.load(config_path)
    result = PATHS[path](config)
    print(f"[{path}] {result['tokens']} tokens in {result['wall_s']:.2f}s", flush=True)
    out.write_text(json.dumps(result))


if __name__ == "__main__":
    main()
