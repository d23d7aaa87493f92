"""Prompts stay out of the worker's log: job arguments log as their id and size."""

from __future__ import annotations

from streamq.protocol import serialize_job
from worker.redact import RedactedRequest, deserialize_job_redacted

SECRET = "my password is hunter2"


def _job(*args: object) -> bytes:
    return serialize_job({"f": "generate", "a": list(args), "k": {}, "t": 1, "et": 1_700_000_000_000})


def test_a_plain_prompt_logs_as_its_id_and_size_only() -> None:
    (request,) = deserialize_job_redacted(_job({"request_id": "r1", "prompt": SECRET}))["a"]
    assert SECRET not in repr(request)
    assert "'r1'" in repr(request) and f"{len(SECRET)} characters" in repr(request)


def test_chat_messages_are_counted_and_hidden() -> None:
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": SECRET}]
    (request,) = deserialize_job_redacted(_job({"request_id": "r2", "messages": messages}))["a"]
    assert SECRET not in repr(request) and "be brief" not in repr(request)
    assert f"{len('be brief') + len(SECRET)} characters" in repr(request)


def test_the_job_function_still_gets_the_request_as_sent() -> None:
    sent = {"request_id": "r3", "prompt": SECRET, "sampling": {"max_tokens": 4}}
    job = deserialize_job_redacted(_job(sent, 7))
    assert job["a"] == [sent, 7]
    assert isinstance(job["a"][0], RedactedRequest) and job["a"][1] == 7
    assert job["f"] == "generate"
