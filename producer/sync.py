"""The blocking client, for code that runs no event loop: a Flask or Django view, a Celery
task, a script, a notebook cell.

    from producer.sync import StreamqClient

    with StreamqClient.connect() as client:  # $REDIS_URL and $STREAMQ_QUEUE, or the defaults
        print(client.generate("The key to happiness is", max_tokens=32).text)
        with client.submit("Once upon a time", max_tokens=32) as handle:
            for text in handle.text():
                print(text, end="", flush=True)

The same methods, arguments, results and errors as ``producer.StreamqClient``, which it
runs underneath (one implementation of the protocol): on an event loop of its own, in a
daemon thread, where every call runs while the calling thread waits. So any number of
threads may share one client (one Redis pool, one pub/sub connection), and a call from
inside another running event loop (a notebook's) does not deadlock; only a call from the
client's own loop, which would wait for itself, is refused. A call interrupted (Ctrl-C)
cancels what it was waiting for.
"""

from __future__ import annotations

import asyncio
import functools
import threading
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Coroutine, Iterable, Iterator, Mapping
from types import TracebackType
from typing import Any, Concatenate, Literal, ParamSpec, TypeVar, Unpack, overload

from producer import client as aio
from producer.client import Completion, ConnectOptions
from streamq.protocol import Event, StreamqError
from streamq.protocol.status import RequestState

__all__ = ["RequestHandle", "StreamqClient"]

P = ParamSpec("P")
R = TypeVar("R")
T = TypeVar("T")


class _Loop:
    """An event loop running in a daemon thread of its own, on which coroutines are run
    from other threads, each caller waiting for its own."""

    def __init__(self) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="streamq-client", daemon=True)
        self._thread.start()

    def run(self, work: Awaitable[T]) -> T:
        """Run ``work`` on the loop and wait for its result (or its error)."""
        if threading.current_thread() is self._thread:
            if isinstance(work, Coroutine):
                work.close()
            raise StreamqError(
                "a blocking streamq call from the client's own event loop would wait for itself: "
                "in async code, use producer.StreamqClient"
            )
        future = asyncio.run_coroutine_threadsafe(_awaiting(work), self._loop)
        try:
            return future.result()
        except BaseException:
            future.cancel()  # Ctrl-C (or any interruption of the wait): stop the work too
            raise

    def stop(self) -> None:
        """Stop the loop and its thread (every call made through it has returned)."""
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()


async def _awaiting(work: Awaitable[T]) -> T:
    """``work`` as a coroutine (the loop runs coroutines; ``anext`` gives an awaitable)."""
    return await work


def _blocking(
    method: Callable[Concatenate[aio.StreamqClient, P], Awaitable[R]],
) -> Callable[Concatenate[StreamqClient, P], R]:
    """``method`` of the async client as a blocking method, its arguments, result and
    docstring kept (for type checkers too)."""

    @functools.wraps(method)
    def call(self: StreamqClient, /, *args: P.args, **kwargs: P.kwargs) -> R:
        return self._loop.run(method(self._async, *args, **kwargs))

    return call


def _blocking_handle(
    method: Callable[Concatenate[aio.StreamqClient, P], Awaitable[aio.RequestHandle]],
) -> Callable[Concatenate[StreamqClient, P], RequestHandle]:
    """``method`` (``submit``, ``follow``) as a blocking method returning a blocking handle."""

    @functools.wraps(method)
    def call(self: StreamqClient, /, *args: P.args, **kwargs: P.kwargs) -> RequestHandle:
        return RequestHandle(self._loop.run(method(self._async, *args, **kwargs)), self._loop)

    return call


class _Closes:
    """``with`` closes it."""

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self: T) -> T:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


class RequestHandle(_Closes):
    """The events of one request, as ``producer.RequestHandle`` gives them, for a plain
    ``for``: ``for event in handle``, ``for text in handle.text()``, ``handle.result()``; as
    ``with``, closed on exit (cancelling the request with ``cancel_on_close``)."""

    def __init__(self, handle: aio.RequestHandle, loop: _Loop) -> None:
        self._handle = handle
        self._loop = loop
        self.request_id = handle.request_id
        self.job_queue = handle.job_queue

    @property
    def done(self) -> bool:
        """True once the final or error event has been seen."""
        return self._handle.done

    @property
    def last_digest(self) -> str | None:
        """The digest of the last event delivered (``producer.RequestHandle.last_digest``):
        ``follow``'s ``after``, to resume exactly."""
        return self._handle.last_digest

    def __iter__(self) -> Iterator[Event]:
        return self._pull(self._handle.__aiter__())

    def text(self) -> Iterator[str]:
        """The request's text as it comes (``producer.RequestHandle.text``)."""
        return self._pull(self._handle.text())

    def _pull(self, items: AsyncIterator[T]) -> Iterator[T]:
        while True:
            try:
                yield self._loop.run(anext(items))
            except StopAsyncIteration:
                return

    def result(self, timeout: float | None = None) -> Completion:
        """The whole output once the request ends (``producer.RequestHandle.result``)."""
        return self._loop.run(self._handle.result(timeout))

    def cancel(self) -> RequestState:
        """Cancel the request (``producer.RequestHandle.cancel``)."""
        return self._loop.run(self._handle.cancel())

    def close(self) -> None:
        """Stop following the request (``producer.RequestHandle.close``)."""
        self._loop.run(self._handle.close())


class StreamqClient(_Closes):
    """``producer.StreamqClient``, blocking: ``StreamqClient.connect()``, then its methods
    as the async client's (their docstrings are the async client's own)."""

    def __init__(self, client: aio.StreamqClient, loop: _Loop) -> None:
        self._async = client
        self._loop = loop
        self.queue = client.queue

    @classmethod
    def connect(cls, url: str | None = None, **options: Unpack[ConnectOptions]) -> StreamqClient:
        """``producer.StreamqClient.connect``, blocking: the same arguments, the same
        ``ConnectionFailed`` within ``connect_timeout_s``."""
        loop = _Loop()
        try:
            return cls(loop.run(aio.StreamqClient.connect(url, **options)), loop)
        except BaseException:
            loop.stop()
            raise

    submit = _blocking_handle(aio.StreamqClient.submit)
    follow = _blocking_handle(aio.StreamqClient.follow)
    generate = _blocking(aio.StreamqClient.generate)
    embed = _blocking(aio.StreamqClient.embed)
    classify = _blocking(aio.StreamqClient.classify)
    cancel = _blocking(aio.StreamqClient.cancel)
    status = _blocking(aio.StreamqClient.status)
    live_models = _blocking(aio.StreamqClient.live_models)

    @overload
    def generate_many(
        self,
        requests: Iterable[str | Mapping[str, Any]],
        *,
        max_in_flight: int | None = None,
        return_exceptions: Literal[False] = False,
        **common: Any,
    ) -> Iterator[Completion]: ...

    @overload
    def generate_many(
        self,
        requests: Iterable[str | Mapping[str, Any]],
        *,
        max_in_flight: int | None = None,
        return_exceptions: Literal[True],
        **common: Any,
    ) -> Iterator[Completion | StreamqError]: ...

    def generate_many(
        self,
        requests: Iterable[str | Mapping[str, Any]],
        *,
        max_in_flight: int | None = None,
        return_exceptions: bool = False,
        **common: Any,
    ) -> Iterator[Completion | StreamqError]:
        """Each request's ``Completion`` as it ends (``producer.StreamqClient.generate_many``):
        ``for completion in client.generate_many(prompts, max_tokens=32)``. Leaving the loop
        early cancels what is still in flight."""
        many: AsyncGenerator[Completion | StreamqError, None]
        if return_exceptions:
            many = self._async.generate_many(requests, max_in_flight=max_in_flight, return_exceptions=True, **common)
        else:
            many = self._async.generate_many(requests, max_in_flight=max_in_flight, **common)
        try:
            while True:
                try:
                    yield self._loop.run(anext(many))
                except StopAsyncIteration:
                    return
        finally:
            self._loop.run(many.aclose())

    def close(self) -> None:
        """Close the connections and stop the client's thread."""
        try:
            self._loop.run(self._async.close())
        finally:
            self._loop.stop()
