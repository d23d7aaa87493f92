"""Generate a LoRA adapter for the tiny model, offline (peft; a test dependency).

peft's default initialisation sets B to zero, so an adapter would leave the text as the
base model writes it; ``init_lora_weights=False`` draws A and B at random, and each
seed's adapter visibly changes the text. The adapter names the model's directory as its
base (``base_model_name_or_path``), which vLLM's filesystem resolver checks.
"""

from __future__ import annotations

import argparse
from pathlib import Path

TARGET_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def build_tiny_adapter(model_dir: Path, out_dir: Path, *, seed: int, rank: int = 8) -> Path:
    """A random rank-``rank`` adapter of ``model_dir`` in ``out_dir`` (reused if there)."""
    if (out_dir / "adapter_config.json").exists():
        return out_dir
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(str(model_dir))
    config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=TARGET_MODULES, init_lora_weights=False)
    model = get_peft_model(base, config)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out_dir))
    return out_dir


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model_dir", type=Path)
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rank", type=int, default=8)
    args = parser.parse_args()
    print(build_tiny_adapter(args.model_dir, args.out_dir, seed=args.seed, rank=args.rank))


if __name__ == "__main__":
    main()
