"""The Lua scripts of the protocol (``lua/<name>.lua``, each behind ``lua/_keys.lua``), loaded by name.

They are the Redis side of the contract: what each one reads and writes is part of
the wire format, so they live beside the names and schemas, not in the modules
that run them. Each is run with its typed call (``streamq.protocol.script_calls``):
``Script(redis, Enqueue)`` once per client, then ``await script(Enqueue(...))``."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterable, Sequence
from importlib import resources
from typing import Any, Generic, TypeVar

from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster
from redis.commands.core import AsyncScript
from redis.exceptions import NoScriptError, ResponseError

from streamq.protocol.script_calls import ScriptCall

C = TypeVar("C", bound=ScriptCall)
LOAD_TRIES = 3
"""How many times a call loads its script where Redis keeps forgetting it (scripts flushed
again between the load and the run): a worker must not die of a ``SCRIPT FLUSH``."""

_LUA = resources.files(__package__).joinpath("lua")


PRELUDE = "_keys"
"""``lua/_keys.lua``: the key names the scripts share (local functions), spelled as ``names``
spells them; every script's text begins with it. Not a script itself (its name starts with
``_``, as any other such file's would)."""


def script_names() -> list[str]:
    """Every script the package carries, by name (not the prelude)."""
    return sorted(
        entry.name.removesuffix(".lua")
        for entry in _LUA.iterdir()
        if entry.name.endswith(".lua") and not entry.name.startswith("_")
    )


@functools.cache
def script_source(name: str) -> str:
    """The file ``lua/<name>.lua`` as written, read once (raises ``FileNotFoundError`` for an
    unknown name): a script's header is its first lines."""
    return _LUA.joinpath(f"{name}.lua").read_text(encoding="utf-8")


@functools.cache
def script_text(name: str) -> str:
    """What Redis runs as script ``name``: the prelude, then the script's source (raises
    ``FileNotFoundError`` for an unknown name). Its SHA-1 is the script's ``EVALSHA`` sha."""
    if name.startswith("_"):
        raise FileNotFoundError(f"{name} is not a script")
    return script_source(PRELUDE) + script_source(name)


class Script(Generic[C]):
    """Script ``call.script`` bound to ``redis``, run with calls of type ``call``: ``await
    script(call(...))`` runs it by ``EVALSHA``, loading it on first use and again where a
    restarted Redis forgot it. A call that only reads (``read_only``) runs by
    ``EVALSHA_RO``: Redis then checks its declared keys as read (``EVALSHA`` checks them as
    written too), so a user that may only read them can run it, and Redis refuses any write
    it tries. A Redis older than 7.0 runs it by ``EVALSHA``."""

    def __init__(self, redis: Redis | RedisCluster, call: type[C]) -> None:
        self.text = script_text(call.script)
        self._redis = redis
        self._script: AsyncScript = redis.register_script(self.text)  # type: ignore[misc]  # RedisCluster has it too
        self.sha: str = self._script.sha
        self._read_only = call.read_only

    async def __call__(self, call: C) -> Any:
        keys, args = call.flat()
        for _ in range(LOAD_TRIES - 1):
            with contextlib.suppress(NoScriptError):  # forgotten again between its load and its run
                return await self._run(keys, args)
        return await self._run(keys, args)

    async def _run(self, keys: Sequence[Any], args: Sequence[Any]) -> Any:
        """One call, loading the script once where Redis has forgotten it (a restart, a
        ``SCRIPT FLUSH``); ``NoScriptError`` if it was forgotten again meanwhile."""
        if not self._read_only:
            return await self._script(keys=keys, args=args)
        command = ("EVALSHA_RO", self.sha, len(keys), *keys, *args)
        try:
            return await self._redis.execute_command(*command)
        except NoScriptError:  # a restarted Redis has forgotten it
            await self._redis.script_load(self.text)
            return await self._redis.execute_command(*command)
        except ResponseError as exc:
            if "unknown command" not in str(exc).lower():
                raise
            self._read_only = False
            return await self._script(keys=keys, args=args)

    async def pipelined(self, calls: Iterable[C], *, raise_on_error: bool = True) -> list[Any]:
        """Every call in one round trip, by ``EVALSHA`` in a plain pipeline (redis-py's own
        script pipelining asks ``SCRIPT EXISTS`` first, which a producer's Redis user may not
        run); a Redis that forgot the script gets it loaded, and the calls it refused sent
        again (they did not run). The replies, in order; the first error reply raises, or
        (``raise_on_error`` false) each call's error is its reply."""
        commands = [call.command(self.sha) for call in calls]
        replies = await self._send(commands, raise_on_error=False)
        for _ in range(LOAD_TRIES):
            forgotten = [i for i, reply in enumerate(replies) if isinstance(reply, NoScriptError)]
            if not forgotten:
                break
            await self._redis.script_load(self.text)  # a restarted Redis, a SCRIPT FLUSH
            again = await self._send([commands[i] for i in forgotten], raise_on_error=False)
            for i, reply in zip(forgotten, again, strict=True):
                replies[i] = reply
        if raise_on_error:
            for reply in replies:
                if isinstance(reply, BaseException):
                    raise reply
        return replies

    async def then(self, call: C, *commands: tuple[Any, ...]) -> list[Any]:
        """``call`` by ``EVALSHA``, then ``commands`` (a ``WAIT`` that covers its write: the
        same connection), in one pipeline: the call's reply (its error reply raised) and each
        command's (an error reply as its exception); a Redis that forgot the script gets it
        loaded, and all of it sent again."""
        sent = [call.command(self.sha), *commands]
        replies = await self._send(sent, raise_on_error=False)
        if isinstance(replies[0], NoScriptError):  # a restarted Redis has forgotten it
            await self._redis.script_load(self.text)
            replies = await self._send(sent, raise_on_error=False)
        if isinstance(replies[0], BaseException):
            raise replies[0]
        return replies

    async def _send(self, commands: list[tuple[Any, ...]], *, raise_on_error: bool = True) -> list[Any]:
        async with self._redis.pipeline(transaction=False) as pipe:
            for command in commands:
                pipe.execute_command(*command)
            return await pipe.execute(raise_on_error=raise_on_error)
