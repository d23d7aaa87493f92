"""Generate with a bare AsyncLLM, as vLLM's async_llm_streaming.py example does, for comparison.

``bare_engine_outputs`` runs this file as a script (the engine spawns processes, so it
needs a __main__ guard):
    python tests/support/reference_generate.py MODEL_DIR MAX_MODEL_LEN MAX_TOKENS PROMPT...
which prints one JSON object: prompt -> {"text": ..., "token_ids": [...]}.
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


def bare_engine_outputs(model: Path, max_model_len: int) -> dict[str, dict]:
    """What a bare AsyncLLM generates for ``PROMPTS`` at temperature 0, ``MAX_TOKENS`` each."""
    from devkit.worker_process import worker_env

    result = subprocess.run(
        [sys.executable, __file__, str(model), str(max_model_len), str(MAX_TOKENS), *PROMPTS],
        capture_output=True,
        text=True,
        env=worker_env(),
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    line = next(line for line in result.stdout.splitlines() if line.startswith("REFERENCE "))
    return json.loads(line.removeprefix("REFERENCE "))


async def generate_all(model: str, max_model_len: int, max_tokens: int, prompts: list[str]) -> dict[str, dict]:
    from vllm import SamplingParams
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.sampling_params import RequestOutputKind
    from vllm.v1.engine.async_llm import AsyncLLM

    engine = AsyncLLM.from_engine_args(
        AsyncEngineArgs(model=model, dtype="float32", max_model_len=max_model_len, enforce_eager=True)
    )
    results: dict[str, dict] = {}
    try:
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, output_kind=RequestOutputKind.DELTA)
        for i, prompt in enumerate(prompts):
            text, token_ids = [], []
            async for output in engine.generate(request_id=f"ref-{i}", prompt=prompt, sampling_params=params):
                for completion in output.outputs:
                    text.append(completion.text)
                    token_ids.extend(completion.token_ids)
                if output.finished:
                    break
            results[prompt] = {"text": "".join(text), "token_ids": token_ids}
    finally:
        engine.shutdown()
    return results


if __name__ == "__main__":
    model, max_model_len, max_tokens, *prompts = sys.argv[1:]
    out = asyncio.run(generate_all(model, int(max_model_len), int(max_tokens), prompts))
    print("REFERENCE " + json.dumps(out))
