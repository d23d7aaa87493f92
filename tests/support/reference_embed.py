"""Embed with vLLM's offline ``LLM(runner="pooling", convert="embed").embed``, for comparison.

``offline_embeddings`` runs this file as a script (the engine spawns processes, so it needs a
__main__ guard): ``python tests/support/reference_embed.py MODEL_DIR MAX_MODEL_LEN`` with a
JSON object on stdin (``inputs``: texts and token-id lists; ``tokenize``: texts to tokenize;
``dimensions``: a value to ask for), and prints one JSON line: each input's vector and token
count, each text's token ids, and vLLM's error for ``dimensions`` (or null where it took it).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any


def offline_embeddings(
    model: Path, max_model_len: int, inputs: list[str | list[int]], tokenize: list[str], dimensions: int
) -> dict[str, Any]:
    """What vLLM's offline ``LLM.embed`` answers for ``inputs`` (one call, all of them)."""
    from devkit.worker_process import worker_env

    spec = json.dumps({"inputs": inputs, "tokenize": tokenize, "dimensions": dimensions})
    result = subprocess.run(
        [sys.executable, __file__, str(model), str(max_model_len)],
        input=spec,
        capture_output=True,
        text=True,
        env=worker_env(),
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    line = next(line for line in result.stdout.splitlines() if line.startswith("REFERENCE "))
    return dict(json.loads(line.removeprefix("REFERENCE ")))


def embed_all(model: str, max_model_len: int, spec: dict[str, Any]) -> dict[str, Any]:
    from vllm import LLM, PoolingParams
    from vllm.exceptions import VLLMValidationError
    from vllm.inputs import TokensPrompt

    llm = LLM(
        model=model,
        runner="pooling",
        convert="embed",
        dtype="float32",
        max_model_len=max_model_len,
        enforce_eager=True,
    )
    prompts = [item if isinstance(item, str) else TokensPrompt(prompt_token_ids=item) for item in spec["inputs"]]
    outputs = llm.embed(prompts, use_tqdm=False)
    tokenizer = llm.get_tokenizer()
    try:
        llm.embed(["Hello"], use_tqdm=False, pooling_params=PoolingParams(dimensions=spec["dimensions"]))
        dimensions_error = None
    except (VLLMValidationError, ValueError) as exc:
        dimensions_error = str(exc)
    return {
        "vectors": [output.outputs.embedding for output in outputs],
        "prompt_tokens": [len(output.prompt_token_ids) for output in outputs],
        "token_ids": [tokenizer.encode(text) for text in spec["tokenize"]],
        "dimensions_error": dimensions_error,
    }


if __name__ == "__main__":
    model_dir, max_len = sys.argv[1:3]
    print("REFERENCE " + json.dumps(embed_all(model_dir, int(max_len), json.load(sys.stdin))))
