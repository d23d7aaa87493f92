"""Resuming a named stream (``Last-Event-ID``) continues only the stream its client had: each
SSE event carries ``id: <seq>.<digest>`` (the digest of the event as logged), and a resume is
followed only if the replay log still holds that very event; else a 409 ``missing_events``,
never a continuation of another version (a Redis that lost writes) nor a second end. A bare
``<seq>`` and ``-1`` are taken on trust. A gateway served in-process; the test plays
the worker, writing the request's log. The same over a real worker: tests/real_engine/test_gateway.py."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
import redis.asyncio as aioredis

from gateway.routes.completions import _last_event_id
from producer.client import event_digest
from producer.openai_api.errors import ApiError
from streamq.protocol import events_channel
from streamq.protocol.names import owner_key
from tests.support.events import lose_writes
from tests.support.gateway_in_process import gateway_client
from tests.support.play_worker import play_worker

BODY = {"model": "any", "prompt": "Hi", "max_tokens": 4, "stream": True}


@pytest.fixture
async def http(gateway_url: str) -> AsyncIterator[httpx.AsyncClient]:
    async with gateway_client(gateway_url) as (_, http):
        yield http


@pytest.fixture
def request_id() -> str:
    return f"resume-{uuid.uuid4().hex}"


async def resume(http: httpx.AsyncClient, request_id: str, last_event_id: str) -> httpx.Response:
    headers = {"x-streamq-request-id": request_id, "Last-Event-ID": last_event_id}
    return await http.post("/v1/completions", json=BODY, headers=headers, timeout=10)


def sse_events(text: str) -> list[dict[str, Any]]:
    """Each SSE event as ``{"id": ..., "data": ...}`` (``id`` only where it has one)."""
    events = []
    for block in text.strip().split("\n\n"):
        fields = dict(line.split(": ", 1) for line in block.split("\n"))
        events.append(fields)
    return events


async def digests(redis: aioredis.Redis, request_id: str) -> list[str]:
    return [event_digest(fields[b"event"]) for _, fields in await redis.xrange(events_channel(request_id))]


async def test_a_named_streams_events_carry_their_seq_and_digest_and_resume_from_them(
    http: httpx.AsyncClient, raw_redis: aioredis.Redis, request_id: str
) -> None:
    await play_worker(raw_redis, request_id, "a", final=False)  # chunk 0
    streaming = asyncio.ensure_future(resume(http, request_id, "-1"))
    async with asyncio.timeout(10):  # the gateway follows it: what comes next, it hears live
        while (await raw_redis.pubsub_numsub(events_channel(request_id)))[0][1] == 0:
            await asyncio.sleep(0.02)
    await play_worker(raw_redis, request_id, "b")  # chunk 1, the end at 2
    whole = await streaming
    assert whole.status_code == 200, whole.text
    logged = await digests(raw_redis, request_id)
    events = sse_events(whole.text)
    assert [event.get("id") for event in events] == [f"{seq}.{logged[seq]}" for seq in (0, 1, 2)] + [None]
    assert events[-1] == {"data": "[DONE]"}

    rest = sse_events((await resume(http, request_id, f"0.{logged[0].upper()}")).text)
    assert [event.get("id") for event in rest] == [f"1.{logged[1]}", f"2.{logged[2]}", None]
    assert '"text":"b"' in rest[0]["data"]
    # The client has the end: [DONE] at once, nothing followed (it would wait forever).
    ended = await resume(http, request_id, f"2.{logged[2]}")
    assert (ended.status_code, ended.text) == (200, "data: [DONE]\n\n")


async def test_a_resume_from_an_event_the_log_no_longer_holds_is_a_409(
    http: httpx.AsyncClient, raw_redis: aioredis.Redis, request_id: str
) -> None:
    """Redis lost events 1 and 2 and the request went on from event 0 to another end: the
    events the client had (1, or the end at 2) are no longer the log's, so no resume follows
    from them; a bare ``<seq>`` is not checked."""
    await play_worker(raw_redis, request_id, "a", "b")
    had = await digests(raw_redis, request_id)
    await lose_writes(raw_redis, request_id, keep=1)
    await raw_redis.delete(owner_key(request_id))  # the end's mark was lost with it
    await play_worker(raw_redis, request_id, "c", "d", "e")  # 1', 2', 3', the end at 4
    for last_event_id in (f"1.{had[1]}", f"2.{had[2]}"):
        refused = await resume(http, request_id, last_event_id)
        assert refused.status_code == 409, refused.text
        error = refused.json()["error"]
        assert (error["code"], error["type"], error["param"]) == (
            "missing_events",
            "invalid_request_error",
            "Last-Event-ID",
        )
        assert f"event {last_event_id[0]} is not the one the caller had" in error["message"]
        assert "Last-Event-ID: -1" in error["message"]
    unchecked = await resume(http, request_id, "2")
    assert unchecked.status_code == 200
    assert [event.get("id", "").split(".")[0] for event in sse_events(unchecked.text)] == ["3", "4", ""]
    await lose_writes(raw_redis, request_id, keep=1)  # lost, with nothing logged since
    gone = await resume(http, request_id, f"1.{had[1]}")
    assert gone.status_code == 409 and "no longer holds it" in gone.json()["error"]["message"]


@pytest.mark.parametrize(
    ("header", "parsed"),
    [
        ("-1", (-1, None)),
        ("7", (7, None)),
        ("7.00ff00ff00ff00ff", (7, "00ff00ff00ff00ff")),
        ("7.00FF00FF00FF00FF", (7, "00ff00ff00ff00ff")),
    ],
)
def test_last_event_id_is_a_seq_with_or_without_its_digest(header: str, parsed: tuple[int, str | None]) -> None:
    assert _last_event_id(header) == parsed


@pytest.mark.parametrize("header", ["", "x", "-2", "7.", "7.abc", "-1.00ff00ff00ff00ff", "7.00ff00ff00ff00fg"])
def test_any_other_last_event_id_is_a_400(header: str) -> None:
    with pytest.raises(ApiError) as refused:
        _last_event_id(header)
    assert (refused.value.status, refused.value.param) == (400, "Last-Event-ID")


@pytest.mark.parametrize(
    ("path", "body", "advice"),
    [
        ("/v1/responses", {"model": "any", "input": "Hi", "stream": True}, "starting_after"),
        ("/v1/messages", {"model": "any", "max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}]}, "again"),
    ],
)
async def test_last_event_id_on_an_api_that_numbers_its_own_events_is_a_400_and_queues_nothing(
    http: httpx.AsyncClient, raw_redis: aioredis.Redis, request_id: str, path: str, body: dict[str, Any], advice: str
) -> None:
    """A Responses or Messages stream opens and numbers its own events: a resume by
    ``Last-Event-ID`` would start them again, so it is refused, saying what to do instead."""
    headers = {"x-streamq-request-id": request_id, "Last-Event-ID": "3"}
    refused = await http.post(path, json=body, headers=headers, timeout=10)
    assert refused.status_code == 400, refused.text
    assert "Last-Event-ID" in refused.text and advice in refused.text
    assert await raw_redis.exists(events_channel(request_id)) == 0
