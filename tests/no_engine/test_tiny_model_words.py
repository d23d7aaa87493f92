"""The demo's tiny model (``vocabulary="words"``): whatever ids its random weights sample,
the text streamed is English words separated by spaces, and chat still renders."""

from __future__ import annotations

import random
import re
import string
from pathlib import Path

from tokenizers.decoders import DecodeStream
from transformers import AutoTokenizer

from devkit.demo import PROMPTS
from devkit.tiny_model import build_tiny_model


def test_random_tokens_stream_as_words(tmp_path: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(build_tiny_model(tmp_path / "words", vocabulary="words"))
    prompt_ids = tokenizer.encode(PROMPTS[0])
    assert tokenizer.unk_token_id not in prompt_ids
    rng = random.Random(0)
    sampled = [rng.randrange(len(tokenizer)) for _ in range(300)]
    # As vLLM detokenizes a stream: a decode stream primed with the prompt, one token at a time.
    stream = DecodeStream(ids=prompt_ids, skip_special_tokens=True)
    text = "".join(stream.step(tokenizer.backend_tokenizer, token_id) or "" for token_id in sampled)
    assert text.startswith(" ")
    assert set(text) <= set(string.ascii_lowercase + " .,!?")
    assert set(re.findall(r"[a-z]+", text)) <= set(tokenizer.get_vocab())


def test_chat_renders_with_the_template(tmp_path: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(build_tiny_model(tmp_path / "words", vocabulary="words"))
    messages = [{"role": "user", "content": "Hello! How are you today?"}]
    ids = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    assert tokenizer.decode(ids) == "<|im_start|> user hello! how are you today? <|im_end|> <|im_start|> assistant"
