"""What the gateway's routes share, typed: its settings (``GatewayConfig``, fixed when the
app is built) and its services (``GatewayServices``, set up by the app's lifespan: one
Redis client for every request, the API keys, the per-key limits, the dashboard's sampler,
the waiting requests and the Batch API). Routes reach them through ``config_of`` and ``services_of``,
never through ``app.state`` by name.
"""

from __future__ import annotations

from dataclasses import dataclass

from fastapi import FastAPI

from gateway.auth import ApiKeyAuth
from gateway.batch_api.service import BatchApi
from gateway.dashboard.sampler import DashboardSampler
from gateway.key_limits import KeyLimiter
from producer.internal_client import InternalClient
from producer.openai_api.limits import RequestLimits
from streamq.broker.waiting import WaitingRequests


@dataclass(frozen=True)
class GatewayConfig:
    limits: RequestLimits
    """A request past them gets a 400 (``producer.openai_api.limits``)."""
    queue_timeout_s: float | None
    """How long a request waits for a worker to start it (``None``: as long as its job is kept)."""
    keepalive_s: float
    """A stream silent this long carries a keep-alive comment."""
    tokenizer_model: str | None
    """The model the tokenizer routes answer for when a request names none."""


@dataclass(frozen=True)
class GatewayServices:
    client: InternalClient
    auth: ApiKeyAuth
    limiter: KeyLimiter
    dashboard: DashboardSampler
    waiting: WaitingRequests
    batch_api: BatchApi
    """Files and batches (``/v1/files``, ``/v1/batches``) and the runner of this gateway's batches."""


def config_of(app: FastAPI) -> GatewayConfig:
    config: GatewayConfig = app.state.config
    return config


def services_of(app: FastAPI) -> GatewayServices:
    """The services, once the lifespan has started them."""
    services: GatewayServices = app.state.services
    return services
