"""Generate with a bare AsyncLLM, as vLLM's async_llm_streaming.py example does, for comparison.

``bare_engine_outputs`` runs this file as a script (the engine spawns processes, so it
needs a __main__ guard):
    python tests/support/reference_generate.py MODEL_DIR MAX_MODEL_LEN MAX_TOKENS [--lora NAME=PATH]... PROMPT...
which prints one JSON object: adapter ("" for the base model) -> prompt -> {"text": ...,
"token_ids": [...]}. With adapters, the engine runs with LoRA on and each prompt under the
base model and each adapter, one request at a time.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

PROMPTS = [
    "The future of artificial intelligence is",
    "In a galaxy far, far away",
    "The key to happiness is",
]
MAX_TOKENS = 24
LORA_RANK = 8
"""The rank of the tests' adapters (``devkit/tiny_adapter.py``'s default): ``--max-lora-rank``."""


def bare_engine_outputs(model: Path, max_model_len: int) -> dict[str, dict]:
    """What a bare AsyncLLM generates for ``PROMPTS`` at temperature 0, ``MAX_TOKENS`` each."""
    return bare_engine_lora_outputs(model, max_model_len, {})[""]


def bare_engine_lora_outputs(model: Path, max_model_len: int, adapters: dict[str, Path]) -> dict[str, dict[str, dict]]:
    """``bare_engine_outputs`` under the base model ("") and each of ``adapters`` (name ->
    directory), each with vLLM's ``LoRARequest`` as ``vllm serve`` would pass it."""
    from devkit.worker_process import worker_env

    loras = [f"--lora={name}={path}" for name, path in adapters.items()]
    result = subprocess.run(
        [sys.executable, __file__, str(model), str(max_model_len), str(MAX_TOKENS), *loras, *PROMPTS],
        capture_output=True,
        text=True,
        env=worker_env(),
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    line = next(line for line in result.stdout.splitlines() if line.startswith("REFERENCE "))
    return json.loads(line.removeprefix("REFERENCE "))


async def generate_all(
    model: str, max_model_len: int, max_tokens: int, prompts: list[str], adapters: dict[str, str]
) -> dict[str, dict[str, dict]]:
    from vllm import SamplingParams
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.lora.request import LoRARequest
    from vllm.sampling_params import RequestOutputKind
    from vllm.v1.engine.async_llm import AsyncLLM

    lora = {"enable_lora": True, "max_loras": len(adapters), "max_lora_rank": LORA_RANK} if adapters else {}
    engine = AsyncLLM.from_engine_args(
        AsyncEngineArgs(model=model, dtype="float32", max_model_len=max_model_len, enforce_eager=True, **lora)
    )
    requests = {"": None} | {name: LoRARequest(name, i + 1, path) for i, (name, path) in enumerate(adapters.items())}
    results: dict[str, dict[str, dict]] = {}
    try:
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, output_kind=RequestOutputKind.DELTA)
        for name, lora_request in requests.items():
            results[name] = {}
            for i, prompt in enumerate(prompts):
                text, token_ids = [], []
                outputs = engine.generate(
                    request_id=f"ref-{name}-{i}", prompt=prompt, sampling_params=params, lora_request=lora_request
                )
                async for output in outputs:
                    for completion in output.outputs:
                        text.append(completion.text)
                        token_ids.extend(completion.token_ids)
                    if output.finished:
                        break
                results[name][prompt] = {"text": "".join(text), "token_ids": token_ids}
    finally:
        engine.shutdown()
    return results


if __name__ == "__main__":
    model, max_model_len, max_tokens, *rest = sys.argv[1:]
    adapters = dict(arg.removeprefix("--lora=").split("=", 1) for arg in rest if arg.startswith("--lora="))
    prompts = [arg for arg in rest if not arg.startswith("--lora=")]
    out = asyncio.run(generate_all(model, int(max_model_len), int(max_tokens), prompts, adapters))
    print("REFERENCE " + json.dumps(out))
