"""``python -m producer`` as a user runs it, against the real worker."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import uuid

import pytest
import redis.asyncio as aioredis

from devkit.worker_process import WorkerProcess
from producer.internal_client import InternalClient
from streamq.protocol import WorkerRegistration, events_channel


def run_producer(redis_url: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "REDIS_URL": redis_url}
    return subprocess.run(
        [sys.executable, "-m", "producer", *args], capture_output=True, text=True, env=env, timeout=120
    )


def test_json_output_is_the_event_stream(worker: WorkerProcess, producer_url: str) -> None:
    request_id = f"cli-{uuid.uuid4().hex}"
    result = run_producer(
        producer_url,
        "--json",
        "--max-tokens",
        "6",
        "--temperature",
        "0",
        "--request-id",
        request_id,
        "The key to happiness is",
    )
    assert result.returncode == 0, result.stderr
    events = [json.loads(line) for line in result.stdout.splitlines()]
    assert [e["seq"] for e in events] == list(range(len(events)))
    assert {e["request_id"] for e in events} == {request_id}
    assert events[-1]["type"] == "final" and events[-1]["completion_tokens"] == 6


def test_prints_each_prompts_response(worker: WorkerProcess, producer_url: str) -> None:
    prompts = ["In a galaxy far, far away", "The key to happiness is"]
    result = run_producer(producer_url, "--max-tokens", "4", *prompts)
    assert result.returncode == 0, result.stderr
    for prompt in prompts:
        assert f"Prompt: {prompt!r}" in result.stdout


def test_single_prompt_streams_its_text(worker: WorkerProcess, producer_url: str) -> None:
    with_json = run_producer(producer_url, "--json", "--max-tokens", "12", "--temperature", "0", "Hello")
    plain = run_producer(producer_url, "--max-tokens", "12", "--temperature", "0", "Hello")
    assert plain.returncode == 0, plain.stderr
    text = "".join(json.loads(line).get("text", "") for line in with_json.stdout.splitlines())
    assert plain.stdout == text + "\n"


def test_failed_request_exits_non_zero_with_the_error_on_stderr(worker: WorkerProcess, producer_url: str) -> None:
    result = run_producer(producer_url, "--temperature", "-1", "Hello")
    assert result.returncode == 1
    assert "invalid_request" in result.stderr and "temperature" in result.stderr


def test_bad_arguments_are_refused_before_enqueueing(worker: WorkerProcess, producer_url: str) -> None:
    result = run_producer(producer_url, "")
    assert result.returncode == 2
    assert "prompt must not be empty" in result.stderr


async def test_follow_prints_a_running_request_from_its_first_event(
    worker: WorkerProcess, client: InternalClient, producer_url: str, redis_url: str
) -> None:
    request_id = f"follow-{uuid.uuid4().hex}"
    env = {**os.environ, "REDIS_URL": producer_url}
    follow = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "producer",
        "follow",
        request_id,
        "--json",
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env=env,
    )
    redis = aioredis.Redis.from_url(redis_url)
    try:
        async with asyncio.timeout(60):
            while (await redis.pubsub_numsub(events_channel(request_id)))[0][1] == 0:
                await asyncio.sleep(0.1)
    finally:
        await redis.aclose()
    completion = await (await client.submit("Tell me", request_id=request_id, max_tokens=10, ignore_eos=True)).result()
    stdout, stderr = await asyncio.wait_for(follow.communicate(), timeout=60)
    assert follow.returncode == 0, stderr
    events = [json.loads(line) for line in stdout.decode().splitlines()]
    assert events[-1]["type"] == "final"
    assert "".join(e.get("text", "") for e in events) == completion.text


async def test_cancel_finds_a_queued_request_on_its_models_queue(
    producer_url: str, parked_model: WorkerRegistration
) -> None:
    async with await InternalClient.connect(producer_url) as client:
        handle = await client.submit("Never run", model=parked_model.model)
        result = await asyncio.to_thread(run_producer, producer_url, "cancel", handle.request_id)  # no --queue
        assert result.returncode == 0, result.stdout + result.stderr
        assert f"{handle.request_id}: cancelled before it ran" in result.stdout
        completion = await handle.result()
        assert completion.finish_reasons == ["cancelled"]
        assert await client.redis.zcard(parked_model.queue) == 0


SAMPLING = ["--json", "--max-tokens", "5", "--temperature", "0"]


@pytest.mark.parametrize(
    "command",
    [["submit", *SAMPLING, "follow"], [*SAMPLING, "--", "follow"]],
    ids=["after-submit", "after-double-dash"],
)
async def test_a_prompt_named_like_a_subcommand_is_submitted(
    worker: WorkerProcess, client: InternalClient, producer_url: str, command: list[str]
) -> None:
    result = await asyncio.to_thread(run_producer, producer_url, *command)
    assert result.returncode == 0, result.stderr
    events = [json.loads(line) for line in result.stdout.splitlines()]
    assert len({e["request_id"] for e in events}) == 1  # one prompt: "follow", not "submit" and "follow"
    expected = await (await client.submit("follow", max_tokens=5, temperature=0)).result()
    assert "".join(e.get("text", "") for e in events) == expected.text
