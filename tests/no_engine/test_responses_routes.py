"""The stored Responses API responses over HTTP, with no engine: a gateway served in-process
(as the gateway's Redis role), the test playing the worker by writing a request's replay log.
A stored response is read back whole and as its events from the log, the same events on
every reading, ``starting_after`` dropping those a client has; what cannot be read is a 404
in OpenAI's error shape (unknown, not stored, another key's), a malformed request a 400,
and a refused request stores nothing."""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
import redis.asyncio as aioredis
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from devkit.redis_server import RedisServer
from gateway.response_store import ResponseStore, StoredResponse
from streamq.broker.api_keys import ApiKeyStore, KeyRecord
from streamq.protocol.names import API_KEY_NAMES_KEY, API_KEYS_KEY, REQUEST_KEY_PREFIX, RESPONSE_KEY_PREFIX
from streamq.protocol.roles import GATEWAY
from tests.support.gateway_in_process import gateway_client
from tests.support.play_worker import play_worker

EVENTS = TypeAdapter(ResponseStreamEvent)
OPERATOR_KEY = "operator-secret"


@pytest.fixture
async def http(redis_server: RedisServer) -> AsyncIterator[httpx.AsyncClient]:
    async with gateway_client(redis_server.url_for(GATEWAY)) as (_, client):
        yield client


async def stored_and_played(admin: aioredis.Redis, *texts: str) -> str:
    """A stored response whose request (played here) wrote ``texts`` and ended; its id."""
    request_id = uuid.uuid4().hex
    body = {"model": "m", "input": "Hi", "background": True}
    await ResponseStore(admin).save(request_id, StoredResponse(body=body, model="m", created_at=1700000000))
    await play_worker(admin, request_id, *texts)
    return f"resp_{request_id}"


def events_of(text: str) -> list[Any]:
    return [EVENTS.validate_json(block.split("\ndata: ", 1)[1]) for block in text.split("\n\n") if "data: " in block]


def assert_openai_error(response: httpx.Response, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return dict(error)


async def test_a_stored_response_is_read_back_whole_from_its_log(
    http: httpx.AsyncClient, admin: aioredis.Redis
) -> None:
    response_id = await stored_and_played(admin, "Hel", "lo")
    got = await http.get(f"/v1/responses/{response_id}")
    assert got.status_code == 200, got.text
    response = Response.model_validate(got.json())
    assert (response.id, response.status, response.output_text) == (response_id, "completed", "Hello")
    assert response.created_at == 1700000000 and response.background is True


async def test_its_events_are_the_same_on_every_reading_and_starting_after_drops_the_first(
    http: httpx.AsyncClient, admin: aioredis.Redis
) -> None:
    response_id = await stored_and_played(admin, "Hel", "lo", "!")
    first = events_of((await http.get(f"/v1/responses/{response_id}", params={"stream": "true"})).text)
    again = events_of((await http.get(f"/v1/responses/{response_id}", params={"stream": "true"})).text)
    assert [e.model_dump() for e in first] == [e.model_dump() for e in again]
    assert [e.sequence_number for e in first] == list(range(len(first)))
    assert first[-1].type == "response.completed" and first[-1].response.output_text == "Hello!"
    resumed = await http.get(f"/v1/responses/{response_id}", params={"stream": "true", "starting_after": "4"})
    assert [e.model_dump() for e in events_of(resumed.text)] == [e.model_dump() for e in first[5:]]


@pytest.mark.parametrize("response_id", ["resp_" + "0" * 32, "resp_", "nothing-like-an-id", "resp_bad id"])
async def test_an_unknown_response_is_a_404(http: httpx.AsyncClient, response_id: str) -> None:
    assert "not found" in assert_openai_error(await http.get(f"/v1/responses/{response_id}"), 404)["message"]
    assert_openai_error(await http.post(f"/v1/responses/{response_id}/cancel"), 404)


@pytest.mark.parametrize("starting_after", ["abc", "-5", "1.5"])
async def test_a_malformed_starting_after_is_a_400_naming_it(
    http: httpx.AsyncClient, admin: aioredis.Redis, starting_after: str
) -> None:
    response_id = await stored_and_played(admin, "x")
    got = await http.get(f"/v1/responses/{response_id}", params={"stream": "true", "starting_after": starting_after})
    assert assert_openai_error(got, 400)["param"] == "starting_after"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"model": "m", "input": [{"type": "computer_call", "id": "c"}]}, "input"),
        ({"model": "m", "input": "x", "background": True, "store": False}, "background"),
        ({"model": "m", "input": "x", "background": True, "tools": [{"type": "file_search"}]}, "tools"),
        ({"model": "m", "input": "x", "previous_response_id": "resp_" + "1" * 32}, None),
    ],
)
async def test_a_refused_request_stores_nothing(
    http: httpx.AsyncClient, admin: aioredis.Redis, body: dict[str, Any], param: str | None
) -> None:
    before = set(await admin.keys(RESPONSE_KEY_PREFIX + "*"))
    got = await http.post("/v1/responses", json=body)
    error = assert_openai_error(got, 404 if param is None else 400)
    assert error["param"] == param
    assert set(await admin.keys(RESPONSE_KEY_PREFIX + "*")) == before


async def test_a_key_stored_in_redis_reads_only_its_own_responses(
    redis_server: RedisServer, admin: aioredis.Redis
) -> None:
    response_id = await stored_and_played(admin, "secret")
    await admin.set(REQUEST_KEY_PREFIX + response_id.removeprefix("resp_"), "someone-else")
    secret = await ApiKeyStore(admin).create(KeyRecord(f"tenant-{uuid.uuid4().hex[:8]}"))
    try:
        async with gateway_client(redis_server.url_for(GATEWAY), api_keys=[OPERATOR_KEY]) as (_, http):
            mine = {"Authorization": f"Bearer {secret}"}
            assert_openai_error(await http.get(f"/v1/responses/{response_id}", headers=mine), 404)
            streamed = await http.get(f"/v1/responses/{response_id}", params={"stream": "true"}, headers=mine)
            assert_openai_error(streamed, 404)
            assert_openai_error(await http.post(f"/v1/responses/{response_id}/cancel", headers=mine), 404)
            operator = {"Authorization": f"Bearer {OPERATOR_KEY}"}
            got = await http.get(f"/v1/responses/{response_id}", headers=operator)
            assert got.status_code == 200 and json.loads(got.text)["output"][0]["content"][0]["text"] == "secret"
    finally:
        await admin.delete(API_KEYS_KEY, API_KEY_NAMES_KEY)


def requests_counted(metrics: str, endpoint: str, status: int) -> float:
    """``streamq_gateway_requests_total`` of ``endpoint`` and ``status`` on a ``/metrics`` page."""
    label = f'streamq_gateway_requests_total{{endpoint="{endpoint}",status="{status}"}}'
    lines = [line for line in metrics.splitlines() if line.startswith(label)]
    return float(lines[0].rsplit(" ", 1)[1]) if lines else 0.0


async def test_reads_and_cancels_are_counted_by_route_not_by_id(http: httpx.AsyncClient, admin: aioredis.Redis) -> None:
    """The gateway's requests counter labels a stored response's routes by their template,
    so a label never names a response."""
    response_id = await stored_and_played(admin, "a")
    route, cancel = "/v1/responses/{response_id}", "/v1/responses/{response_id}/cancel"
    before = (await http.get("/metrics")).text
    assert (await http.get(f"/v1/responses/{response_id}")).status_code == 200
    assert (await http.get(f"/v1/responses/resp_{uuid.uuid4().hex}")).status_code == 404
    assert (await http.post(f"/v1/responses/{response_id}/cancel")).status_code == 200
    after = (await http.get("/metrics")).text
    for endpoint, status in ((route, 200), (route, 404), (cancel, 200)):
        assert requests_counted(after, endpoint, status) == requests_counted(before, endpoint, status) + 1
    assert response_id not in after
