"""API keys at the gateway: every ``/v1/*`` request (and the tokenizer's routes) names its key as ``Authorization:
Bearer <key>``, as with ``vllm serve --api-key`` and OpenAI's API, or as ``x-api-key: <key>``, as Anthropic's API
(and its SDK) does.

Keys come from the command line (``--api-key``, a keys file, ``$STREAMQ_API_KEYS``) and from
Redis (``streamq keys create``; ``streamq.broker.api_keys``). Secrets are compared as SHA-256
digests with ``hmac.compare_digest``, so the time a refusal takes says nothing about how much
of a key was right. A gateway with no key anywhere serves everyone, and says so.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from redis.asyncio import Redis
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from producer.openai_api.errors import ApiError, ApiErrorCode, api_error_for
from streamq.broker.api_keys import ApiKeyStore, KeyRecord, secret_hash
from streamq.protocol.names import API_KEYS_KEY

logger = logging.getLogger("streamq.gateway.auth")

STORE_CHECK_S = 5.0
"""How often an open gateway asks Redis whether keys exist there now, and how long a
gateway remembers a key it looked up (the limits script rereads it every request)."""
TENANT_STATE = "tenant"
"""The request's ``Tenant`` in ``request.state``, or ``None`` on an open gateway."""


@dataclass(frozen=True)
class Tenant:
    """Who sent a request: the key's name (never its secret) and, for a key stored in
    Redis, its record with its limits. Command-line keys have no limits."""

    name: str
    digest: str
    record: KeyRecord | None = None


def static_keys(keys: Iterable[str], files: Iterable[Path], env_value: str | None) -> list[str]:
    """The command-line keys in order: ``--api-key``s, then each file's lines (blank lines
    and ``#`` comments skipped), then ``$STREAMQ_API_KEYS`` (comma-separated)."""
    found = [key.strip() for key in keys]
    for path in files:
        lines = path.read_text(encoding="utf-8").splitlines()
        found += [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]
    if env_value:
        found += [key.strip() for key in env_value.split(",") if key.strip()]
    if any(not key for key in found):
        raise ValueError("an API key is empty")
    return list(dict.fromkeys(found))


def unauthorized(message: str) -> ApiError:
    return ApiError(401, message, code=ApiErrorCode.INVALID_API_KEY, headers={"WWW-Authenticate": "Bearer"})


class ApiKeyAuth:
    """Decides who sent a request. Command-line keys are named ``static-1``, ``static-2``, ...
    in the order given; keys in Redis by their own names."""

    def __init__(self, keys: Sequence[str]) -> None:
        self._static = [(f"static-{i}", secret_hash(key)) for i, key in enumerate(keys, start=1)]
        self._store: ApiKeyStore | None = None
        self._redis: Redis | None = None
        self._store_has_keys = False
        self._cache: dict[str, tuple[float, Tenant]] = {}
        self._watcher: asyncio.Task[None] | None = None

    @property
    def static_names(self) -> list[str]:
        return [name for name, _ in self._static]

    @property
    def store(self) -> ApiKeyStore:
        assert self._store is not None, "start() first"
        return self._store

    @property
    def required(self) -> bool:
        """True when every ``/v1/*`` request needs a key."""
        return bool(self._static) or self._store_has_keys

    async def start(self, redis: Redis) -> None:
        """Attach the key store and say at start-up whether the gateway is open."""
        self._redis = redis
        self._store = ApiKeyStore(redis)
        if not self._static:
            self._store_has_keys = bool(await redis.hlen(API_KEYS_KEY))  # type: ignore[misc]
        if not self.required:
            self._watcher = asyncio.get_running_loop().create_task(self._watch_store(), name="api-key-store")
        if self.required:
            where = f"{len(self._static)} from the command line" if self._static else "none from the command line"
            logger.info("API keys required on /v1/* (%s; keys in Redis too)", where)
        else:
            logger.warning(
                "no API key configured (--api-key, --api-key-file, $STREAMQ_API_KEYS, or `streamq keys create`): "
                "this gateway serves anyone who can reach it"
            )

    async def stop(self) -> None:
        if self._watcher is not None:
            self._watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watcher

    async def _watch_store(self) -> None:
        """A gateway open for want of keys closes once a key is created in Redis, and stays
        closed: revoking every key must not open it to everyone."""
        assert self._redis is not None
        while not self._store_has_keys:
            await asyncio.sleep(STORE_CHECK_S)
            try:
                self._store_has_keys = bool(await self._redis.hlen(API_KEYS_KEY))  # type: ignore[misc]
            except Exception as exc:  # Redis away: ask again later
                logger.debug("cannot check for API keys in Redis: %s", exc)
        logger.warning("API keys now required on /v1/*: keys exist in Redis")

    def forget(self, digest: str) -> None:
        """Drop a key from the lookup cache (the limits script found it revoked)."""
        self._cache.pop(digest, None)

    async def authenticate(self, authorization: str | None) -> Tenant | None:
        """The request's tenant; ``None`` on an open gateway. Raises a 401 ``ApiError``."""
        if not self.required:
            return None
        scheme, _, token = (authorization or "").partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token:
            raise unauthorized("missing API key: send the header 'Authorization: Bearer <key>' (or 'x-api-key: <key>')")
        digest = secret_hash(token)
        matched: str | None = None
        for name, known in self._static:  # every one compared: no early exit
            if hmac.compare_digest(digest, known):
                matched = name
        if matched is not None:
            return Tenant(matched, digest)
        tenant = await self._stored(digest)
        if tenant is None:
            raise unauthorized("incorrect API key provided")
        return tenant

    async def stored_tenant(self, digest: str) -> Tenant | None:
        """The tenant of the stored key with this digest (``None``: revoked or unknown), for
        work a key started that goes on without its request (a batch's lines)."""
        return await self._stored(digest)

    async def _stored(self, digest: str) -> Tenant | None:
        now = time.monotonic()
        cached = self._cache.get(digest)
        if cached is not None and now - cached[0] < STORE_CHECK_S:
            return cached[1]
        if self._store is None:
            return None
        record = await self._store.lookup(digest)
        if record is None:
            self._cache.pop(digest, None)
            return None
        tenant = Tenant(record.name, digest, record)
        if len(self._cache) > 10_000:
            self._cache.clear()
        self._cache[digest] = (now, tenant)
        return tenant


DASHBOARD_API_PREFIX = "/dashboard/api/"
TOKENIZER_PATHS = frozenset({"/tokenize", "/detokenize", "/tokenizer_info"})
"""``vllm serve``'s tokenizer routes, outside ``/v1/`` as there, guarded as ``/v1/*`` is."""
POOLING_ROOT_PATHS = frozenset({"/pooling", "/classify", "/score", "/rerank"})
"""``vllm serve``'s pooling routes outside ``/v1/``, guarded as ``/v1/*`` is."""
"""The dashboard's data: every queue's requests and workers, for operators only."""


def dashboard_forbidden() -> ApiError:
    return ApiError(
        403,
        "the dashboard needs an operator key: one given on the gateway's command line "
        "(--api-key, --api-key-file or $STREAMQ_API_KEYS), not a key stored in Redis",
        code=ApiErrorCode.DASHBOARD_FORBIDDEN,
    )


class ApiKeyMiddleware:
    """Checks the key of every ``/v1/*`` request (and ``/metrics`` when protected) before
    any route runs, and leaves the tenant in ``request.state.tenant``. The dashboard's
    data (``/dashboard/api/*``) takes only command-line keys: a tenant's key stored in
    Redis gets 403. ``error_bodies``: per path prefix, the error shape of an API other than
    OpenAI's."""

    def __init__(
        self,
        app: ASGIApp,
        auth: ApiKeyAuth,
        protect_metrics: bool = False,
        error_bodies: Mapping[str, Callable[[ApiError], dict[str, Any]]] | None = None,
    ) -> None:
        self.app = app
        self.auth = auth
        self.protect_metrics = protect_metrics
        self.error_bodies = dict(error_bodies or {})

    def _guarded(self, path: str) -> bool:
        return (
            path.startswith(("/v1/", DASHBOARD_API_PREFIX))
            or path in TOKENIZER_PATHS
            or path in POOLING_ROOT_PATHS
            or path == DASHBOARD_API_PREFIX.rstrip("/")
            or (self.protect_metrics and path == "/metrics")
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not self._guarded(scope["path"]):
            await self.app(scope, receive, send)
            return
        authorization = api_key = None
        for name, value in scope["headers"]:
            if name == b"authorization":
                authorization = value.decode("latin-1")
            elif name == b"x-api-key":
                api_key = value.decode("latin-1")
        if authorization is None and api_key is not None:
            authorization = f"Bearer {api_key}"
        try:
            tenant = await self.auth.authenticate(authorization)
            if tenant is not None and tenant.record is not None and scope["path"].startswith("/dashboard/"):
                raise dashboard_forbidden()
        except Exception as exc:
            error = api_error_for(exc)
            shape = next((body for prefix, body in self.error_bodies.items() if scope["path"].startswith(prefix)), None)
            content = error.body() if shape is None else shape(error)
            await JSONResponse(content, status_code=error.status, headers=error.headers)(scope, receive, send)
            return
        scope.setdefault("state", {})[TENANT_STATE] = tenant
        await self.app(scope, receive, send)
