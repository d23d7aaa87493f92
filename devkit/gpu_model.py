"""A 1B-class Llama for GPU benchmarks, offline: a config with Llama-3.2-1B's shapes and a
locally generated tokenizer, no weights (run it with ``--load-format dummy``).

A GPU host without hub access can then run the engine at a real model's cost per token: the
same layers, widths and 128,256-entry vocabulary (the LM head is a large part of a small
model's work), random weights. The tokenizer is a word-level one over that whole vocabulary
(``w0`` ... ``w128255`` and the special tokens), so every id the model samples decodes to
text and random prompts re-encode to the same ids.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from devkit.tiny_model import SPECIAL_TOKENS, fast_tokenizer, word_level_tokenizer

DEFAULT_DIR = Path(".cache/llama-1b-dummy")
VOCAB_SIZE = 128_256

LLAMA_3_2_1B_SHAPES: dict[str, Any] = {
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "num_hidden_layers": 16,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "rope_theta": 500_000.0,
    "rope_scaling": {
        "factor": 32.0,
        "high_freq_factor": 4.0,
        "low_freq_factor": 1.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": True,
    "max_position_embeddings": 131_072,
}
"""The published config of meta-llama/Llama-3.2-1B (1.24B parameters)."""


def build_gpu_model(out_dir: Path = DEFAULT_DIR, *, layers: int | None = None) -> Path:
    """Write ``config.json`` and the tokenizer to ``out_dir`` (skipped if present).
    ``layers`` overrides the layer count (a quick check on a CPU loads a one-layer model)."""
    out_dir = Path(out_dir)
    marker = out_dir / "streamq-gpu-model.json"
    if marker.exists() and json.loads(marker.read_text()).get("layers") == (layers or 16):
        return out_dir

    from transformers import LlamaConfig

    out_dir.mkdir(parents=True, exist_ok=True)
    words = [f"w{i}" for i in range(len(SPECIAL_TOKENS), VOCAB_SIZE)]
    fast = fast_tokenizer(
        word_level_tokenizer([*SPECIAL_TOKENS, *words], SPECIAL_TOKENS[0]), unk_token=SPECIAL_TOKENS[0]
    )
    fast.save_pretrained(out_dir)

    shapes: dict[str, Any] = dict(LLAMA_3_2_1B_SHAPES)
    if layers is not None:
        shapes["num_hidden_layers"] = layers
    config = LlamaConfig(
        vocab_size=VOCAB_SIZE,
        bos_token_id=fast.bos_token_id,
        eos_token_id=fast.eos_token_id,
        pad_token_id=fast.pad_token_id,
        dtype="bfloat16",
        **shapes,
    )
    config.save_pretrained(out_dir)
    marker.write_text(json.dumps({"vocab_size": VOCAB_SIZE, "layers": shapes["num_hidden_layers"]}))
    return out_dir


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", nargs="?", type=Path, default=DEFAULT_DIR)
    parser.add_argument("--layers", type=int, help="layer count (default: Llama-3.2-1B's 16)")
    args = parser.parse_args()
    print(build_gpu_model(args.out_dir, layers=args.layers))


if __name__ == "__main__":
    main()
