"""What one run of ``python -m bench.batch`` measures, shared by the parent and the paths'
processes: the model, the engine flags, the prompts and the batch file made of them."""

from __future__ import annotations

import json
import os
import shlex
from dataclasses import asdict, dataclass
from functools import cache
from pathlib import Path
from typing import Any

from bench.config import ENGINE_FLAGS_ENV, SERVE_MAX_NUM_BATCHED_TOKENS
from devkit.worker_process import tiny_engine_flags


@dataclass(frozen=True)
class BatchBenchConfig:
    """One side-by-side run: a batch of ``num_prompts`` greedy requests of ``output_len`` tokens."""

    model_dir: str
    num_prompts: int
    input_len: int
    output_len: int
    max_num_seqs: int
    seed: int
    results_dir: str
    run_id: str
    endpoint: str = "chat"
    """``chat``: one user message a line (``/v1/chat/completions``, offline ``LLM.chat``);
    ``completions``: the prompt as text (``/v1/completions``, offline ``LLM.generate``)."""

    def engine_flags(self) -> list[str]:
        """The engine flags of every path, as ``vllm serve`` spells them."""
        return [
            *tiny_engine_flags(self.model_dir, max_model_len=self.input_len + self.output_len + 64),
            "--max-num-seqs",
            str(self.max_num_seqs),
            "--max-num-batched-tokens",
            str(SERVE_MAX_NUM_BATCHED_TOKENS),
            *shlex.split(os.environ.get(ENGINE_FLAGS_ENV, "")),
        ]

    def custom_id(self, index: int) -> str:
        return f"request-{index}"

    def prompts(self) -> list[str]:
        """``num_prompts`` prompts of vLLM's ``random`` dataset, ``input_len`` tokens each."""
        return list(_prompts(self.model_dir, self.num_prompts, self.input_len, self.output_len, self.seed))

    def batch_lines(self, prompts: list[str]) -> list[str]:
        """The batch file: one request a prompt, a chat (``/v1/chat/completions``, the
        generation endpoint ``vllm run-batch`` reads) or a completion (``/v1/completions``)."""
        return [json.dumps(self._line(i, prompt)) for i, prompt in enumerate(prompts)]

    def _line(self, index: int, prompt: str) -> dict[str, Any]:
        greedy = {"model": self.model_dir, "temperature": 0, "ignore_eos": True}
        if self.endpoint == "completions":
            body = {**greedy, "prompt": prompt, "max_tokens": self.output_len}
            return {"custom_id": self.custom_id(index), "method": "POST", "url": "/v1/completions", "body": body}
        body = {**greedy, "messages": conversation(prompt), "max_completion_tokens": self.output_len}
        return {"custom_id": self.custom_id(index), "method": "POST", "url": "/v1/chat/completions", "body": body}

    def save(self, path: Path) -> None:
        path.write_text(json.dumps(asdict(self)))

    @classmethod
    def load(cls, path: Path) -> BatchBenchConfig:
        return cls(**json.loads(path.read_text()))


@cache
def _prompts(model_dir: str, count: int, input_len: int, output_len: int, seed: int) -> tuple[str, ...]:
    from vllm.benchmarks.datasets import RandomDataset
    from vllm.tokenizers import get_tokenizer

    tokenizer = get_tokenizer(model_dir, tokenizer_mode="auto", trust_remote_code=False)
    requests = RandomDataset(random_seed=seed).sample(
        tokenizer=tokenizer, num_requests=count, input_len=input_len, output_len=output_len, range_ratio=0.0
    )
    return tuple(str(r.prompt) for r in requests)


def conversation(prompt: str) -> list[dict[str, str]]:
    """The chat every path sends for ``prompt``: one user message."""
    return [{"role": "user", "content": prompt}]


def completion_text(body: dict[str, Any]) -> str:
    """The text of a response body's first choice (a chat's message, or a completion's text)."""
    choice = body["choices"][0]
    return str(choice["message"]["content"] if "message" in choice else choice["text"])
