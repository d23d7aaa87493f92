"""The requests every path sends: vLLM's own ``random`` benchmark dataset.

``vllm bench serve --dataset-name random --seed S`` builds its prompts with
``RandomDataset(random_seed=S).sample(...)``; calling the same code with the same
tokenizer and arguments gives paths (a) and (b) exactly the prompts that path (c)
sends, each ``input_len`` tokens long.
"""

from __future__ import annotations

from dataclasses import dataclass

from vllm.benchmarks.datasets import RandomDataset
from vllm.tokenizers import get_tokenizer

from bench.config import BenchConfig


@dataclass(frozen=True)
class Prompt:
    text: str
    prompt_len: int
    output_len: int


def sample_prompts(config: BenchConfig, num_prompts: int) -> list[Prompt]:
    """The prompts ``vllm bench serve`` sends for this configuration and count."""
    tokenizer = get_tokenizer(config.model_dir, tokenizer_mode="auto", trust_remote_code=False)
    requests = RandomDataset(random_seed=config.seed).sample(
        tokenizer=tokenizer,
        num_requests=num_prompts,
        input_len=config.input_len,
        output_len=config.output_len,
        range_ratio=0.0,
    )
    return [Prompt(str(r.prompt), r.prompt_len, r.expected_output_len) for r in requests]
