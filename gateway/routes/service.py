"""The gateway's service routes: ``/health`` (Redis answers), ``/v1/models`` (the models
live workers serve, and those whose requests wait for a worker), ``/metrics``."""

from __future__ import annotations

import asyncio
import logging

from arq.connections import ArqRedis
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from gateway import http_metrics
from gateway.auth import TENANT_STATE, Tenant
from gateway.batch_api.metrics import batches_exposition
from gateway.key_metrics import key_usage_exposition
from gateway.queue_metrics import waiting_exposition
from gateway.request_status import error_response
from gateway.state import services_of
from producer.openai_api.responses import model_list

logger = logging.getLogger("streamq.gateway")

HEALTH_TIMEOUT_S = 2.0
"""How long ``/health`` waits for Redis's answer to a ``PING``."""

router = APIRouter()


async def health_response(redis: ArqRedis) -> Response:
    """200 while Redis answers a ``PING`` within ``HEALTH_TIMEOUT_S``, else 503 in OpenAI's
    error shape (the gateway's and the exporter's ``/health``)."""
    try:
        await asyncio.wait_for(redis.ping(), HEALTH_TIMEOUT_S)
    except Exception as exc:
        return error_response(ConnectionError(str(exc) or type(exc).__name__))
    return JSONResponse({"status": "ok"})


@router.get("/health")
async def health(request: Request) -> Response:
    """200 while Redis answers; live workers are what ``/v1/models`` shows."""
    return await health_response(services_of(request.app).client.redis)


@router.get("/v1/models")
async def models(request: Request) -> Response:
    client = services_of(request.app).client
    try:
        routes = await client.routes()
    except Exception as exc:
        return error_response(exc)
    tenant: Tenant | None = getattr(request.state, TENANT_STATE, None)
    allows = tenant.record.allows if tenant is not None and tenant.record is not None else None
    return JSONResponse(model_list(routes.workers, allows, waiting_for_workers=client.models_waiting(routes)))


@router.get("/metrics")
async def prometheus_metrics(request: Request) -> Response:
    services = services_of(request.app)
    text = http_metrics.exposition()
    try:
        text += await waiting_exposition(services.client, services.waiting)
    except Exception as exc:  # the gateway's own metrics still count
        logger.warning("cannot read the waiting requests from Redis: %s", exc)
    try:
        text += await batches_exposition(services.batch_api.batches)
    except Exception as exc:
        logger.warning("cannot read the batches from Redis: %s", exc)
    if services.auth.required:
        try:
            text += await key_usage_exposition(services.auth.store, services.auth.static_names)
        except Exception as exc:
            logger.warning("cannot read API key usage from Redis: %s", exc)
    return Response(text, media_type=http_metrics.CONTENT_TYPE)
