"""The client streamq's own services run on: the gateway, its dashboard and exporter, the
development tools and the tests.

It is ``StreamqClient`` plus what only they need: the Redis pool underneath (for the stores
that share it: API keys, per-key limits, the dashboard's samples), the registry as a whole,
and the cheap reads that decide how to answer a request (does it exist, how did it end).
These are not the public client's, and may change with the services that use them.
"""

from __future__ import annotations

from arq.connections import ArqRedis

from producer.client import StreamqClient
from producer.errors import redis_errors_as_streamq_errors
from streamq.broker.data_plane import DataRedis
from streamq.broker.registry import Routes
from streamq.protocol import JOB_KEY_PREFIX, Event, decode_event

__all__ = ["InternalClient"]


class InternalClient(StreamqClient):
    """``StreamqClient`` with the Redis it runs on and the registry and log reads of
    streamq's own services (``connect`` as the public client's)."""

    @property
    def redis(self) -> ArqRedis:
        """The Redis pool underneath, for a store that shares it rather than open another.
        Commands sent on it bypass the client's checks; closing the client closes it."""
        return self._redis

    @property
    def data(self) -> DataRedis:
        """The data plane's client (each request's log and channel): ``redis`` itself unless
        a Redis Cluster carries the events. Closing the client closes it."""
        return self._data

    async def routes(self) -> Routes:
        """The live workers (model, queue, slots) and every model ever registered."""
        return await self._routes()

    async def routes_serving(self, model: str) -> Routes:
        """``routes()``, reused for a second while they show ``model`` live: the read ``submit``
        makes, so a route that looks its model up first costs no second registry read."""
        return await self._routes_serving(model)

    def models_waiting(self, routes: Routes) -> dict[str, str]:
        """Model name -> queue, for each model with no live worker in ``routes`` that still
        takes requests (they wait for its next worker): declared, or served within
        ``model_memory_s``."""
        live = routes.live_models()
        remembered = {
            model: queue
            for model, queue in routes.known_models.items()
            if model not in live and routes.seen_within(model, self.model_memory_s)
        }
        return remembered | {model: queue for model, queue in self.declared_models.items() if model not in live}

    @redis_errors_as_streamq_errors
    async def last_event(self, request_id: str) -> Event | None:
        """The newest event in the request's replay log, ``None`` if it holds none: a final
        or error event there means the request has ended, and at which event."""
        raw = await self._log.last(request_id)
        return None if raw is None else decode_event(raw)

    @redis_errors_as_streamq_errors
    async def exists(self, request_id: str) -> bool:
        """True if ``request_id`` is queued or has events in the replay log: something to follow."""
        if await self._redis.exists(JOB_KEY_PREFIX + request_id):
            return True
        return await self._log.exists(request_id)
