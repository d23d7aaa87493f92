"""An engine whose model always writes the same tokens, for tests that must place each
token: ``AsyncLLM``'s interface as the worker uses it, no model.

Its outputs carry text and stop strings as vLLM's output processor makes them (its
incremental detokenizer, on a real tokenizer), so a take-over's continuation can be checked
against it. A gated engine lets tokens out only as the test releases them, one per output
or several in one (as an engine whose output handler lags delivers them).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any


class ScriptedEngine:
    """Writes ``script`` (token ids) after ``prompt_ids``; a prompt that already holds the
    script's first tokens (a take-over's continuation) gets the rest.

    :param gated: outputs wait for ``release``; else each token is one output at once.
    """

    def __init__(self, tokenizer: Any, prompt_ids: list[int], script: list[int], *, gated: bool = False) -> None:
        self.tokenizer, self.prompt_ids, self.script = tokenizer, prompt_ids, script
        self.gated = gated
        self.started = asyncio.Event()
        """Set when a request starts generating."""
        self._releases: asyncio.Queue[int] = asyncio.Queue()
        self.vllm_config = SimpleNamespace(
            scheduler_config=SimpleNamespace(max_num_seqs=8, policy="fcfs"),
            model_config=SimpleNamespace(model="scripted", max_model_len=4096),
        )

    def release(self, tokens: int, *, together: bool = False) -> None:
        """Let ``tokens`` more tokens out: one output each, or all in one output."""
        for size in [tokens] if together else [1] * tokens:
            self._releases.put_nowait(size)

    def get_tokenizer(self) -> Any:
        return self.tokenizer

    def shutdown(self) -> None:
        pass

    async def generate(
        self, request_id: str, prompt: Any, sampling_params: Any, priority: int = 0
    ) -> AsyncIterator[Any]:
        from vllm.outputs import CompletionOutput, RequestOutput
        from vllm.v1.engine.detokenizer import IncrementalDetokenizer

        # A plain prompt is tokenized as vLLM's renderer does (with special tokens).
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else prompt["prompt_token_ids"]
        assert ids[: len(self.prompt_ids)] == self.prompt_ids
        done = len(ids) - len(self.prompt_ids)
        assert ids[len(self.prompt_ids) :] == self.script[:done]
        request = SimpleNamespace(request_id=request_id, prompt_token_ids=ids, prompt_embeds=None)
        request.sampling_params = sampling_params
        detokenizer = IncrementalDetokenizer.from_new_request(
            self.tokenizer if sampling_params.detokenize else None,
            request,  # type: ignore[arg-type]
        )
        rest = self.script[done : done + sampling_params.max_tokens]
        self.started.set()
        sent = 0
        while sent < len(rest):
            size = await self._releases.get() if self.gated else 1
            tokens, finish, stop = rest[sent : sent + size], None, None
            sent += len(tokens)
            stop = detokenizer.update(tokens, False)
            if stop:
                finish = "stop"
            elif sent == len(rest):
                finish = "length"
            text = detokenizer.get_next_output_text(finish is not None, delta=True)
            completion = CompletionOutput(0, text, tokens, None, None, finish_reason=finish, stop_reason=stop)
            yield RequestOutput(request_id, None, ids, None, [completion], finish is not None)
            if finish:
                return


def given(engine: Any) -> Any:
    """``--engine-factory tests.scripted_engine:given`` with the engine as its arguments:
    an in-process worker runs the engine the test built."""
    return engine
