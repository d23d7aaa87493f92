"""The Lua scripts of the protocol (``lua/<name>.lua``), loaded by name.

They are the Redis side of the contract: what each one reads and writes is part of
the wire format, so they live beside the names and schemas, not in the modules
that run them."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from importlib import resources
from typing import Any

from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster
from redis.commands.core import AsyncScript
from redis.exceptions import NoScriptError, ResponseError

_LUA = resources.files(__package__).joinpath("lua")


def script_names() -> list[str]:
    """Every script the package carries, by name."""
    return sorted(entry.name.removesuffix(".lua") for entry in _LUA.iterdir() if entry.name.endswith(".lua"))


@functools.cache
def script_text(name: str) -> str:
    """The source of script ``name``, read once (raises ``FileNotFoundError`` for an unknown name)."""
    return _LUA.joinpath(f"{name}.lua").read_text(encoding="utf-8")


def register_script(redis: Redis | RedisCluster, name: str) -> AsyncScript:
    """Script ``name`` bound to ``redis``: called with ``keys`` and ``args``, it runs by
    EVALSHA and loads itself on first use."""
    return redis.register_script(script_text(name))  # type: ignore[misc]  # RedisCluster has it too


class ReadOnlyScript:
    """A script that only reads, run by ``EVALSHA_RO``: Redis then checks its declared keys
    as read (``EVALSHA`` checks them as written too), so a user that may only read them can
    run it, and Redis refuses any write it tries. A Redis older than 7.0 runs it by ``EVALSHA``."""

    def __init__(self, redis: Redis | RedisCluster, name: str) -> None:
        self._redis = redis
        self._script = register_script(redis, name)
        self._read_only = True

    async def __call__(self, keys: Sequence[str], args: Sequence[Any] = ()) -> Any:
        if not self._read_only:
            return await self._script(keys=keys, args=args)
        command = ("EVALSHA_RO", self._script.sha, len(keys), *keys, *args)
        try:
            return await self._redis.execute_command(*command)
        except NoScriptError:  # a restarted Redis has forgotten it
            await self._redis.script_load(self._script.script)
            return await self._redis.execute_command(*command)
        except ResponseError as exc:
            if "unknown command" not in str(exc).lower():
                raise
            self._read_only = False
            return await self._script(keys=keys, args=args)
