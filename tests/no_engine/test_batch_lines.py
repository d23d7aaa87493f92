"""The batch runner's lines: what it reads, what it skips on a re-run, and what it writes for each request.

No Redis: requests go through ``StreamqClient.generate_many`` and ``generate`` to a stand-in
``submit`` that answers or fails as told.
"""

from __future__ import annotations

import dataclasses
import io
import json
from pathlib import Path
from typing import Any

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError
from rich.progress import Progress

from producer.batch import BatchLine, BatchRun, done_keys, read_batch
from producer.client import Completion, StreamqClient
from producer.errors import NoLiveWorker, RequestError, UnknownModel
from streamq.broker.registry import Routes
from streamq.protocol import ErrorCode


def line(custom_id: str, body: dict[str, Any], url: str = "/v1/completions", **extra: Any) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body, **extra})


def test_valid_lines_are_read_in_order_and_blank_lines_skipped() -> None:
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}]}
    text = "\n".join([line("a", {"prompt": "x"}), "", "   ", line("b", chat, url="/v1/chat/completions")])
    lines = list(read_batch(text.splitlines()))
    assert [(x.key, x.custom_id, x.url, x.body, x.error) for x in lines] == [
        ("a", "a", "/v1/completions", {"prompt": "x"}, None),
        ("b", "b", "/v1/chat/completions", chat, None),
    ]


MALFORMED: list[tuple[str, str, str | None, str]] = [
    ("{not json", "line 1", None, "line 1: not valid JSON"),
    ("[1, 2]", "line 1", None, "line 1: must be a JSON object"),
    ('{"custom_id": 5, "method": "POST"}', "line 1", None, "line 1: custom_id must be a string"),
    ('{"method": "POST"}', "line 1", None, "line 1: missing required parameter: custom_id"),
    ('{"custom_id": "c", "url": "/v1/completions", "body": {}}', "c", "c", "missing required parameter: method"),
    (line("c", {"prompt": "x"}, extra=1), "c", "c", "unknown field(s) in the batch line: extra"),
    (line("c", {"prompt": "x"}).replace('"POST"', '"GET"'), "c", "c", "method must be POST, got 'GET'"),
    (line("c", {"prompt": "x"}, url="/v1/moderations"), "c", "c", "URL '/v1/moderations' is not supported"),
    (json.dumps({"custom_id": "c", "method": "POST", "url": "/v1/completions", "body": []}), "c", "c", "body must"),
    (line("c", {"prompt": "x", "stream": True}), "c", "c", "a batch request must not be sent in stream mode"),
]


@pytest.mark.parametrize(("raw", "key", "custom_id", "reason"), MALFORMED)
def test_a_malformed_line_comes_back_with_its_reason(raw: str, key: str, custom_id: str | None, reason: str) -> None:
    (parsed,) = read_batch([raw])
    assert (parsed.key, parsed.custom_id, parsed.body) == (key, custom_id, None)
    assert parsed.error is not None and parsed.error.startswith(reason)


def test_a_duplicate_custom_id_is_reported_under_its_line_number() -> None:
    text = "\n".join([line("a", {"prompt": "x"}), line("b", {"prompt": "y"}), line("a", {"prompt": "z"})])
    first, _, duplicate = read_batch(text.splitlines())
    assert first.error is None
    assert (duplicate.key, duplicate.custom_id) == ("line 3", None)
    assert duplicate.error == "line 3: duplicate custom_id 'a': custom_ids must be unique in a batch"


def test_done_keys_are_the_custom_ids_and_numbered_errors_already_written(tmp_path: Path) -> None:
    out = tmp_path / "out.jsonl"
    assert done_keys(out) == set()
    out.write_text(
        json.dumps({"custom_id": "a", "error": None})
        + "\n"
        + json.dumps({"custom_id": None, "error": "line 7: not valid JSON: ..."})
        + "\nnot json\n"
    )
    assert done_keys(out) == {"a", "line 7"}


def test_a_torn_last_line_is_cut_so_appending_goes_on_from_a_whole_line(tmp_path: Path) -> None:
    out = tmp_path / "out.jsonl"
    whole = json.dumps({"custom_id": "a"}) + "\n"
    out.write_text(whole + '{"custom_id": "b", "resp')
    assert done_keys(out) == {"a"}
    assert out.read_text() == whole


def test_a_rerun_skips_exactly_what_the_output_holds(tmp_path: Path) -> None:
    out = tmp_path / "out.jsonl"
    out.write_text(json.dumps({"custom_id": "a"}) + "\n" + json.dumps({"custom_id": None, "error": "line 2: x"}) + "\n")
    text = "\n".join([line("a", {"prompt": "x"}), "{bad", line("c", {"prompt": "z"})])
    done = done_keys(out)
    assert [x.key for x in read_batch(text.splitlines()) if x.key not in done] == ["c"]


class _Handle:
    def __init__(self, outcome: Completion | BaseException, *, cancel_on_close: bool) -> None:
        self.outcome = outcome
        self.cancel_on_close = cancel_on_close
        self.closed = False

    async def __aenter__(self) -> _Handle:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self.closed = True

    async def result(self, timeout: float | None = None) -> Completion:
        if isinstance(self.outcome, BaseException):
            raise self.outcome
        return dataclasses.replace(self.outcome, request_id=self.request_id)  # type: ignore[attr-defined]


class _Client:
    """``StreamqClient``'s ``generate_many`` and ``generate`` over a ``submit`` that answers
    every request with ``outcome``: a completion, or the failure to raise."""

    generate_many = StreamqClient.generate_many
    generate = StreamqClient.generate
    _generate_one = StreamqClient._generate_one

    def __init__(self, outcome: Completion | BaseException, *, on_submit: BaseException | None = None) -> None:
        self.outcome = outcome
        self.on_submit = on_submit
        self.submitted: list[dict[str, Any]] = []
        self.handles: list[_Handle] = []

    async def _routes(self) -> Routes:
        return Routes(workers=[], known_models={})

    async def submit(self, prompt: str | None = None, **kwargs: Any) -> _Handle:
        self.submitted.append({"prompt": prompt, **kwargs})
        if self.on_submit is not None:
            raise self.on_submit
        handle = _Handle(self.outcome, cancel_on_close=kwargs["cancel_on_close"])
        handle.request_id = kwargs["request_id"]  # type: ignore[attr-defined]
        self.handles.append(handle)
        return handle


async def run_one(client: _Client, batch_line: BatchLine, affinity: dict[str, Any] | None = None) -> dict[str, Any]:
    out = io.StringIO()
    progress = Progress(disable=True)
    task_id = progress.add_task("batch", total=1)
    run = BatchRun(client, out, progress, task_id, affinity=affinity)  # type: ignore[arg-type]
    await run.run([batch_line])
    (written,) = out.getvalue().splitlines()
    result: dict[str, Any] = json.loads(written)
    assert result["id"] == f"batch-{result['response']['request_id']}"
    assert (run.succeeded, run.failed) == ((1, 0) if result["error"] is None else (0, 1))
    return result


def read_one(raw: str) -> BatchLine:
    (parsed,) = read_batch([raw])
    return parsed


def completion(request_id: str = "r") -> Completion:
    return Completion(
        request_id=request_id,
        texts=["ok"],
        token_ids=[[1]],
        finish_reasons=["stop"],
        prompt_tokens=2,
        completion_tokens=1,
    )


async def test_a_finished_request_writes_the_response_body_and_routes_by_model() -> None:
    client = _Client(completion())
    result = await run_one(client, read_one(line("a", {"model": "tiny", "prompt": "Hi", "max_tokens": 3})))
    assert client.submitted[0]["model"] == "tiny" and client.submitted[0]["prompt"] == "Hi"
    assert client.submitted[0]["max_tokens"] == 3
    assert client.handles[0].cancel_on_close and client.handles[0].closed
    assert client.submitted[0]["stream"] is False, "a batch line is not streamed"
    assert (result["custom_id"], result["error"], result["response"]["status_code"]) == ("a", None, 200)
    body = result["response"]["body"]
    assert (body["object"], body["model"], body["choices"][0]["text"]) == ("text_completion", "tiny", "ok")


async def test_a_body_without_a_model_goes_to_the_default_queue() -> None:
    client = _Client(completion())
    result = await run_one(client, read_one(line("a", {"prompt": "Hi"})))
    assert client.submitted[0]["model"] is None
    assert result["response"]["body"]["model"] == "streamq"


FAILURES: list[tuple[str, BaseException, int, str]] = [
    ("submit", UnknownModel("no worker serves model 'x'"), 404, "no worker serves model 'x'"),
    ("submit", NoLiveWorker("every worker of 'x' is gone"), 503, "every worker of 'x' is gone"),
    (
        "result",
        RequestError("r", ErrorCode.INVALID_REQUEST, "temperature < 0"),
        400,
        "invalid_request: temperature < 0",
    ),
    ("result", RequestError("r", ErrorCode.TIMEOUT, "ran too long"), 500, "timeout: ran too long"),
    ("result", RequestError("r", ErrorCode.WORKER_LOST, "died"), 500, "worker_lost: died"),
]


@pytest.mark.parametrize(("where", "exc", "status", "error"), FAILURES)
async def test_a_failed_request_writes_an_error_line_with_its_status(
    where: str, exc: BaseException, status: int, error: str
) -> None:
    client = _Client(exc) if where == "result" else _Client(completion(), on_submit=exc)
    result = await run_one(client, read_one(line("a", {"model": "x", "prompt": "Hi"})))
    assert (result["custom_id"], result["response"]["status_code"], result["response"]["body"], result["error"]) == (
        "a",
        status,
        None,
        error,
    )


async def test_a_body_streamq_refuses_is_a_400_line_without_submitting() -> None:
    client = _Client(completion())
    result = await run_one(client, read_one(line("a", {"prompt": "Hi", "suffix": "!"})))
    assert client.submitted == []
    assert result["response"]["status_code"] == 400
    assert result["error"].startswith("suffix='!' is not supported by streamq")


async def test_n_past_the_batch_cap_is_a_400_line_without_submitting() -> None:
    client = _Client(completion())
    result = await run_one(client, read_one(line("a", {"prompt": "Hi", "n": 17})))
    assert client.submitted == []
    assert (result["response"]["status_code"], result["error"]) == (
        400,
        "n=17 is over the limit of 16 completions per request",
    )


async def test_a_model_that_is_not_a_string_is_a_400_line() -> None:
    result = await run_one(_Client(completion()), read_one(line("a", {"model": 3, "prompt": "Hi"})))
    assert (result["response"]["status_code"], result["error"]) == (400, "model must be a string, got 3")


async def test_a_body_takes_an_affinity_key_and_opts_out_of_affinity() -> None:
    client = _Client(completion())
    await run_one(client, read_one(line("a", {"prompt": "Hi", "affinity_key": "doc-7"})))
    await run_one(client, read_one(line("b", {"prompt": "Hi", "affinity": False})))
    await run_one(client, read_one(line("c", {"prompt": "Hi"})))
    keyed, off, plain = client.submitted
    # An option a body leaves out is not sent: submit's default holds (pickup on, no key).
    assert (keyed["affinity_key"], keyed["prompt"], keyed.get("affinity", True)) == ("doc-7", "Hi", True)
    assert (off["affinity"], off.get("affinity_key")) == (False, None)
    assert "affinity" not in plain and "affinity_key" not in plain


async def test_the_command_lines_affinity_applies_to_bodies_that_set_none() -> None:
    client = _Client(completion())
    command_line = {"affinity": False}
    await run_one(client, read_one(line("a", {"prompt": "Hi"})), command_line)
    await run_one(client, read_one(line("b", {"prompt": "Hi", "affinity_key": "doc-7"})), command_line)
    assert client.submitted[0]["affinity"] is False
    assert client.submitted[1]["affinity_key"] == "doc-7" and client.submitted[1].get("affinity", True) is True


BAD_AFFINITY: list[tuple[dict[str, Any], str]] = [
    ({"affinity_key": ""}, "affinity_key must be a non-empty string, got ''"),
    ({"affinity_key": 7}, "affinity_key must be a non-empty string, got 7"),
    ({"affinity_key": "k" * 257}, "affinity_key is 257 characters; the limit is 256"),
    ({"affinity": "off"}, "affinity must be true or false, got 'off'"),
    ({"affinity": 0}, "affinity must be true or false, got 0"),
]


@pytest.mark.parametrize(("fields", "error"), BAD_AFFINITY)
async def test_a_bad_affinity_field_is_a_400_line_without_submitting(fields: dict[str, Any], error: str) -> None:
    client = _Client(completion())
    result = await run_one(client, read_one(line("a", {"prompt": "Hi", **fields})))
    assert client.submitted == []
    assert (result["custom_id"], result["response"]["status_code"], result["error"]) == ("a", 400, error)


async def test_a_malformed_line_is_written_as_a_400_error_line() -> None:
    result = await run_one(_Client(completion()), read_one("{oops"))
    assert (result["custom_id"], result["response"]["status_code"]) == (None, 400)
    assert result["error"].startswith("line 1: not valid JSON")


async def test_redis_failing_ends_the_batch_instead_of_writing_a_line() -> None:
    client = _Client(completion(), on_submit=RedisConnectionError("refused"))
    out = io.StringIO()
    progress = Progress(disable=True)
    run = BatchRun(client, out, progress, progress.add_task("batch", total=1))  # type: ignore[arg-type]
    with pytest.raises(RedisConnectionError):
        await run.run([read_one(line("a", {"prompt": "Hi"}))])
    assert out.getvalue() == ""
