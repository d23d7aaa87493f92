"""The gateway's affinity headers (docs/features/prefix-aware-pickup.md): ``X-Streamq-Affinity-Key`` names a
request's conversation, ``X-Streamq-Affinity: off`` opts it out of prefix-aware pickup, and
a bad value of either is a 400 in OpenAI's error shape before anything is queued. No
engine: the served gateway's client records what it would submit instead of queueing it."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from starlette.requests import Request

from devkit.redis_server import RedisServer
from gateway.routes.completions import AFFINITY_HEADER, AFFINITY_KEY_HEADER, affinity_of
from gateway.state import services_of
from producer.errors import QueueFull
from producer.openai_api.errors import ApiError
from streamq.protocol.roles import GATEWAY
from tests.support.gateway_in_process import gateway_client

BODY = {"model": "m", "prompt": "Hi", "max_tokens": 4}
CHAT_BODY = {"model": "m", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}


def request(headers: dict[str, str]) -> Request:
    """A bare request with `headers` (ASGI names them in lower case, as a server does)."""
    raw = [(name.lower().encode(), value.encode()) for name, value in headers.items()]
    return Request({"type": "http", "headers": raw})


def test_the_headers_become_submits_affinity_arguments() -> None:
    assert affinity_of(request({})) == {}
    assert affinity_of(request({"X-Streamq-Affinity-Key": "chat-42"})) == {"affinity_key": "chat-42"}
    assert affinity_of(request({"X-Streamq-Affinity-Key": "k" * 256})) == {"affinity_key": "k" * 256}
    for off in ("off", "false", "0", "OFF", "False"):
        assert affinity_of(request({"X-Streamq-Affinity": off})) == {"affinity": False}
    both = request({"X-Streamq-Affinity-Key": "chat-42", "X-Streamq-Affinity": "off"})
    assert affinity_of(both) == {"affinity_key": "chat-42", "affinity": False}


@pytest.mark.parametrize(
    ("headers", "param", "reason"),
    [
        ({"X-Streamq-Affinity-Key": ""}, AFFINITY_KEY_HEADER, "must be a non-empty string"),
        ({"X-Streamq-Affinity-Key": "k" * 257}, AFFINITY_KEY_HEADER, "257 characters; the limit is 256"),
        ({"X-Streamq-Affinity": "on"}, AFFINITY_HEADER, "takes only 0, false, off (to opt out), got 'on'"),
        ({"X-Streamq-Affinity": "no"}, AFFINITY_HEADER, "got 'no'"),
        ({"X-Streamq-Affinity": ""}, AFFINITY_HEADER, "got ''"),
    ],
)
def test_a_bad_header_is_a_400_naming_it(headers: dict[str, str], param: str, reason: str) -> None:
    with pytest.raises(ApiError) as refused:
        affinity_of(request(headers))
    assert (refused.value.status, refused.value.param) == (400, param)
    assert reason in str(refused.value.message)


@pytest.fixture
async def gateway(redis_server: RedisServer) -> AsyncIterator[tuple[httpx.AsyncClient, list[dict[str, Any]]]]:
    """A served gateway whose submits are recorded and answered with ``QueueFull`` (429)."""
    submitted: list[dict[str, Any]] = []

    async def submit(**kwargs: Any) -> None:
        submitted.append(kwargs)
        raise QueueFull("recorded, not queued")

    async with gateway_client(redis_server.url_for(GATEWAY)) as (app, http):
        services_of(app).client.submit = submit  # type: ignore[method-assign]
        yield http, submitted


async def test_the_headers_reach_submit(gateway: tuple[httpx.AsyncClient, list[dict[str, Any]]]) -> None:
    http, submitted = gateway
    keyed = await http.post("/v1/completions", json=BODY, headers={"X-Streamq-Affinity-Key": "chat-42"})
    off = await http.post("/v1/chat/completions", json=CHAT_BODY, headers={"X-Streamq-Affinity": "false"})
    plain = await http.post("/v1/completions", json=BODY)
    assert [r.status_code for r in (keyed, off, plain)] == [429, 429, 429]
    assert submitted[0]["affinity_key"] == "chat-42" and "affinity" not in submitted[0]
    assert submitted[1]["affinity"] is False and "affinity_key" not in submitted[1]
    assert "affinity" not in submitted[2] and "affinity_key" not in submitted[2]


async def test_a_bad_header_is_refused_in_openais_shape_before_submitting(
    gateway: tuple[httpx.AsyncClient, list[dict[str, Any]]],
) -> None:
    http, submitted = gateway
    bad = (
        ({"X-Streamq-Affinity-Key": "k" * 300}, AFFINITY_KEY_HEADER),
        ({"X-Streamq-Affinity": "yes"}, AFFINITY_HEADER),
    )
    for headers, param in bad:
        response = await http.post("/v1/completions", json=BODY, headers=headers)
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert (error["type"], error["code"], error["param"]) == ("invalid_request_error", "invalid_parameter", param)
        assert error["message"].startswith(param)
    assert submitted == []
