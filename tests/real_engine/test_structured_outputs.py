"""Structured outputs on the real engine, through every path a user has: the library, the
raw protocol, the command line, the gateway (the official ``openai`` SDK) and batch files.

The tiny model's weights are random, so only the constraint makes its output a JSON
object, a match or a choice: every output must parse and validate, and end with finish
reason ``stop`` (a truncated one cannot pass). The schemas bound every string and number
so that a wandering model still terminates well inside ``max_tokens``.
"""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest
import redis.asyncio as aioredis

from devkit.worker_process import WorkerProcess
from producer.client import StreamqClient
from producer.errors import RequestError
from streamq.protocol import DEFAULT_QUEUE, JOB_KEY_PREFIX, WAKEUP_CHANNEL, StructuredOutputs
from tests.support.events import assert_well_formed, capture_events
from tests.support.schemas import PERSON

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "celsius": {"type": "number", "minimum": -50, "maximum": 50},
        "tags": {"type": "array", "items": {"type": "string", "enum": ["sun", "rain"]}, "maxItems": 3},
    },
    "required": ["city", "celsius", "tags"],
    "additionalProperties": False,
}
CODE = r"[a-z]{3,8}-[0-9]{2}"
CHOICES = ["yes", "no", "maybe"]
MAX_TOKENS = 400  # the schemas above end within about 100 tokens of this model
SEEDS = range(3)
JSON_OBJECT_SEED = 1


def assert_valid_json(text: str, schema: dict[str, Any]) -> None:
    jsonschema.validate(json.loads(text), schema)


# --- The library -------------------------------------------------------------------
@pytest.mark.parametrize("schema", [PERSON, WEATHER], ids=["person", "weather"])
async def test_library_json_schema_output_validates(client: StreamqClient, schema: dict[str, Any]) -> None:
    for seed in SEEDS:
        handle = await client.submit(
            "Describe it:", max_tokens=MAX_TOKENS, seed=seed, structured_outputs=StructuredOutputs(json=schema)
        )
        completion = await handle.result()
        assert completion.finish_reasons == ["stop"], completion.text
        assert_valid_json(completion.text, schema)


async def test_library_schema_as_json_text_and_chat_messages(client: StreamqClient) -> None:
    handle = await client.submit(
        messages=[{"role": "user", "content": "Who is it?"}],
        max_tokens=MAX_TOKENS,
        seed=7,
        structured_outputs={"json": json.dumps(PERSON)},
    )
    completion = await handle.result()
    assert completion.finish_reasons == ["stop"], completion.text
    assert_valid_json(completion.text, PERSON)


async def test_library_regex_output_matches_whole(client: StreamqClient) -> None:
    for seed in SEEDS:
        handle = await client.submit("Code:", max_tokens=64, seed=seed, structured_outputs={"regex": CODE})
        completion = await handle.result()
        assert completion.finish_reasons == ["stop"]
        assert re.fullmatch(CODE, completion.text), completion.text


async def test_library_choice_and_grammar_outputs_are_one_of_theirs(client: StreamqClient) -> None:
    for seed in range(6):
        completion = await (
            await client.submit("Answer:", max_tokens=16, seed=seed, structured_outputs={"choice": CHOICES})
        ).result()
        assert completion.finish_reasons == ["stop"] and completion.text in CHOICES, completion.text
    grammar = 'root ::= "up" | "down" digit\ndigit ::= [0-9]'
    for seed in SEEDS:
        completion = await (
            await client.submit("Go:", max_tokens=16, seed=seed, structured_outputs={"grammar": grammar})
        ).result()
        assert completion.finish_reasons == ["stop"] and re.fullmatch(r"up|down[0-9]", completion.text), completion.text


async def test_n_completions_each_obey_the_constraint(client: StreamqClient) -> None:
    completion = await (
        await client.submit("Code:", n=3, max_tokens=64, seed=1, structured_outputs={"regex": CODE})
    ).result()
    assert completion.finish_reasons == ["stop"] * 3
    assert all(re.fullmatch(CODE, text) for text in completion.texts), completion.texts


@pytest.mark.parametrize(
    ("structured_outputs", "message"),
    [
        ({"json": {"type": "object", "properties": 5}}, "properties must be an object"),
        ({"json": {"type": "nonsense"}}, "nonsense"),
        ({"regex": "(unclosed"}, "unclosed"),
        ({"grammar": "root ::= ???"}, "grammar"),
    ],
    ids=["schema-not-a-schema", "unknown-type", "regex", "grammar"],
)
async def test_a_constraint_vllm_cannot_compile_is_invalid_request_and_the_worker_goes_on(
    client: StreamqClient, worker: WorkerProcess, structured_outputs: dict[str, Any], message: str
) -> None:
    handle = await client.submit("Hello", max_tokens=8, structured_outputs=structured_outputs)
    with pytest.raises(RequestError) as raised:
        await handle.result()
    assert raised.value.code == "invalid_request"
    assert message in raised.value.message
    following = await (await client.submit("Code:", max_tokens=64, seed=0, structured_outputs={"regex": CODE})).result()
    assert following.finish_reasons == ["stop"] and re.fullmatch(CODE, following.text)
    assert worker.process is not None and worker.process.poll() is None


# --- The raw protocol ------------------------------------------------------------------
async def enqueue_by_hand(redis: aioredis.Redis, request: dict[str, Any]) -> None:
    """PROTOCOL.md's "Enqueue a request": SET the job, ZADD its id, wake the workers."""
    now_ms = int((await redis.time())[0] * 1000)
    job = {"t": 1, "f": "generate", "a": [request], "k": {}, "et": now_ms}
    await redis.set(JOB_KEY_PREFIX + request["request_id"], json.dumps(job), px=86_400_000)
    await redis.zadd(DEFAULT_QUEUE, {request["request_id"]: now_ms})
    await redis.publish(WAKEUP_CHANNEL, DEFAULT_QUEUE)


async def run_by_hand(redis: aioredis.Redis, redis_url: str, sampling: dict[str, Any]) -> list[dict[str, Any]]:
    request_id = f"raw-{uuid.uuid4().hex}"
    request = {"request_id": request_id, "prompt": "Describe it:", "sampling": sampling}
    events = await capture_events(redis_url, request_id, lambda: enqueue_by_hand(redis, request))
    assert_well_formed(events, request_id)
    return events


async def test_raw_protocol_json_schema_and_regex(
    worker: WorkerProcess, raw_redis: aioredis.Redis, redis_url: str
) -> None:
    for constraint, check in (
        ({"json": WEATHER}, lambda text: assert_valid_json(text, WEATHER)),
        ({"regex": CODE}, lambda text: re.fullmatch(CODE, text) or pytest.fail(text)),
        ({"choice": CHOICES}, lambda text: text in CHOICES or pytest.fail(text)),
    ):
        sampling = {"max_tokens": MAX_TOKENS, "seed": 3, "structured_outputs": constraint}
        events = await run_by_hand(raw_redis, redis_url, sampling)
        assert events[-1]["type"] == "final" and events[-1]["finish_reasons"] == ["stop"]
        check("".join(e["text"] for e in events if e["type"] == "chunk"))


async def test_raw_protocol_bad_regex_is_an_invalid_request_error_event(
    worker: WorkerProcess, raw_redis: aioredis.Redis, redis_url: str
) -> None:
    events = await run_by_hand(raw_redis, redis_url, {"max_tokens": 8, "structured_outputs": {"regex": "[a-"}})
    [error] = events
    assert error["type"] == "error" and error["code"] == "invalid_request"
    assert "regex" in error["message"]
    two = await run_by_hand(
        raw_redis, redis_url, {"max_tokens": 8, "structured_outputs": {"regex": "a", "choice": ["b"]}}
    )
    assert two[-1]["code"] == "invalid_request" and "exactly one" in two[-1]["message"]


# --- The command line ---------------------------------------------------------------------
def test_cli_choice_prints_one_of_the_choices(worker: WorkerProcess, producer_url: str) -> None:
    command = [sys.executable, "-m", "producer", "--redis-url", producer_url, "--queue", worker.queue, "--json"]
    command += ["--seed", "2", "--choice", "yes", "--choice", "no", "Is it?"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    events = [json.loads(line) for line in result.stdout.splitlines()]
    assert events[-1]["finish_reasons"] == ["stop"]
    assert "".join(e["text"] for e in events if e["type"] == "chunk") in ("yes", "no")


# --- The gateway -----------------------------------------------------------------------------
def json_schema_format(schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}


async def test_gateway_response_format_json_schema_chat_and_completion(sdk: openai.OpenAI, model: str) -> None:
    messages: list[Any] = [{"role": "user", "content": "Who is it?"}]
    for seed in SEEDS:
        chat = await asyncio.to_thread(
            sdk.chat.completions.create,
            model=model,
            messages=messages,
            max_completion_tokens=MAX_TOKENS,
            seed=seed,
            response_format=json_schema_format(PERSON),  # type: ignore[arg-type]
        )
        assert chat.choices[0].finish_reason == "stop"
        assert_valid_json(chat.choices[0].message.content or "", PERSON)
    completion = await asyncio.to_thread(
        sdk.completions.create,
        model=model,
        prompt="Weather:",
        max_tokens=MAX_TOKENS,
        seed=1,
        extra_body={"response_format": json_schema_format(WEATHER)},
    )
    assert completion.choices[0].finish_reason == "stop"
    assert_valid_json(completion.choices[0].text, WEATHER)


async def test_gateway_streamed_chat_with_a_json_schema(sdk: openai.OpenAI, model: str) -> None:
    def run() -> list[Any]:
        stream = sdk.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "Weather?"}],
            max_tokens=MAX_TOKENS,
            seed=4,
            stream=True,
            response_format=json_schema_format(WEATHER),  # type: ignore[arg-type]
        )
        return list(stream)

    chunks = await asyncio.to_thread(run)
    assert chunks[-1].choices[0].finish_reason == "stop"
    assert_valid_json("".join(c.choices[0].delta.content or "" for c in chunks), WEATHER)


async def test_gateway_response_format_json_object(sdk: openai.OpenAI, model: str) -> None:
    # Any JSON object: its keys and strings are unbounded, so with random weights some
    # seeds run to max_tokens; this one ends (same prompt, seed and engine each run).
    chat = await asyncio.to_thread(
        sdk.chat.completions.create,
        model=model,
        messages=[{"role": "user", "content": "JSON please"}],
        max_completion_tokens=MAX_TOKENS,
        seed=JSON_OBJECT_SEED,
        response_format={"type": "json_object"},
    )
    assert chat.choices[0].finish_reason == "stop", chat.choices[0].message.content
    assert isinstance(json.loads(chat.choices[0].message.content or ""), dict)


async def test_gateway_vllm_structured_outputs_field(sdk: openai.OpenAI, model: str) -> None:
    completion = await asyncio.to_thread(
        sdk.completions.create,
        model=model,
        prompt="Code:",
        max_tokens=64,
        seed=5,
        extra_body={"structured_outputs": {"regex": CODE}},
    )
    assert completion.choices[0].finish_reason == "stop"
    assert re.fullmatch(CODE, completion.choices[0].text), completion.choices[0].text
    chat = await asyncio.to_thread(
        sdk.chat.completions.create,
        model=model,
        messages=[{"role": "user", "content": "Well?"}],
        max_tokens=16,
        extra_body={"structured_outputs": {"choice": CHOICES}},
    )
    assert chat.choices[0].finish_reason == "stop" and chat.choices[0].message.content in CHOICES


@pytest.mark.parametrize(
    ("extra_body", "param", "message"),
    [
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "a"}}},
            "response_format.json_schema.schema",
            "schema",
        ),
        ({"guided_json": PERSON}, "guided_json", "structured_outputs"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs", "exactly one"),
        ({"structured_outputs": {"json": {"type": "nonsense"}}}, None, "nonsense"),  # refused by vLLM on the worker
    ],
)
async def test_gateway_bad_constraint_is_400(
    sdk: openai.OpenAI, model: str, extra_body: dict[str, Any], param: str | None, message: str
) -> None:
    with pytest.raises(openai.BadRequestError) as raised:
        await asyncio.to_thread(sdk.completions.create, model=model, prompt="Hi", max_tokens=8, extra_body=extra_body)
    error = raised.value.body
    assert isinstance(error, dict) and message in error["message"]
    assert error["param"] == param


# --- Batch files -------------------------------------------------------------------------------
def test_batch_file_lines_with_constraints(
    worker: WorkerProcess, producer_url: str, tmp_path: Path, model: str
) -> None:
    bodies = {
        "chat-schema": (
            "/v1/chat/completions",
            {
                "model": model,
                "messages": [{"role": "user", "content": "Who?"}],
                "max_tokens": MAX_TOKENS,
                "seed": 2,
                "response_format": json_schema_format(PERSON),
            },
        ),
        "completion-schema": (
            "/v1/completions",
            {
                "model": model,
                "prompt": "Weather:",
                "max_tokens": MAX_TOKENS,
                "seed": 2,
                "structured_outputs": {"json": WEATHER},
            },
        ),
        "regex": ("/v1/completions", {"prompt": "Code:", "max_tokens": 64, "structured_outputs": {"regex": CODE}}),
        "choice": (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "?"}], "structured_outputs": {"choice": CHOICES}},
        ),
        "bad": ("/v1/completions", {"prompt": "Hi", "response_format": {"type": "json_schema"}}),
    }
    in_path, out_path = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    lines = [json.dumps({"custom_id": k, "method": "POST", "url": url, "body": b}) for k, (url, b) in bodies.items()]
    in_path.write_text("\n".join(lines) + "\n")
    command = [sys.executable, "-m", "producer", "batch", str(in_path), str(out_path), "--no-progress"]
    command += ["--redis-url", producer_url, "--queue", worker.queue]
    result = subprocess.run(command, capture_output=True, text=True, timeout=240)
    assert result.returncode == 1, result.stderr  # the bad line failed, the others ran
    out = {line["custom_id"]: line for line in map(json.loads, out_path.read_text().splitlines())}
    assert set(out) == set(bodies)

    def choice(custom_id: str) -> dict[str, Any]:
        assert out[custom_id]["response"]["status_code"] == 200, out[custom_id]
        first: dict[str, Any] = out[custom_id]["response"]["body"]["choices"][0]
        assert first["finish_reason"] == "stop", first
        return first

    assert_valid_json(choice("chat-schema")["message"]["content"], PERSON)
    assert_valid_json(choice("completion-schema")["text"], WEATHER)
    assert re.fullmatch(CODE, choice("regex")["text"])
    assert choice("choice")["message"]["content"] in CHOICES
    assert out["bad"]["response"]["status_code"] == 400 and "json_schema" in out["bad"]["error"]
