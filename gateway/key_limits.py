"""Per-key limits and usage, shared by every gateway replica through Redis.

Each completion request costs one script when it is admitted (the key's record, its
model allow-list, requests and tokens in this minute, open streams: ``admit_key_request``)
and one when it ends (its stream closed, its tokens charged: ``finish_key_request``);
nothing per token. Open streams are leases that this gateway renews while they run, so a
gateway that dies frees its streams within ``KEY_STREAM_LEASE_MS``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from dataclasses import dataclass

from redis.asyncio import Redis

from gateway.auth import Tenant
from producer.openai_api.errors import ApiError, ApiErrorCode, ApiErrorType
from streamq.broker.api_keys import streams_key, usage_key, window_key
from streamq.broker.replies import as_text
from streamq.protocol.names import (
    API_KEYS_KEY,
    JOB_EXPIRY_MS,
    KEY_STREAM_LEASE_MS,
    KEY_WINDOW_MS,
    LOG_TTL_MS,
    REQUEST_KEY_PREFIX,
)
from streamq.protocol.script_calls import AdmitKeyRequest, FinishKeyRequest
from streamq.protocol.scripts import Script

logger = logging.getLogger("streamq.gateway.limits")

LIMIT_NAMES = {
    "rpm": "requests per minute",
    "tpm": "tokens per minute (prompt + completion)",
    "max_streams": "concurrent requests",
}
OWNER_TTL_MS = JOB_EXPIRY_MS + LOG_TTL_MS
"""A named request's owner is kept while it may wait, run, and keep its replay log."""


class KeyRevoked(Exception):
    """The key was revoked after this gateway last looked it up."""


@dataclass
class Admission:
    """One admitted request of one key: its open stream and what it used."""

    tenant: Tenant
    model: str
    member: str
    counted: bool = True
    """Whether it counts as a request in the usage totals (a resumed stream does not)."""
    prompt_tokens: int = 0
    completion_tokens: int = 0


class KeyLimiter:
    """Admits requests against their key's limits and records their usage."""

    def __init__(self, redis: Redis) -> None:
        self._redis = redis
        self._admit = Script(redis, AdmitKeyRequest)
        self._finish = Script(redis, FinishKeyRequest)
        self._open: dict[str, Admission] = {}
        self._gateway_id = uuid.uuid4().hex[:12]
        self._renewer: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._renewer = asyncio.get_running_loop().create_task(self._renew_forever(), name="key-stream-leases")

    async def stop(self) -> None:
        if self._renewer is not None:
            self._renewer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._renewer

    async def admit(self, tenant: Tenant, model: str, *, counted: bool = True) -> Admission:
        """Admit one request, or raise the ``ApiError`` that names the limit it is over."""
        admission = Admission(tenant, model, f"{self._gateway_id}:{uuid.uuid4().hex[:12]}", counted)
        if tenant.record is not None:
            call = AdmitKeyRequest(
                window_key=window_key(tenant.name),
                streams_key=streams_key(tenant.name),
                secret_hash=tenant.digest,
                model=model,
                stream_member=admission.member,
                stream_lease_ms=KEY_STREAM_LEASE_MS,
                window_ms=KEY_WINDOW_MS,
                api_keys_key=API_KEYS_KEY,
            )
            verdict, retry_after, value = await self._admit(call)
            verdict = as_text(verdict)
            if verdict == "revoked":
                raise KeyRevoked()
            if verdict == "model":
                message = f"The model {model!r} does not exist or you do not have access to it."
                not_found, code = ApiErrorType.NOT_FOUND, ApiErrorCode.MODEL_NOT_FOUND
                raise ApiError(404, message, type=not_found, code=code, param="model")
            if verdict != "ok":
                raise over_limit(tenant.name, verdict, int(value), int(retry_after))
        self._open[admission.member] = admission
        return admission

    async def finish(self, admission: Admission) -> None:
        """Close the request's stream and charge what it used; never raises (the request
        is over whatever Redis says; its stream lease lapses if this is lost)."""
        self._open.pop(admission.member, None)
        name = admission.tenant.name
        try:
            call = FinishKeyRequest(
                window_key=window_key(name),
                streams_key=streams_key(name),
                usage_key=usage_key(name),
                stream_member=admission.member,
                model=admission.model,
                prompt_tokens=admission.prompt_tokens,
                completion_tokens=admission.completion_tokens,
                window_ms=KEY_WINDOW_MS,
                counted=int(admission.counted),
            )
            await self._finish(call)
        except Exception as exc:
            logger.warning("could not record the usage of a request of key %r: %s", name, exc)

    async def _renew_forever(self) -> None:
        while True:
            await asyncio.sleep(KEY_STREAM_LEASE_MS / 3000)
            try:
                await self._renew()
            except Exception as exc:
                logger.warning("could not renew the stream leases of open requests: %s", exc)

    async def _renew(self) -> None:
        """Push every open stream's lease ``KEY_STREAM_LEASE_MS`` ahead, on Redis's clock."""
        by_key: dict[str, list[str]] = {}
        for admission in list(self._open.values()):
            if admission.tenant.record is not None:
                by_key.setdefault(admission.tenant.name, []).append(admission.member)
        if not by_key:
            return
        seconds, micros = await self._redis.time()
        until = seconds * 1000 + micros // 1000 + KEY_STREAM_LEASE_MS
        async with self._redis.pipeline(transaction=False) as pipe:
            for name, members in by_key.items():
                pipe.zadd(streams_key(name), dict.fromkeys(members, until), xx=True)
                pipe.pexpire(streams_key(name), KEY_STREAM_LEASE_MS)
            await pipe.execute()

    async def claim(self, request_id: str, tenant: Tenant) -> None:
        """Record ``tenant`` as the owner of the request it just created."""
        await self._redis.set(REQUEST_KEY_PREFIX + request_id, tenant.name, px=OWNER_TTL_MS)

    async def created(self, request_id: str, tenant: Tenant) -> bool:
        """Whether ``tenant`` created the request (``claim``): only then may it see its status."""
        owner = await self._redis.get(REQUEST_KEY_PREFIX + request_id)
        return owner is not None and as_text(owner) == tenant.name

    async def owns(self, request_id: str, tenant: Tenant) -> bool:
        """Whether ``tenant`` may resume the request: it created it, or nobody is recorded
        (it was created on a gateway without keys)."""
        owner = await self._redis.get(REQUEST_KEY_PREFIX + request_id)
        return owner is None or as_text(owner) == tenant.name


def over_limit(name: str, limit: str, value: int, retry_after_s: int) -> ApiError:
    """429 naming the limit, with ``Retry-After`` in seconds."""
    retry_after_s = max(retry_after_s, 1)
    message = (
        f"API key {name!r} is over its {limit} limit: {value} {LIMIT_NAMES.get(limit, limit)}; "
        f"retry after {retry_after_s} s"
    )
    headers = {"Retry-After": str(retry_after_s)}
    return ApiError(
        429, message, type=ApiErrorType.RATE_LIMIT, code=ApiErrorCode.RATE_LIMIT_EXCEEDED, param=limit, headers=headers
    )
