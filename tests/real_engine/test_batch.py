"""``python -m producer batch``: an OpenAI batch file through the queue, as a user runs it.

The command runs as a real subprocess against the session's Redis and worker.
"""

from __future__ import annotations

import json
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

from devkit.worker_process import WorkerProcess
from tests.support.metrics import request_events, scrape

with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)  # torch's own, raised while vLLM imports
    from vllm.entrypoints.openai.chat_completion import protocol as chat_protocol
    from vllm.entrypoints.openai.completion import protocol as completion_protocol


def _request(custom_id: str, url: str, body: dict[str, Any]) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body})


def input_lines(model: str) -> list[str]:
    """A batch file's lines for the worker serving ``model``: good ones, and bad ones of every kind."""
    return [
        _request(
            "plain",
            "/v1/completions",
            {
                "model": model,
                "prompt": "The key to happiness is",
                "max_tokens": 5,
                "temperature": 0,
                "ignore_eos": True,
            },
        ),
        _request(
            "chat",
            "/v1/chat/completions",
            {
                "model": model,
                "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello!"}],
                "max_completion_tokens": 4,
                "ignore_eos": True,
            },
        ),
        _request("two", "/v1/completions", {"prompt": "Once upon a time", "n": 2, "max_tokens": 3, "ignore_eos": True}),
        "{this line is not JSON",
        _request(  # a token-id prompt scored as lm-evaluation-harness scores one
            "echo",
            "/v1/completions",
            {"prompt": [5, 17, 42, 99], "echo": True, "logprobs": 1, "max_tokens": 1, "temperature": 0},
        ),
        _request("several", "/v1/completions", {"prompt": ["Hi", "Yo"], "max_tokens": 2}),
        _request("cold", "/v1/completions", {"prompt": "Hi", "temperature": -1.0}),
        "",
        json.dumps({"custom_id": "moderate", "method": "POST", "url": "/v1/moderations", "body": {"input": "x"}}),
        _request("nobody", "/v1/completions", {"model": "no-such-model", "prompt": "Hi", "max_tokens": 2}),
    ]


def _run_batch(
    worker: WorkerProcess, producer_url: str, in_path: Path, out_path: Path
) -> subprocess.CompletedProcess[str]:
    """The batch command on the session worker's queue, as the producer role."""
    command = [sys.executable, "-m", "producer", "batch", str(in_path), str(out_path)]
    command += ["--redis-url", producer_url, "--queue", worker.queue, "--max-in-flight", "2", "--no-progress"]
    return subprocess.run(command, capture_output=True, text=True, timeout=240)


def _lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_batch_file_runs_through_the_queue_and_a_rerun_skips_what_is_done(
    worker: WorkerProcess, producer_url: str, tmp_path: Path, tiny_model: Path
) -> None:
    model = str(tiny_model)
    in_path, out_path = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    in_path.write_text("\n".join(input_lines(model)) + "\n")

    before = scrape(worker)
    first = _run_batch(worker, producer_url, in_path, out_path)
    after = scrape(worker)

    assert first.returncode == 1, first.stderr  # some lines failed, and it says so
    # Five lines reached the worker (four answered, one refused by vLLM there), none streamed.
    assert request_events(after, streamed=False)[1] - request_events(before, streamed=False)[1] == 5
    assert request_events(after, streamed=True) == request_events(before, streamed=True)
    assert "4 succeeded, 5 failed, 0 skipped" in first.stderr
    lines = _lines(out_path)
    assert len(lines) == 9
    by_id = {line["custom_id"]: line for line in lines}
    assert len({line["id"] for line in lines}) == 9
    assert len({line["response"]["request_id"] for line in lines}) == 9

    plain = by_id["plain"]
    assert plain["error"] is None and plain["response"]["status_code"] == 200
    body = plain["response"]["body"]
    assert body["object"] == "text_completion" and body["model"] == model
    assert [c["finish_reason"] for c in body["choices"]] == ["length"]
    assert body["usage"]["completion_tokens"] == 5
    assert body["usage"]["total_tokens"] == body["usage"]["prompt_tokens"] + 5

    chat = by_id["chat"]["response"]["body"]
    assert chat["object"] == "chat.completion"
    assert chat["choices"][0]["message"]["role"] == "assistant"
    assert isinstance(chat["choices"][0]["message"]["content"], str)
    assert chat["usage"]["completion_tokens"] == 4

    two = by_id["two"]["response"]["body"]
    assert [c["index"] for c in two["choices"]] == [0, 1]
    assert [c["finish_reason"] for c in two["choices"]] == ["length", "length"]
    assert two["usage"]["completion_tokens"] == 6

    not_json = by_id[None]
    assert not_json["response"]["status_code"] == 400 and not_json["response"]["body"] is None
    assert not_json["error"].startswith("line 4: not valid JSON")
    echo = by_id["echo"]["response"]["body"]["choices"][0]
    assert echo["logprobs"]["token_logprobs"][0] is None and len(echo["logprobs"]["token_logprobs"]) == 5
    several = by_id["several"]
    assert several["response"]["status_code"] == 400 and "a batch line takes one prompt" in several["error"]
    assert by_id["cold"]["response"]["status_code"] == 400  # refused by vLLM on the worker
    assert by_id["cold"]["error"].startswith("invalid_request:") and "temperature" in by_id["cold"]["error"]
    assert by_id["moderate"]["response"]["status_code"] == 400 and "/v1/moderations" in by_id["moderate"]["error"]
    nobody = by_id["nobody"]  # routed by its model, which no worker serves
    assert nobody["response"]["status_code"] == 404 and "no worker serves model 'no-such-model'" in nobody["error"]

    # Output lines are what `vllm serve` returns, as its own models read them.
    completion_protocol.CompletionResponse.model_validate(body)
    completion_protocol.CompletionResponse.model_validate(two)
    chat_protocol.ChatCompletionResponse.model_validate(chat)

    # A re-run after everything is done does nothing.
    before = out_path.read_text()
    again = _run_batch(worker, producer_url, in_path, out_path)
    assert again.returncode == 0, again.stderr
    assert "0 succeeded, 0 failed, 9 skipped" in again.stderr
    assert out_path.read_text() == before

    # A run interrupted before "plain" finished (its line missing, the last one torn):
    # the re-run does "plain" only, and the output ends up whole again.
    kept = [json.dumps(line) for line in lines if line["custom_id"] != "plain"]
    out_path.write_text("\n".join(kept) + "\n" + '{"id": "batch-torn", "custom_')
    resumed = _run_batch(worker, producer_url, in_path, out_path)
    assert resumed.returncode == 0, resumed.stderr
    assert "1 succeeded, 0 failed, 8 skipped" in resumed.stderr
    final = _lines(out_path)
    assert sorted(str(line["custom_id"]) for line in final) == sorted(str(line["custom_id"]) for line in lines)
    redone = next(line for line in final if line["custom_id"] == "plain")
    assert redone["response"]["status_code"] == 200
    assert redone["response"]["body"]["choices"][0]["text"] == plain["response"]["body"]["choices"][0]["text"]


def test_batch_with_an_unreadable_input_says_so(worker: WorkerProcess, producer_url: str, tmp_path: Path) -> None:
    result = _run_batch(worker, producer_url, tmp_path / "missing.jsonl", tmp_path / "out.jsonl")
    assert result.returncode == 2
    assert "cannot read" in result.stderr
    assert not (tmp_path / "out.jsonl").exists()
