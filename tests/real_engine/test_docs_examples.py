"""Every example under docs/examples/ runs as a reader runs it: a fresh Python process
with ``REDIS_URL`` and ``STREAMQ_QUEUE`` (the Python client) or ``OPENAI_BASE_URL`` and
``OPENAI_API_KEY`` (the openai SDK) or ``ANTHROPIC_BASE_URL`` and ``ANTHROPIC_API_KEY``
(the anthropic SDK) set, against the session's real worker and a real
gateway. The pages show these files verbatim (``tests/no_engine/test_docs.py``). The
Node.js client (docs/examples/node/) runs with ``node``, its ``redis`` package installed by npm."""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import redis.asyncio as aioredis

from devkit.gateway_process import GatewayProcess
from devkit.redis_server import free_port
from devkit.worker_process import WorkerProcess
from producer.client import StreamqClient

ROOT = Path(__file__).resolve().parents[2]
RUN_ELSEWHERE = {
    "lora_adapters.py": "tests/real_engine/test_lora_adapters.py, against workers with adapters",
    "flask_view.py": "test_the_flask_view_serves_and_streams, as a Flask server",
    "client_embed.py": "tests/real_engine/test_pooling_through_the_queue.py, against an embedding worker",
}
EXAMPLES = sorted(path for path in (ROOT / "docs" / "examples").glob("*.py") if path.name not in RUN_ELSEWHERE)

OUTPUT: dict[str, str] = {
    "client_stream.py": r"\n(stop|length) \d+ \d+\n",
    "client_sync.py": r"\n(\S+ (stop|length) \d+\n){8}$",
    "request_status.py": r"^(queued|running|finished)\n(.|\n)*finished \[('stop'|'length')\] \d+\n$",
    "client_logprobs.py": r"\n\[TokenLogprob\(.*\]\n$",
    "openai_logprobs.py": r"^\[\(",
    "structured_outputs.py": r"\[('stop'|'length')\]\n(yes|no)\n$",
    "openai_structured_outputs.py": r" (stop|length)\n",
    "affinity_follow_up.py": r"^(\S+) \1 True\n$",
    "client_generate_many.py": r"^(haiku-\d+ \[('stop'|'length')\] \d+\n){100}$",
    "anthropic_messages.py": r"\n(end_turn|max_tokens) \d+ \d+\n(.|\n)*\n(end_turn|max_tokens)\n$",
    "openai_responses.py": r"^resp_\S+ (completed|incomplete) ",
    "openai_responses_background.py": r"^(completed|incomplete) .*\n1 response\.in_progress\n(.|\n)*completed\n",
    "batch_api_sdk.py": r"^completed 3/3\nquestion-0 (.|\n)*question-1 (.|\n)*question-2 ",
}
"""What an example's output must match (a regular expression, searched), beyond running
without error: the parts that do not depend on the tiny model's random text."""

NODE_EXAMPLE = ROOT / "docs" / "examples" / "node"
NODE_CACHE = ROOT / ".cache" / "node-example"
"""Where the Node.js example is copied and its package installed: git-ignored, kept between runs."""
NODE_FINAL_LINE = re.compile(r"\[((?:stop|length)(?:,(?:stop|length))*)\] (\d+) (\d+)")


@pytest.fixture(scope="module")
def example_env(worker: WorkerProcess, producer_url: str, gateway: GatewayProcess, model: str) -> dict[str, str]:
    """The environment a reader sets: the producer role's Redis URL, the session worker's
    queue, and the gateway, whose one model is the session worker's."""
    listed = [entry["id"] for entry in httpx.get(gateway.url + "/v1/models", timeout=10).json()["data"]]
    assert listed[:1] == [model], f"the openai examples take the first model the gateway lists: {listed}"
    return {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
        "REDIS_URL": producer_url,
        "STREAMQ_QUEUE": worker.queue,
        "OPENAI_BASE_URL": gateway.url + "/v1",
        "OPENAI_API_KEY": "unused",
        "ANTHROPIC_BASE_URL": gateway.url,  # the anthropic SDK adds /v1 itself
        "ANTHROPIC_API_KEY": "unused",
    }


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda path: path.name)
def test_the_example_runs(example: Path, example_env: dict[str, str]) -> None:
    run = subprocess.run(
        [sys.executable, str(example)], env=example_env, cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0, f"{example.name} exited with {run.returncode}:\n{run.stderr}"
    # A line, maybe empty: the tiny model samples its end-of-text token first now and then.
    assert run.stdout, f"{example.name} printed nothing"
    expected = OUTPUT.get(example.name)
    if expected:
        assert re.search(expected, run.stdout), f"{example.name} printed:\n{run.stdout}"


def test_every_expected_output_names_an_example() -> None:
    assert set(OUTPUT) <= {path.name for path in EXAMPLES}


def test_the_flask_view_serves_and_streams(example_env: dict[str, str]) -> None:
    """docs/examples/flask_view.py run as its readers run it (``flask run``, a server whose
    threads share one blocking client): four requests at once answer, and a streamed one
    sends its text to its end."""
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "flask", "--app", "docs/examples/flask_view.py", "run", "--port", str(port)],
        env=example_env,
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            if server.poll() is not None:
                raise AssertionError(f"flask exited with {server.returncode}: {server.stderr and server.stderr.read()}")
            try:
                httpx.get(url, timeout=2)
                break
            except httpx.TransportError:
                assert time.monotonic() < deadline, "the Flask server did not listen within 60 s"
                time.sleep(0.2)
        with ThreadPoolExecutor(4) as threads:
            replies = list(
                threads.map(lambda i: httpx.post(url + "/complete", content=f"Count to {i}:", timeout=60), range(4))
            )
        for reply in replies:
            assert reply.status_code == 200, reply.text
            assert reply.json()["finish_reason"] in {"stop", "length"}, reply.json()
        with httpx.stream("POST", url + "/stream", content="The key to happiness is", timeout=60) as streamed:
            assert streamed.status_code == 200
            body = "".join(streamed.iter_text())
        assert "[error" not in body, body
    finally:
        server.terminate()
        server.communicate(timeout=10)  # reaped, its stderr pipe read and closed


def _node_and_npm() -> tuple[str, str]:
    node, npm = shutil.which("node"), shutil.which("npm")
    if node is None or npm is None:
        missing = " and ".join(name for name, path in (("node", node), ("npm", npm)) if path is None)
        if os.environ.get("CI"):
            pytest.fail(f"{missing} not installed: CI needs Node.js 20 and npm for docs/examples/node")
        pytest.skip(f"no {missing} on PATH (Node.js 20 and npm run docs/examples/node)")
    return node, npm


async def test_the_node_example_streams_what_the_python_client_gets(
    example_env: dict[str, str], client: StreamqClient, raw_redis: aioredis.Redis
) -> None:
    """docs/examples/node/stream.mjs, as the producer role, enqueues through enqueue.lua and
    prints its request's every chunk in order: the text its replay log holds, which is the
    text, finish reason and token counts the Python client gets for the same greedy request."""
    node, npm = _node_and_npm()
    NODE_CACHE.mkdir(parents=True, exist_ok=True)
    for name in ("package.json", "stream.mjs"):
        shutil.copyfile(NODE_EXAMPLE / name, NODE_CACHE / name)
    install = await asyncio.to_thread(
        subprocess.run, [npm, "install", "--no-audit", "--no-fund"], cwd=NODE_CACHE, capture_output=True, timeout=300
    )
    assert install.returncode == 0, install.stderr.decode()
    # Copied out of the tree, the example is told where enqueue.lua is.
    env = {**example_env, "STREAMQ_LUA_DIR": str(ROOT / "streamq" / "protocol" / "lua")}
    prompt = "The key to happiness is"
    run = await asyncio.to_thread(
        subprocess.run, [node, "stream.mjs", prompt], cwd=NODE_CACHE, env=env, capture_output=True, timeout=120
    )
    stdout, stderr = run.stdout.decode(), run.stderr.decode()  # bytes: no newline translation
    assert run.returncode == 0, f"stream.mjs exited with {run.returncode}:\n{stderr}"
    text, _, last = stdout.removesuffix("\n").rpartition("\n")
    assert NODE_FINAL_LINE.fullmatch(last), f"stream.mjs printed:\n{stdout}"

    # Every chunk its log holds, in seq order, and nothing else.
    request_id = re.fullmatch(r"queued (\S+)\n", stderr)
    assert request_id, f"stream.mjs wrote to stderr:\n{stderr}"
    logged = [json.loads(fields[b"event"]) for _, fields in await raw_redis.xrange(f"streamq:events:{request_id[1]}")]
    assert [event["seq"] for event in logged] == list(range(len(logged)))
    assert text == "".join(event["text"] for event in logged if event["type"] == "chunk")

    completion = await client.generate(prompt, max_tokens=16, temperature=0)
    assert text == completion.text
    usage = completion.usage
    assert last == f"[{completion.finish_reason}] {usage.prompt_tokens} {usage.completion_tokens}"
