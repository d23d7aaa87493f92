"""What ``StreamqClient.connect`` returns: the connection under way, to be awaited or
entered, as the SDKs beside it read (``async with AsyncOpenAI() as client``)::

    async with StreamqClient.connect() as client:    # closed on exit
        ...
    client = await StreamqClient.connect()            # closed by the caller
"""

from __future__ import annotations

from collections.abc import Coroutine, Generator
from types import TracebackType
from typing import Any, Generic, Protocol, TypeVar


class _Closing(Protocol):
    async def close(self) -> None: ...


C = TypeVar("C", bound=_Closing)


class Connecting(Generic[C]):
    """A connection being opened: ``await`` it for the client, or use it as ``async with``,
    which closes the client on exit."""

    def __init__(self, opening: Coroutine[Any, Any, C]) -> None:
        self._opening = opening
        self._client: C | None = None

    def __await__(self) -> Generator[Any, None, C]:
        return self._opening.__await__()

    async def __aenter__(self) -> C:
        self._client = await self._opening
        return self._client

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._client is not None:
            await self._client.close()
