"""The no-engine tier (``make test-no-engine``): pure parts and checks against Redis, a
gateway or the command line, with no engine and no worker; about a minute in all."""

from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis

from devkit.redis_server import RedisServer


@pytest.fixture
async def admin(redis_server: RedisServer) -> AsyncIterator[aioredis.Redis]:
    """A connection as the harness's own user, granted everything: to fake or inspect
    state no component may touch."""
    client = aioredis.Redis.from_url(redis_server.url)
    yield client
    await client.aclose()
