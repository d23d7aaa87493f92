"""``python -m gateway.exporter``: the waiting requests of every queue on ``/metrics``, for a
deployment without a gateway (producers that use the library or Redis directly).

    python -m gateway.exporter --redis-url redis://localhost:6379 --port 9300

It serves what the gateway's ``/metrics`` adds to its own (``gateway.queue_metrics``), and
tends the waiting sets as the gateway does, so that an autoscaler reading them (KEDA's redis
scaler, or Prometheus) sees requests whose deferral came due or whose worker died while no
worker claims. Any number may run; each reports the same figures.
"""

from __future__ import annotations

import argparse
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager

import uvicorn
from fastapi import FastAPI
from fastapi.responses import Response

from gateway import http_metrics
from gateway.queue_metrics import QueueTender, waiting_exposition
from gateway.request_status import error_response
from gateway.routes.service import health_response
from producer.internal_client import InternalClient
from streamq.broker.connection import add_redis_url_option, redis_url_from_args
from streamq.broker.waiting import WaitingRequests
from streamq.environment import parse_declared_models


def create_exporter(redis_url: str, *, declared_models: dict[str, str | None] | None = None) -> FastAPI:
    """The exporter's application: ``/metrics`` and ``/health``; ``declared_models`` adds their
    queues to those reported (besides every queue a worker ever served)."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        # A service may start before its Redis: keep trying a while.
        client = await InternalClient.connect(redis_url, declared_models=declared_models, connect_timeout_s=None)
        app.state.client = client
        app.state.waiting = waiting = WaitingRequests(client.redis)
        tender = QueueTender(client, waiting)
        tender.start()
        try:
            yield
        finally:
            await tender.stop()
            await client.close()

    app = FastAPI(title="streamq exporter", lifespan=lifespan)

    @app.get("/metrics")
    async def metrics() -> Response:
        try:
            text = await waiting_exposition(app.state.client, app.state.waiting)
        except Exception as exc:  # a scrape that fails says so, rather than report zero waiting
            return error_response(exc)
        return Response(text, media_type=http_metrics.CONTENT_TYPE)

    @app.get("/health")
    async def health() -> Response:
        return await health_response(app.state.client.redis)

    return app


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m gateway.exporter",
        description="Prometheus exporter of the requests waiting on each streamq queue (the autoscaling signal), "
        "for deployments without a gateway: /metrics, /health.",
    )
    add_redis_url_option(parser)
    parser.add_argument("--host", default="0.0.0.0")
    parser.add_argument("--port", type=int, default=9300)
    parser.add_argument(
        "--declare-model",
        action="append",
        default=[],
        metavar="NAME[=QUEUE]",
        help="report this model's queue even before a worker ever served it (repeatable)",
    )
    parser.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    return parser


def main(argv: Sequence[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        declared = parse_declared_models(",".join(args.declare_model)) if args.declare_model else None
    except ValueError as exc:
        parser.error(f"--declare-model: {exc}")
    app = create_exporter(redis_url_from_args(args), declared_models=declared)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, timeout_graceful_shutdown=5)


if __name__ == "__main__":
    main()
