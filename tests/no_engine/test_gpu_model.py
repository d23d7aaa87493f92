"""The GPU benchmark's model directory loads offline with a 1B Llama's shapes, and every token
id the model can sample decodes to text that encodes back to the same ids."""

from __future__ import annotations

import random
from pathlib import Path

from transformers import AutoConfig, AutoTokenizer

from devkit.gpu_model import LLAMA_3_2_1B_SHAPES, VOCAB_SIZE, build_gpu_model
from devkit.tiny_model import build_tiny_model


def test_the_model_has_llama_1b_shapes_and_a_tokenizer_over_its_whole_vocabulary(tmp_path: Path) -> None:
    model = build_gpu_model(tmp_path / "model")
    config = AutoConfig.from_pretrained(model)
    tokenizer = AutoTokenizer.from_pretrained(model)
    for name in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads"):
        assert getattr(config, name) == LLAMA_3_2_1B_SHAPES[name]
    assert config.vocab_size == len(tokenizer) == VOCAB_SIZE
    rng = random.Random(0)
    ids = [rng.randrange(3, VOCAB_SIZE) for _ in range(200)] + [VOCAB_SIZE - 1]
    text = tokenizer.decode(ids)
    assert tokenizer.encode(text, add_special_tokens=False) == ids
    assert tokenizer.eos_token_id == config.eos_token_id
    assert "<|im_start|>assistant" in tokenizer.apply_chat_template(
        [{"role": "user", "content": "w5 w6"}], tokenize=False, add_generation_prompt=True
    )


def test_the_benchmark_runs_the_gpu_model_where_it_would_build_the_tiny_one(tmp_path: Path) -> None:
    model = build_gpu_model(tmp_path / "model", layers=1)
    before = (model / "config.json").read_text()
    assert build_tiny_model(model) == model
    assert (model / "config.json").read_text() == before
