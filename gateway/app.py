"""The gateway application: OpenAI's API in front of the queue (``gateway.routes``), the
dashboard (``gateway.dashboard``), API keys and body limits around them, and the services
they share (``gateway.state``), started and stopped with the app.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from typing import Any, Final

from fastapi import FastAPI

from gateway.auth import ApiKeyAuth, ApiKeyMiddleware
from gateway.batch_api.config import BatchApiConfig
from gateway.batch_api.service import BatchApi
from gateway.body_limit import DEFAULT_MAX_BODY_BYTES, BodyLimit
from gateway.dashboard import routes as dashboard_routes
from gateway.dashboard.sampler import DashboardSampler
from gateway.faces_messages import MESSAGES_FACE, MESSAGES_PATH
from gateway.key_limits import KeyLimiter
from gateway.queue_metrics import QueueTender
from gateway.routes import batches, completions, files, messages, pooling, requests, responses, service, tokenizer
from gateway.sse import DEFAULT_KEEPALIVE_S
from gateway.state import GatewayConfig, GatewayServices
from producer.internal_client import InternalClient
from producer.openai_api.limits import DEFAULT_LIMITS, RequestLimits
from streamq.broker.connection import DEFAULT_REDIS_URL
from streamq.broker.memory_policy import read_memory_policy
from streamq.broker.waiting import WaitingRequests

logger = logging.getLogger("streamq.gateway")

DEFAULT_QUEUE_TIMEOUT_S: Final = 600.0
"""How long a request waits in the queue for a worker to start it before it ends with a 503:
enough for a GPU worker to start from zero (a node, an image, a model's weights), short of
an HTTP client's own timeout (the openai SDK's is 600 s)."""


async def _say_memory_policy(redis: Any) -> None:
    """Warn at start-up under a Redis ``maxmemory-policy`` that evicts (the workers refuse
    an ``allkeys-*`` one unless allowed; the gateway only says so: it holds no work)."""
    policy = await read_memory_policy(redis)
    if policy is not None and (warning := policy.warning()) is not None:
        logger.warning(warning)


def create_app(
    redis_url: str = DEFAULT_REDIS_URL,
    *,
    events_url: str | None = None,
    max_queue_depth: int | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    limits: RequestLimits = DEFAULT_LIMITS,
    api_keys: Sequence[str] = (),
    protect_metrics: bool = False,
    tokenizer_model: str | None = None,
    queue_timeout_s: float | None = DEFAULT_QUEUE_TIMEOUT_S,
    keepalive_s: float = DEFAULT_KEEPALIVE_S,
    model_memory_s: float | None = None,
    declared_models: Mapping[str, str | None] | None = None,
    batch_api: BatchApiConfig | None = None,
) -> FastAPI:
    """The gateway application, with one ``StreamqClient`` (one Redis pool, one pub/sub
    connection) shared by all requests. ``api_keys`` (and keys stored in Redis) are
    required on every ``/v1/*`` route, and on ``/metrics`` with ``protect_metrics``; the
    dashboard's data (``/dashboard/api/*``, ``gateway.dashboard``) takes ``api_keys`` only;
    bodies over ``max_body_bytes`` get 413, requests past ``limits`` 400. ``events_url``
    (else ``$STREAMQ_EVENTS_REDIS_URL``) names a Redis Cluster carrying the events;
    ``tokenizer_model`` answers the tokenizer routes that name no model. A request waits for
    a worker up to ``queue_timeout_s`` (``None``: as long as its job is kept); a stream silent
    for ``keepalive_s`` carries a keep-alive comment. ``model_memory_s`` and
    ``declared_models``: which models with no live worker take requests (``StreamqClient``).
    ``batch_api``: where files live and how batches run (``gateway.batch_api.config``)."""
    auth = ApiKeyAuth(api_keys)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        client = await InternalClient.connect(
            redis_url,
            events_url=events_url,
            max_queue_depth=max_queue_depth,
            model_memory_s=model_memory_s,
            declared_models=declared_models,
            connect_timeout_s=None,  # a service may start before its Redis: keep trying a while
        )
        await _say_memory_policy(client.redis)
        limiter = KeyLimiter(client.redis)
        services = GatewayServices(
            client=client,
            auth=auth,
            limiter=limiter,
            dashboard=DashboardSampler(client),
            waiting=WaitingRequests(client.redis),
            batch_api=BatchApi.build(client, auth, limiter, batch_api or BatchApiConfig(), limits),
        )
        app.state.services = services
        tender = QueueTender(client, services.waiting)
        try:
            await auth.start(client.redis)
            services.limiter.start()
            tender.start()
            await services.batch_api.start()
            yield
        finally:
            await services.batch_api.stop()
            await tender.stop()
            await services.dashboard.stop()
            await services.limiter.stop()
            await auth.stop()
            await client.close()

    app = FastAPI(title="streamq gateway", lifespan=lifespan)
    app.add_middleware(BodyLimit, max_bytes=max_body_bytes)
    # Added last, so it runs first: a request without a valid key is refused before its body is read.
    error_bodies = {MESSAGES_PATH: MESSAGES_FACE.error_body}
    app.add_middleware(ApiKeyMiddleware, auth=auth, protect_metrics=protect_metrics, error_bodies=error_bodies)
    app.state.config = GatewayConfig(
        limits=limits, queue_timeout_s=queue_timeout_s, keepalive_s=keepalive_s, tokenizer_model=tokenizer_model
    )
    routers = (service, completions, pooling, messages, responses, requests, tokenizer, files, batches)
    for router in (module.router for module in routers):
        app.include_router(router)
    dashboard_routes.install(app)
    return app
