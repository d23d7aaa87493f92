"""The Lua scripts of the protocol: every file is used, every name used exists, a
non-editable install carries them, and the prelude every script begins with spells the
keys as ``names`` does."""

from __future__ import annotations

import fnmatch
import hashlib
import re
import tomllib
from collections.abc import Callable
from pathlib import Path

import pytest
import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from streamq.broker.registry import WorkerRegistry
from streamq.protocol import names
from streamq.protocol.script_calls import CALLS, Enqueue
from streamq.protocol.scripts import PRELUDE, Script, script_names, script_source, script_text

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
    for name in [*script_names(), PRELUDE]:
        assert any(fnmatch.fnmatch(f"lua/{name}.lua", pattern) for pattern in patterns), name


def test_the_prelude_is_no_script_and_begins_every_script() -> None:
    assert PRELUDE not in script_names()
    with pytest.raises(FileNotFoundError):
        script_text(PRELUDE)
    for name in script_names():
        assert script_text(name) == script_source(PRELUDE) + script_source(name), name


def test_a_scripts_sha_is_of_the_text_with_its_prelude() -> None:
    """What ``EVALSHA`` names (the calls packed by hand too, which use ``Script.sha``)."""
    script = Script(aioredis.Redis(), Enqueue)
    assert script.text == script_text("enqueue")
    assert script.sha == hashlib.sha1(script_text("enqueue").encode()).hexdigest()


# Each key function of the prelude, the arguments it is tried with, and names's spelling of it.
PRELUDE_KEYS: list[tuple[str, tuple[str, ...], Callable[..., str]]] = [
    ("waiting_key", ("streamq:queue", "0"), lambda q, prio: names.waiting_key(q, int(prio))),
    ("waiting_key", ("streamq:queue:b", "-3"), lambda q, prio: names.waiting_key(q, int(prio))),
    ("queue_waiting_key", ("streamq:queue:b",), names.queue_waiting_key),
    ("running_key", ("streamq:queue",), names.running_key),
    ("affinity_free_key", ("streamq:queue:b", "w-1"), names.affinity_free_key),
    ("affinity_worker_key", ("streamq:queue", "ab12"), names.affinity_worker_key),
]


def test_the_prelude_defines_just_the_keys_tried_here() -> None:
    defined = re.findall(r"^local function (\w+)\(", script_source(PRELUDE), re.MULTILINE)
    assert sorted(defined) == sorted({name for name, _, _ in PRELUDE_KEYS})


@pytest.mark.parametrize(
    ("function", "args", "spelled"), PRELUDE_KEYS, ids=[f"{f}{args}" for f, args, _ in PRELUDE_KEYS]
)
async def test_the_preludes_key_is_the_one_names_spells(
    raw_redis: aioredis.Redis, function: str, args: tuple[str, ...], spelled: Callable[..., str]
) -> None:
    """Run in Redis, the prelude's function names the key ``names`` does."""
    lua = script_source(PRELUDE) + f"return {function}(unpack(ARGV))"
    assert await raw_redis.eval(lua, 0, *args) == spelled(*args).encode()


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
