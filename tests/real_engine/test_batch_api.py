"""The OpenAI Batch API (``/v1/files`` and ``/v1/batches``) as a user of the ``openai`` SDK
meets it: two real gateway processes on one Redis, sharing one files directory, in front of
the session's real worker on the tiny model.

What the user sees is checked: a batch's state and ``request_counts``, its output and error
files line by line, each ``custom_id`` answered once, through a bad line, bad input, a
cancel, an expiry, a gateway SIGKILLed and a worker SIGKILLed mid-batch, lists that end and
two tenants (two API keys) that cannot see each other's files and batches.

The tests that need a batch to be mid-way when something happens make it long in a way that
does not depend on speed: a few short lines first, then long ones (``ignore_eos``), and the
fault (a cancel, the worker paused past the batch's window, a SIGKILL) comes as soon as the
short ones are done; where the worker is paused (SIGSTOP) nothing it runs can end meanwhile.
Both gateways allow a 15 s ``completion_window`` (``--batch-completion-window 15s=15``) so
that an expiry can be seen."""

from __future__ import annotations

import json
import os
import signal
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import redis
from openai.types import Batch

from devkit.gateway_process import GatewayProcess
from devkit.worker_process import WorkerProcess
from gateway.batch_api.names import batch_lease_key
from tests.support.worker_faults import paused, second_worker

KEY_A = "sq-batch-a-" + uuid.uuid4().hex
KEY_B = "sq-batch-b-" + uuid.uuid4().hex
"""Two command-line keys, so two tenants (``static-1`` and ``static-2``) on both gateways; the
tests are tenant A's unless they say otherwise."""
SHORT_WINDOW = "15s"
FINAL = frozenset({"completed", "failed", "expired", "cancelled"})
WAIT_S = 180.0
"""How long a batch may take to reach a state before the test gives up (a bound on a hang,
not a timing the test checks)."""
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
PROMPTS = [
    "The key to happiness is",
    "Once upon a time",
    "The capital of France is",
    "To be or not to be",
    "A quick brown fox",
    "In the beginning",
    "Hello, my name is",
    "The best way to learn is",
]
SHORT_LINES = 3
LONG_TOKENS = 600
"""Well inside the session worker's 1024-token context with any of the prompts above."""


class Gateways:
    """Gateways A and B on one Redis and one files directory; A can be restarted (on its
    port) after a test kills it."""

    def __init__(self, redis_url: str, files_dir: Path, logs: Path) -> None:
        self.redis_url = redis_url
        self.logs = logs
        self.args = (
            "--api-key",
            KEY_A,
            "--api-key",
            KEY_B,
            "--files-url",
            str(files_dir),
            "--batch-completion-window",
            f"{SHORT_WINDOW}=15",
        )
        self.a = self._start("a")
        self.b = self._start("b")

    def _start(self, name: str, port: int | None = None) -> GatewayProcess:
        return GatewayProcess(self.redis_url, self.logs / f"gateway-{name}.log", *self.args, port=port).wait_ready()

    def restart_a(self) -> None:
        if self.a.process.poll() is None:
            assert self.a.stop() == 0, self.a.log_tail()
        self.a = self._start("a", port=self.a.port)

    def stop(self) -> None:
        for gateway in (self.a, self.b):
            assert gateway.stop() == 0, gateway.log_tail()


@pytest.fixture(scope="module")
def gateways(worker: WorkerProcess, gateway_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateways]:
    files_dir = tmp_path_factory.mktemp("batch-files")
    pair = Gateways(gateway_url, files_dir, tmp_path_factory.mktemp("batch-gateways"))
    yield pair
    pair.stop()


def sdk_on(gateway: GatewayProcess, key: str = KEY_A) -> openai.OpenAI:
    return openai.OpenAI(base_url=gateway.url + "/v1", api_key=key, max_retries=0, timeout=60)


@pytest.fixture
def sdk_a(gateways: Gateways) -> Iterator[openai.OpenAI]:
    with sdk_on(gateways.a) as client:
        yield client


@pytest.fixture
def sync_redis(redis_url: str) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_url)
    yield client
    client.close()


def line(custom_id: str, endpoint: str, body: dict[str, Any], **fields: Any) -> dict[str, Any]:
    return {"custom_id": custom_id, "method": "POST", "url": endpoint, "body": body, **fields}


def chat_body(model: str, prompt: str, max_tokens: int = 16, **extra: Any) -> dict[str, Any]:
    messages = [{"role": "user", "content": prompt}]
    return {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0, **extra}


def completion_body(model: str, prompt: str, max_tokens: int = 16, **extra: Any) -> dict[str, Any]:
    return {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **extra}


def short_then_long(model: str, long_lines: int) -> list[dict[str, Any]]:
    """``SHORT_LINES`` lines of 4 tokens, then ``long_lines`` of ``LONG_TOKENS`` (no early
    end): the short ones are done long before the long ones."""
    lines = [
        line(f"short-{i}", COMPLETIONS, completion_body(model, PROMPTS[i], max_tokens=4)) for i in range(SHORT_LINES)
    ]
    for i in range(long_lines):
        body = completion_body(model, PROMPTS[i % len(PROMPTS)], max_tokens=LONG_TOKENS, ignore_eos=True)
        lines.append(line(f"long-{i}", COMPLETIONS, body))
    return lines


def upload(sdk: openai.OpenAI, lines: list[dict[str, Any]] | bytes) -> str:
    """The lines as a JSONL file with purpose batch; its id."""
    data = lines if isinstance(lines, bytes) else b"".join(json.dumps(x).encode() + b"\n" for x in lines)
    created = sdk.files.create(file=("input.jsonl", data), purpose="batch")
    assert (created.purpose, created.bytes) == ("batch", len(data))
    return created.id


def create_batch(sdk: openai.OpenAI, lines: list[dict[str, Any]] | bytes, endpoint: str, **options: Any) -> Batch:
    file_id = upload(sdk, lines)
    options.setdefault("completion_window", "24h")
    batch = sdk.batches.create(input_file_id=file_id, endpoint=endpoint, **options)  # type: ignore[arg-type]
    assert batch.status == "validating" and batch.input_file_id == file_id, batch
    return batch


def wait_for(sdk: openai.OpenAI, batch_id: str, done: Callable[[Batch], bool], what: str) -> Batch:
    deadline = time.monotonic() + WAIT_S
    while True:
        batch = sdk.batches.retrieve(batch_id)
        if done(batch):
            return batch
        assert batch.status not in FINAL, f"ended {batch.status} before {what}: {batch}"
        assert time.monotonic() < deadline, f"no {what} in {WAIT_S:.0f} s: {batch}"
        time.sleep(0.2)


def wait_final(sdk: openai.OpenAI, batch_id: str) -> Batch:
    deadline = time.monotonic() + WAIT_S
    while True:
        batch = sdk.batches.retrieve(batch_id)
        if batch.status in FINAL:
            return batch
        assert time.monotonic() < deadline, f"not final after {WAIT_S:.0f} s: {batch}"
        time.sleep(0.3)


def short_ones_done(batch: Batch) -> bool:
    return batch.request_counts is not None and batch.request_counts.completed >= SHORT_LINES


def file_lines(sdk: openai.OpenAI, file_id: str | None) -> list[dict[str, Any]]:
    """A result file's lines (none for no file)."""
    if file_id is None:
        return []
    text = sdk.files.content(file_id).text
    return [json.loads(x) for x in text.splitlines() if x.strip()]


def results(sdk: openai.OpenAI, batch: Batch) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The output file's lines and the error file's."""
    return file_lines(sdk, batch.output_file_id), file_lines(sdk, batch.error_file_id)


def ids_of(lines: list[dict[str, Any]]) -> Counter[str]:
    return Counter(x["custom_id"] for x in lines)


def error_code(result: dict[str, Any]) -> str | None:
    """The code of a failed line: its ``error``, else its response body's error."""
    if result.get("error"):
        return result["error"].get("code")
    body = (result.get("response") or {}).get("body") or {}
    return (body.get("error") or {}).get("code")


def texts(endpoint: str, body: dict[str, Any]) -> list[str]:
    """Every choice's text, in order."""
    if endpoint == CHAT:
        return [choice["message"]["content"] for choice in body["choices"]]
    return [choice["text"] for choice in body["choices"]]


def assert_succeeded(result: dict[str, Any]) -> None:
    assert result["error"] is None, result
    assert result["response"]["status_code"] == 200, result
    assert result["id"] and result["response"]["request_id"], result


@pytest.mark.parametrize("endpoint", [CHAT, COMPLETIONS], ids=["chat", "completions"])
def test_a_batch_completes_with_the_texts_of_the_same_requests_sent_directly(
    sdk_a: openai.OpenAI, gateways: Gateways, model: str, endpoint: str
) -> None:
    make = chat_body if endpoint == CHAT else completion_body
    bodies = {f"req-{i}": make(model, prompt, max_tokens=8 + i) for i, prompt in enumerate(PROMPTS)}
    lines = [line(custom_id, endpoint, body) for custom_id, body in bodies.items()]
    created = create_batch(sdk_a, lines, endpoint, metadata={"run": "nightly"})

    batch = wait_final(sdk_a, created.id)

    assert batch.status == "completed", batch
    assert batch.metadata == {"run": "nightly"} and batch.model == model
    assert batch.in_progress_at and batch.finalizing_at and batch.completed_at, batch
    assert created.created_at <= batch.in_progress_at <= batch.finalizing_at <= batch.completed_at
    assert batch.request_counts is not None
    assert (batch.request_counts.total, batch.request_counts.completed, batch.request_counts.failed) == (8, 8, 0)
    output, errors = results(sdk_a, batch)
    assert errors == []
    assert ids_of(output) == Counter(list(bodies))
    with httpx.Client(base_url=gateways.a.url, headers={"Authorization": f"Bearer {KEY_A}"}, timeout=60) as http:
        for result in output:
            assert_succeeded(result)
            direct = http.post(endpoint, json=bodies[result["custom_id"]])
            assert direct.status_code == 200, direct.text
            assert texts(endpoint, result["response"]["body"]) == texts(endpoint, direct.json()), result["custom_id"]
    usages = [result["response"]["body"]["usage"] for result in output]
    assert batch.usage is not None
    assert batch.usage.input_tokens == sum(u["prompt_tokens"] for u in usages)
    assert batch.usage.output_tokens == sum(u["completion_tokens"] for u in usages)
    assert batch.usage.total_tokens == batch.usage.input_tokens + batch.usage.output_tokens
    assert batch.output_file_id is not None
    output_file = sdk_a.files.retrieve(batch.output_file_id)
    assert output_file.purpose == "batch_output", output_file
    assert output_file.expires_at is not None and output_file.expires_at > output_file.created_at, output_file


def test_a_line_vllm_refuses_lands_in_the_error_file_and_the_others_in_the_output(
    sdk_a: openai.OpenAI, gateways: Gateways, model: str
) -> None:
    refused_body = chat_body(model, PROMPTS[5], max_tokens=6, temperature=-1)
    lines = [line(f"ok-{i}", CHAT, chat_body(model, PROMPTS[i], max_tokens=6)) for i in range(3)]
    lines.insert(1, line("refused", CHAT, refused_body))
    created = create_batch(sdk_a, lines, CHAT)

    batch = wait_final(sdk_a, created.id)

    assert batch.status == "completed", batch
    assert batch.request_counts is not None
    assert (batch.request_counts.total, batch.request_counts.completed, batch.request_counts.failed) == (4, 3, 1)
    output, errors = results(sdk_a, batch)
    assert ids_of(output) == Counter({"ok-0": 1, "ok-1": 1, "ok-2": 1})
    for result in output:
        assert_succeeded(result)
    (refused,) = errors
    assert refused["custom_id"] == "refused", refused
    direct = httpx.post(gateways.a.url + CHAT, json=refused_body, headers={"Authorization": f"Bearer {KEY_A}"})
    assert direct.status_code == 400, direct.text
    assert refused["response"]["status_code"] == 400, refused
    assert refused["response"]["body"] == direct.json(), refused  # the gateway's own answer to it
    assert refused["response"]["body"]["error"]["message"], refused


def test_bad_input_fails_the_batch_with_each_bad_line_numbered(sdk_a: openai.OpenAI, model: str) -> None:
    good = line("first", CHAT, chat_body(model, PROMPTS[0]))
    data = b"".join(
        [
            json.dumps(good).encode() + b"\n",
            b'{"custom_id": "broken", "method": "POST", \n',  # line 2: not JSON
            json.dumps(good).encode() + b"\n",  # line 3: "first" again
            json.dumps(line("other-url", COMPLETIONS, completion_body(model, PROMPTS[1]))).encode() + b"\n",
            json.dumps(line("last", CHAT, chat_body(model, PROMPTS[2]))).encode() + b"\n",
        ]
    )
    created = create_batch(sdk_a, data, CHAT)

    batch = wait_final(sdk_a, created.id)

    assert batch.status == "failed", batch
    assert batch.failed_at is not None and batch.in_progress_at is None, batch
    assert batch.output_file_id is None, batch
    assert batch.errors is not None and batch.errors.data, batch
    found = {(error.line, error.code) for error in batch.errors.data}
    assert found == {(2, "invalid_json_line"), (3, "duplicate_custom_id"), (4, "invalid_url")}, batch.errors
    assert all(error.message for error in batch.errors.data), batch.errors


def test_a_cancelled_batch_keeps_what_finished(sdk_a: openai.OpenAI, worker: WorkerProcess, model: str) -> None:
    created = create_batch(sdk_a, short_then_long(model, long_lines=12), COMPLETIONS)
    wait_for(sdk_a, created.id, short_ones_done, "short lines done")
    with paused(worker):  # nothing in flight ends before the cancel is recorded
        cancelling = sdk_a.batches.cancel(created.id)
        assert cancelling.status in ("cancelling", "cancelled"), cancelling
        assert cancelling.cancelling_at is not None, cancelling

    batch = wait_final(sdk_a, created.id)

    assert batch.status == "cancelled" and batch.cancelled_at is not None, batch
    output, errors = results(sdk_a, batch)
    every = ids_of(output) + ids_of(errors)
    assert max(every.values()) == 1, every
    assert {f"short-{i}" for i in range(SHORT_LINES)} <= set(ids_of(output)), output
    for result in output:
        assert_succeeded(result)
    assert batch.request_counts is not None and batch.request_counts.completed == len(output), batch


def test_a_batch_past_its_window_expires_with_the_rest_in_the_error_file(
    sdk_a: openai.OpenAI, worker: WorkerProcess, model: str
) -> None:
    lines = short_then_long(model, long_lines=8)
    created = create_batch(sdk_a, lines, COMPLETIONS, completion_window=SHORT_WINDOW)
    assert created.completion_window == SHORT_WINDOW and created.expires_at == created.created_at + 15, created
    wait_for(sdk_a, created.id, short_ones_done, "short lines done")
    with paused(worker):  # the long lines cannot end before the window does
        wait_for(
            sdk_a,
            created.id,
            lambda b: b.status != "in_progress" or time.time() > created.expires_at + 3,
            "the window's end",
        )

    batch = wait_final(sdk_a, created.id)

    assert batch.status == "expired" and batch.expired_at is not None, batch
    output, errors = results(sdk_a, batch)
    assert ids_of(output) + ids_of(errors) == Counter(x["custom_id"] for x in lines)
    assert {f"short-{i}" for i in range(SHORT_LINES)} <= set(ids_of(output)), output
    for result in output:
        assert_succeeded(result)
    assert errors, "every long line ended in its window"
    for result in errors:
        assert error_code(result) == "batch_expired", result


def test_a_gateway_killed_mid_batch_is_taken_over_with_each_line_once(
    gateways: Gateways, sync_redis: redis.Redis, model: str
) -> None:
    lines = short_then_long(model, long_lines=10)
    try:
        with sdk_on(gateways.a) as sdk_a, sdk_on(gateways.b) as sdk_b:
            os.kill(gateways.b.process.pid, signal.SIGSTOP)  # so that A runs the batch
            try:
                created = create_batch(sdk_a, lines, COMPLETIONS)
                wait_for(sdk_a, created.id, short_ones_done, "short lines done")
                token_of_a = sync_redis.get(batch_lease_key(created.id))
                assert token_of_a is not None, "a running batch has no lease"
            finally:
                os.kill(gateways.b.process.pid, signal.SIGCONT)
            os.killpg(gateways.a.process.pid, signal.SIGKILL)
            killed_at = time.monotonic()
            gateways.a.process.wait()
            taken_over_s = None
            while taken_over_s is None and time.monotonic() < killed_at + WAIT_S:
                token = sync_redis.get(batch_lease_key(created.id))
                if token is not None and token != token_of_a:
                    taken_over_s = time.monotonic() - killed_at
                elif sdk_b.batches.retrieve(created.id).status in FINAL:
                    break
                time.sleep(0.05)
            print(f"gateway B took the batch over {taken_over_s} s after gateway A's SIGKILL")

            batch = wait_final(sdk_b, created.id)

            assert batch.status == "completed", batch
            output, errors = results(sdk_b, batch)
            assert errors == []
            assert ids_of(output) == Counter(x["custom_id"] for x in lines)
            for result in output:
                assert_succeeded(result)
            assert batch.request_counts is not None
            assert (batch.request_counts.completed, batch.request_counts.failed) == (len(lines), 0), batch
    finally:
        gateways.restart_a()


def test_a_worker_killed_mid_batch_loses_no_line(
    sdk_a: openai.OpenAI, worker: WorkerProcess, tiny_model: Path, tmp_path: Path, model: str
) -> None:
    doomed = second_worker(worker, tiny_model, tmp_path)
    try:
        with paused(worker):  # the batch's lines start on the doomed worker
            lines = short_then_long(model, long_lines=6)
            created = create_batch(sdk_a, lines, COMPLETIONS)
            wait_for(sdk_a, created.id, short_ones_done, "short lines done")
            doomed.kill()
    finally:
        doomed.kill()

    batch = wait_final(sdk_a, created.id)

    assert batch.status == "completed", batch
    output, errors = results(sdk_a, batch)
    assert errors == []
    assert ids_of(output) == Counter(x["custom_id"] for x in lines)
    for result in output:
        assert_succeeded(result)


def test_listing_every_batch_and_file_ends(sdk_a: openai.OpenAI, model: str) -> None:
    batches = [
        create_batch(sdk_a, [line("only", CHAT, chat_body(model, PROMPTS[i], max_tokens=2))], CHAT) for i in range(3)
    ]
    for batch in batches:
        wait_final(sdk_a, batch.id)

    listed_batches = [b.id for b in sdk_a.batches.list(limit=2)]  # the SDK pages on while has_more
    listed_files = [f.id for f in sdk_a.files.list(limit=2)]

    assert len(listed_batches) == len(set(listed_batches))
    assert {b.id for b in batches} <= set(listed_batches)
    assert listed_batches[:3] == [b.id for b in reversed(batches)]  # newest first
    assert len(listed_files) == len(set(listed_files))
    assert {b.input_file_id for b in batches} <= set(listed_files)


def test_another_key_neither_reaches_nor_sees_a_tenants_batches_and_files(
    sdk_a: openai.OpenAI, gateways: Gateways, model: str
) -> None:
    created = create_batch(sdk_a, [line("mine", CHAT, chat_body(model, PROMPTS[0], max_tokens=2))], CHAT)
    batch = wait_final(sdk_a, created.id)
    assert batch.status == "completed" and batch.output_file_id is not None, batch
    with sdk_on(gateways.b, KEY_B) as other:
        for call in (
            lambda: other.batches.retrieve(batch.id),
            lambda: other.batches.cancel(batch.id),
            lambda: other.files.retrieve(batch.input_file_id),
            lambda: other.files.retrieve(batch.output_file_id),
            lambda: other.files.content(batch.output_file_id),
            lambda: other.files.delete(batch.input_file_id),
            lambda: other.batches.create(input_file_id=batch.input_file_id, endpoint=CHAT, completion_window="24h"),
        ):
            with pytest.raises(openai.NotFoundError):
                call()
        assert batch.id not in {b.id for b in other.batches.list()}
        assert not {batch.input_file_id, batch.output_file_id} & {f.id for f in other.files.list()}
    assert sdk_a.files.retrieve(batch.input_file_id).id == batch.input_file_id  # still there for its owner
