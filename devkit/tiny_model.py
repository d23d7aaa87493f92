"""Generate a tiny random-weight Llama model with its own tokenizer, offline.

Tests and the demo run the real vLLM engine without downloading a model: a two-layer
Llama with random weights and a byte-level BPE tokenizer loads like any hub model (its
text is noise). Generation is deterministic, so the same directory is reused.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

DEFAULT_DIR = Path(".cache/tiny-llama")

# Enough text for the BPE trainer to learn merges over plain English.
_CORPUS = [
    "The future of artificial intelligence is bright and uncertain.",
    "In a galaxy far, far away, a small ship drifted between the stars.",
    "The key to happiness is a quiet mind and good friends.",
    "Redis streams carry tokens from workers to the people who wait for them.",
    "A queue decouples producers from the machines that do the work.",
    "Hello! How are you today? I am fine, thank you for asking.",
    "Numbers like 0 1 2 3 4 5 6 7 8 9 appear in text too, with symbols: #$%&*+-=/<>@[]{}|~^_`'\"().,;:?!",
]

# A ChatML-style template, as many instruct models use; rendered by the tokenizer.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

_SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def build_tiny_model(out_dir: Path = DEFAULT_DIR, *, max_position_embeddings: int = 1024) -> Path:
    """Write config, random weights and tokenizer to ``out_dir`` (skipped if present, or if
    ``out_dir`` holds ``devkit.gpu_model``'s model, which ``python -m bench --model-dir`` runs)."""
    out_dir = Path(out_dir)
    marker = out_dir / "streamq-tiny-model.json"
    if marker.exists() or (out_dir / "streamq-gpu-model.json").exists():
        return out_dir

    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=384,
        special_tokens=_SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(_CORPUS * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token="<|endoftext|>",
        bos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out_dir)

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(fast),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,  # head_dim 64: the CPU attention backend rejects smaller
        num_key_value_heads=2,
        max_position_embeddings=max_position_embeddings,
        bos_token_id=fast.bos_token_id,
        eos_token_id=fast.eos_token_id,
        pad_token_id=fast.pad_token_id,
        tie_word_embeddings=False,
        dtype="float32",
    )
    LlamaForCausalLM(config).save_pretrained(out_dir)
    marker.write_text(json.dumps({"vocab_size": len(fast), "layers": 2}))
    return out_dir


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", nargs="?", type=Path, default=DEFAULT_DIR)
    print(build_tiny_model(parser.parse_args().out_dir))


if __name__ == "__main__":
    main()
