"""Priority and tenant at each input boundary: the library (as the producer's ACL user,
what lands in the claim's index), the CLI, batch options, OpenAI bodies and the
``tenants`` command's weights in Redis. Bad values are refused before anything is sent."""

from __future__ import annotations

import argparse
import uuid

import pytest
import redis.asyncio as aioredis

from devkit.redis_server import RedisServer
from producer import tenants_cli
from producer.cli import build_parser, with_default_subcommand
from producer.client import StreamqClient
from producer.openai_api.requests import chat_request_to_submit_kwargs, completion_request_to_submit_kwargs
from streamq.protocol import InvalidRequest
from streamq.protocol.names import TENANT_WEIGHTS_KEY, waiting_key
from streamq.protocol.roles import PRODUCER


def parse(argv: list[str]) -> argparse.Namespace:
    return build_parser().parse_args(with_default_subcommand(argv))


@pytest.fixture
def queue() -> str:
    return f"streamq:queue:inputs-{uuid.uuid4().hex[:8]}"


async def test_the_library_indexes_a_request_by_priority_and_tenant(
    redis_server: RedisServer, raw_redis: aioredis.Redis, queue: str
) -> None:
    async with await StreamqClient.connect(redis_server.url_for(PRODUCER), queue=queue) as client:
        first = await client.submit("a", priority=7, tenant="team-a")
        second = await client.submit("b", priority=7)
        later = await client.submit("c", defer_s=60)
        assert await raw_redis.zrank(waiting_key(queue, 7), first.request_id) == 0
        assert await raw_redis.zrank(waiting_key(queue, 7), second.request_id) == 1
        assert await raw_redis.hget(f"{queue}:indexed", first.request_id) == b"7 team-a"
        assert await raw_redis.hget(f"{queue}:indexed", second.request_id) == b"7 default"
        assert await raw_redis.zscore(f"{queue}:deferred", later.request_id) is not None
        assert await raw_redis.zrank(waiting_key(queue, 0), later.request_id) is None
        for bad in ({"tenant": "no spaces"}, {"priority": 2**31}, {"defer_s": -1}):
            with pytest.raises(InvalidRequest):
                await client.submit("x", **bad)
        for handle in (first, second, later):
            assert await client.cancel(handle.request_id) == "queued"
            await handle.close()
    assert await raw_redis.hlen(f"{queue}:indexed") == 0
    assert await raw_redis.zcard(queue) == 0


def test_submit_takes_priority_and_tenant_on_the_command_line() -> None:
    args = parse(["--priority", "-3", "--tenant", "team-a", "Hello"])
    assert (args.priority, args.tenant, args.prompts) == (-3, "team-a", ["Hello"])
    defaults = parse(["Hello"])
    assert (defaults.priority, defaults.tenant) == (0, None)


def test_batch_takes_a_default_priority_and_a_checked_tenant() -> None:
    args = parse(["batch", "in.jsonl", "out.jsonl", "--priority", "10", "--tenant", "nightly"])
    assert (args.priority, args.tenant) == (10, "nightly")
    with pytest.raises(SystemExit):
        parse(["batch", "in.jsonl", "out.jsonl", "--tenant", "bad name"])


def test_tenants_command_line_checks_names_and_weights() -> None:
    args = parse(["tenants", "set", "team-a", "--weight", "2.5"])
    assert (args.action, args.name, args.weight) == ("set", "team-a", 2.5)
    for bad in (
        ["tenants", "set", "team-a", "--weight", "0"],
        ["tenants", "set", "team-a", "--weight", "nan"],
        ["tenants", "set", "team-a"],
        ["tenants", "set", "bad name", "--weight", "1"],
        ["tenants"],
    ):
        with pytest.raises(SystemExit):
            parse(bad)


async def test_tenants_command_sets_lists_and_resets_weights(
    redis_server: RedisServer, raw_redis: aioredis.Redis, capsys: pytest.CaptureFixture[str]
) -> None:
    name = f"t-{uuid.uuid4().hex[:8]}"
    url = ["--redis-url", redis_server.url]
    assert await tenants_cli.run_tenants(parse(["tenants", "set", name, "--weight", "3", *url])) == 0
    assert float(await raw_redis.hget(TENANT_WEIGHTS_KEY, name)) == 3.0
    assert await tenants_cli.run_tenants(parse(["tenants", "list", *url])) == 0
    assert f"{name}\t3.0" in capsys.readouterr().out
    assert await tenants_cli.run_tenants(parse(["tenants", "reset", name, *url])) == 0
    assert await raw_redis.hget(TENANT_WEIGHTS_KEY, name) is None


def test_openai_bodies_take_vllms_priority() -> None:
    completion = {"model": "m", "prompt": "Hi"}
    chat = {"model": "m", "messages": [{"role": "user", "content": "Hi"}]}
    for convert, body in ((completion_request_to_submit_kwargs, completion), (chat_request_to_submit_kwargs, chat)):
        assert convert({**body, "priority": -2})["priority"] == -2
        assert "priority" not in convert(body)
        for bad in (True, "1", 1.5, 2**31):
            with pytest.raises(InvalidRequest, match="priority"):
                convert({**body, "priority": bad})


def test_the_gateway_takes_the_tenant_from_a_stored_key_else_the_header() -> None:
    from starlette.requests import Request

    from gateway.auth import Tenant
    from gateway.routes.completions import queue_tenant_of
    from producer.openai_api.errors import ApiError
    from streamq.broker.api_keys import KeyRecord

    def request(header: str | None) -> Request:
        headers = [] if header is None else [(b"x-streamq-tenant", header.encode())]
        return Request({"type": "http", "headers": headers})

    stored = Tenant("team-a", "digest", KeyRecord("team-a"))
    command_line = Tenant("static-1", "digest")
    assert queue_tenant_of(request("other"), stored) == "team-a"
    assert queue_tenant_of(request("team-b"), command_line) == "team-b"
    assert queue_tenant_of(request(None), None) is None
    with pytest.raises(ApiError) as refused:
        queue_tenant_of(request("bad name"), None)
    assert refused.value.status == 400
