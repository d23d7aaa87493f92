"""The Lua scripts of the protocol: every file is used, every name used exists, and a
non-editable install carries them."""

from __future__ import annotations

import fnmatch
import re
import tomllib
from pathlib import Path

import pytest
import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from streamq.broker.registry import WorkerRegistry
from streamq.protocol.script_calls import CALLS
from streamq.protocol.scripts import script_names, script_text

ROOT = Path(__file__).resolve().parents[2]
PRODUCT_PACKAGES = ("streamq", "producer", "worker", "gateway")
BOUND = re.compile(r"\bScript\([^,()]+,\s*(?:script_calls\.)?([A-Z]\w+)\)")


def registered_names() -> set[str]:
    """The scripts of the calls bound by ``Script(redis, <call>)`` anywhere in product code."""
    scripts = {call.__name__: name for name, call in CALLS.items()}
    return {
        scripts[call]
        for package in PRODUCT_PACKAGES
        for source in (ROOT / package).rglob("*.py")
        for call in BOUND.findall(source.read_text(encoding="utf-8"))
    }


def test_every_script_file_is_registered_by_some_module() -> None:
    assert script_names(), "no Lua scripts found"
    assert set(script_names()) <= registered_names()


def test_every_registered_name_loads() -> None:
    for name in registered_names():
        assert "redis.call" in script_text(name)


def test_an_unknown_name_fails_loudly() -> None:
    with pytest.raises(FileNotFoundError):
        script_text("no_such_script")


def test_package_data_carries_every_script() -> None:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    patterns = config["tool"]["setuptools"]["package-data"]["streamq.protocol"]
    for name in script_names():
        assert any(fnmatch.fnmatch(f"lua/{name}.lua", pattern) for pattern in patterns), name


async def test_every_script_compiles_in_redis(raw_redis: aioredis.Redis) -> None:
    for name in script_names():
        assert await raw_redis.script_load(script_text(name)), name


async def test_a_read_only_script_runs_by_evalsha_where_redis_lacks_evalsha_ro(
    raw_redis: aioredis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Redis before 7.0 has no ``EVALSHA_RO``: the registry read still works there."""
    real = raw_redis.execute_command
    sent: list[str] = []

    async def before_redis_7(*args: object, **options: object) -> object:
        sent.append(str(args[0]))
        if args[0] == "EVALSHA_RO":
            raise ResponseError("unknown command 'EVALSHA_RO', with args beginning with: ")
        return await real(*args, **options)

    monkeypatch.setattr(raw_redis, "execute_command", before_redis_7)
    registry = WorkerRegistry(raw_redis)
    assert isinstance((await registry.routes()).known_models, dict)
    assert isinstance((await registry.routes()).known_models, dict)
    assert sent.count("EVALSHA_RO") == 1 and "EVALSHA" in sent
