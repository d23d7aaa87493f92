"""Logs never hold a prompt, an API key or the Redis password: a real gateway and a real
worker (scripted engine) serve requests, good and bad, and their logs are searched."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from devkit.gateway_process import GatewayProcess
from devkit.redis_server import RedisServer
from devkit.worker_process import SCRIPTED_MODEL, WorkerProcess, scripted_worker

MODEL = SCRIPTED_MODEL


@pytest.fixture(scope="module")
def scripted(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[WorkerProcess]:
    worker = scripted_worker(
        redis_url, tmp_path_factory.mktemp("worker") / "worker.log", tokens_per_s=1000, queue="streamq:queue:logs-test"
    )
    worker.start().wait_ready(timeout_s=120)
    yield worker
    assert worker.stop() == 0, worker.log_tail()


def test_no_prompt_key_or_password_reaches_a_log(
    scripted: WorkerProcess, redis_server: RedisServer, redis_url: str, tmp_path: Path
) -> None:
    prompt = f"my card number is {uuid.uuid4().hex}"
    api_key = f"sq-{uuid.uuid4().hex}"
    gateway = GatewayProcess(redis_url, tmp_path / "gateway.log").wait_ready()
    try:
        sdk = openai.OpenAI(base_url=gateway.url + "/v1", api_key=api_key, max_retries=0, timeout=60)
        sdk.completions.create(model=MODEL, prompt=prompt, max_tokens=4)
        sdk.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=4)
        with pytest.raises(openai.BadRequestError):  # refused, the prompt in the body
            sdk.completions.create(model=MODEL, prompt=prompt, max_tokens=-1)
        with pytest.raises(openai.NotFoundError):
            sdk.completions.create(model="no-such-model", prompt=prompt, max_tokens=4)
    finally:
        assert gateway.stop() == 0, gateway.log_tail()
    logs = {"gateway": gateway.log_path.read_text(), "worker": scripted.log_path.read_text()}
    assert "POST /v1/completions" in logs["gateway"], "the gateway logged nothing: the search proves nothing"
    assert " finished: " in logs["worker"], "the worker logged no request: the search proves nothing"
    assert redis_server.password
    for name, log in logs.items():
        for secret in (prompt, api_key, redis_server.password):
            assert secret not in log, f"the {name}'s log holds {secret!r}"
