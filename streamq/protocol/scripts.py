"""The Lua scripts of the protocol (``lua/<name>.lua``), loaded by name.

They are the Redis side of the contract: what each one reads and writes is part of
the wire format, so they live beside the names and schemas, not in the modules
that run them."""

from __future__ import annotations

import functools
from importlib import resources

from redis.asyncio import Redis
from redis.commands.core import AsyncScript

_LUA = resources.files(__package__).joinpath("lua")


def script_names() -> list[str]:
    """Every script the package carries, by name."""
    return sorted(entry.name.removesuffix(".lua") for entry in _LUA.iterdir() if entry.name.endswith(".lua"))


@functools.cache
def script_text(name: str) -> str:
    """The source of script ``name``, read once (raises ``FileNotFoundError`` for an unknown name)."""
    return _LUA.joinpath(f"{name}.lua").read_text(encoding="utf-8")


def register_script(redis: Redis, name: str) -> AsyncScript:
    """Script ``name`` bound to ``redis``: called with ``keys`` and ``args``, it runs by
    EVALSHA and loads itself on first use."""
    return redis.register_script(script_text(name))
