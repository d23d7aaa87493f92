"""Completion callbacks: a POST of a request's summary to its ``callback.url`` when it ends.

Every path that ends a request makes its callback due in ``streamq:callbacks``: this
worker's jobs (``schedule``, right after their final or error event), and in the same
script as the terminal event the paths outside any running job (a producer cancelling a
queued request, a job arq gave up on: ``end_request.lua``). Every worker runs a
``CallbackSender`` that claims due deliveries with a lease (one script), builds each body
from the replay log, signs it, and sends it, retrying with exponential backoff; a worker
that dies mid-delivery leaves it due again when the lease passes, so delivery is at least
once. Requests' own streams never wait on any of this.

Where ends wait for their replicas (``--durable-ends``), the claim and ``WAIT`` go in one
pipeline on one connection and a delivery is POSTed only once the wait answered: replication
is ordered, so a replica that has the claim has the end before it (a failover cannot take
back an end that was called back). Each try's record is followed by a ``WAIT`` too.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import httpx
import msgspec
from redis.asyncio import Redis

from streamq.broker.callback_schedule import CallbackSchedule
from streamq.broker.durability import Durability
from streamq.broker.replay_log import ReplayLog
from streamq.env_vars import CALLBACK_SECRET_ENV
from streamq.protocol import (
    CALLBACK_KEY_PREFIX,
    CALLBACKS_KEY,
    Callback,
    ChunkEvent,
    ErrorEvent,
    FinalEvent,
    callback_key,
    decode_event,
)
from streamq.protocol.callbacks import CallbackBody, CallbackError, signature
from streamq.protocol.names import CALLBACK_SIGNATURE_HEADER, CALLBACK_TIMESTAMP_HEADER
from streamq.protocol.script_calls import ClaimCallbacks, RecordCallback
from streamq.protocol.scripts import Script
from streamq.tasks import stop_task

logger = logging.getLogger("streamq.worker.callbacks")

RETRIED_STATUSES = frozenset({408, 425, 429})
"""Answers worth another try besides 5xx; any other non-2xx answer fails the delivery."""


@dataclass(frozen=True)
class CallbackPolicy:
    """How deliveries are sent: ``tries`` in all, the n-th retry ``backoff_s * 2**(n-1)``
    after the previous try (5 tries: 2 + 4 + 8 + 16 = 30 s), each try bounded by ``timeout_s``."""

    tries: int = 5
    backoff_s: float = 2.0
    timeout_s: float = 10.0
    secret: str | None = None
    """The HMAC key; ``None`` sends deliveries unsigned."""
    poll_s: float = 0.5
    concurrency: int = 16

    def __post_init__(self) -> None:
        if self.tries < 1 or self.backoff_s < 0 or self.timeout_s <= 0:
            raise ValueError(
                f"callback tries must be >= 1, backoff >= 0 s and timeout > 0 s; "
                f"got {self.tries}, {self.backoff_s:g} and {self.timeout_s:g}"
            )

    def delay_ms(self, attempts: int) -> int:
        """Wait before the try after ``attempts`` tries."""
        return int(self.backoff_s * 1000 * 2 ** (attempts - 1))

    @property
    def lease_ms(self) -> int:
        """How long a claimed delivery stays claimed: one try and its bookkeeping."""
        return round((self.timeout_s + 5) * 1000)


def secret_from_env(environ: Mapping[str, str] = os.environ) -> str | None:
    return environ.get(CALLBACK_SECRET_ENV) or None


class CallbackSender:
    """Claims due callback deliveries and sends them, a few at a time."""

    def __init__(
        self, redis: Redis, log: ReplayLog, policy: CallbackPolicy, *, durability: Durability | None = None
    ) -> None:
        """``durability``: what a write of the control plane waits for (``None``: nothing)."""
        self._redis = redis
        self._log = log
        self.policy = policy
        self._durability = durability
        self._claim = Script(redis, ClaimCallbacks)
        self._schedule = CallbackSchedule(redis, log.owners, log.ttl_ms)
        self._record = Script(redis, RecordCallback)
        self._wake = asyncio.Event()
        self._sending: set[asyncio.Task[None]] = set()
        self._task: asyncio.Task[None] | None = None
        self._http: httpx.AsyncClient | None = None

    def start(self) -> None:
        if self.policy.secret is None:
            logger.warning("$%s is not set: callback deliveries go out unsigned", CALLBACK_SECRET_ENV)
        self._http = httpx.AsyncClient(timeout=self.policy.timeout_s, follow_redirects=False)
        self._task = asyncio.get_running_loop().create_task(self._run(), name="callback-sender")

    async def close(self) -> None:
        """Stop claiming; deliveries under way are cut off and become due again later."""
        await stop_task(self._task)
        for task in list(self._sending):
            await stop_task(task)
        if self._http is not None:
            await self._http.aclose()

    async def schedule(self, request_id: str, callback: Callback | None) -> None:
        """Make ``request_id``'s callback due now (once per request, whichever end path
        gets there first, and only once it ended); ``callback`` from the job, else the one
        stored at enqueue."""
        spec = msgspec.json.encode(callback) if callback is not None else b""
        if await self._schedule(request_id, spec):
            self._wake.set()

    async def _run(self) -> None:
        while True:
            self._wake.clear()
            try:
                await self._claim_and_send()
            except Exception as exc:  # Redis away: try again at the next poll
                logger.warning("cannot claim callback deliveries: %s", exc)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.policy.poll_s)

    async def _claim_and_send(self) -> None:
        free = self.policy.concurrency - len(self._sending)
        if free <= 0:
            return
        call = ClaimCallbacks(
            callbacks_key=CALLBACKS_KEY, count=free, lease_ms=self.policy.lease_ms, callback_prefix=CALLBACK_KEY_PREFIX
        )
        _, *reply = await self._durably(self._claim, call, wrote=lambda reply: len(reply) > 1)
        for i in range(0, len(reply), 4):
            request_id, spec, attempts, ended_ms = (
                x.decode() if isinstance(x, bytes) else str(x) for x in reply[i : i + 4]
            )
            task = asyncio.get_running_loop().create_task(
                self._deliver(request_id, spec, int(attempts), int(float(ended_ms))), name=f"callback-{request_id}"
            )
            self._sending.add(task)
            task.add_done_callback(self._sent)

    def _sent(self, task: asyncio.Task[None]) -> None:
        self._sending.discard(task)
        if not task.cancelled() and task.exception() is not None:  # Redis away: due again after the lease
            logger.warning("callback delivery %s: cannot record its outcome: %s", task.get_name(), task.exception())
        self._wake.set()  # a slot is free: more may be due

    async def _deliver(self, request_id: str, spec: str, attempts: int, ended_ms: int) -> None:
        """One try of one delivery, and its outcome recorded."""
        try:
            callback = msgspec.json.decode(spec, type=Callback)
            body = await self.body(request_id, ended_ms, include_text=callback.include_text)
        except (msgspec.DecodeError, msgspec.ValidationError, ValueError) as exc:
            await self._outcome(request_id, "failed", attempts, None, f"cannot build the delivery: {exc}")
            return
        attempts += 1
        status: int | None = None
        try:
            assert self._http is not None, "start() first"
            response = await self._http.post(callback.url, content=body, headers=self.headers(body))
            status = response.status_code
            error = "" if response.is_success else f"HTTP {status}"
            retry = status >= 500 or status in RETRIED_STATUSES
        except httpx.HTTPError as exc:
            error, retry = f"{type(exc).__name__}: {exc}".rstrip(": "), True
        if not error:
            logger.info("request %s: callback delivered (HTTP %d, try %d)", request_id, status, attempts)
            await self._outcome(request_id, "delivered", attempts, status, "")
        elif retry and attempts < self.policy.tries:
            await self._outcome(request_id, "retry", attempts, status, error)
        else:
            logger.warning("request %s: callback failed after %d tries: %s", request_id, attempts, error)
            await self._outcome(request_id, "failed", attempts, status, error)

    async def _outcome(self, request_id: str, outcome: str, attempts: int, status: int | None, error: str) -> None:
        call = RecordCallback(
            callbacks_key=CALLBACKS_KEY,
            callback_key=callback_key(request_id),
            request_id=request_id,
            outcome=outcome,
            attempts=attempts,
            http_status="" if status is None else status,
            error=error[:500],
            retry_in_ms=self.policy.delay_ms(max(attempts, 1)),
            ttl_ms=self._log.ttl_ms,
        )
        await self._durably(self._record, call)

    async def _durably(self, script: Script[Any], call: Any, wrote: Callable[[Any], bool] = lambda reply: True) -> Any:
        """``script(call)``, followed where writes wait (``durability``) by the wait, in one
        pipeline on one connection (``Script.then``); a short wait is noted (``wrote(reply)``:
        the call wrote something the wait covers), and the reply returned all the same."""
        if self._durability is not None:
            await self._durability.fresh()  # after a failover: what the new primary offers
        wait = self._durability.wait() if self._durability is not None else None
        if wait is None or not wait.waits:
            return await script(call)
        started = time.perf_counter()
        reply, *waited = await script.then(call, *wait.commands())
        if self._durability is not None and wrote(reply):
            self._durability.check_wait(wait, waited, seconds=time.perf_counter() - started, what="callback")
        return reply

    def headers(self, body: bytes) -> dict[str, str]:
        headers = {"Content-Type": "application/json"}
        if self.policy.secret is not None:
            timestamp = str(int(time.time()))
            headers[CALLBACK_TIMESTAMP_HEADER] = timestamp
            headers[CALLBACK_SIGNATURE_HEADER] = signature(self.policy.secret, timestamp, body)
        return headers

    async def body(self, request_id: str, ended_ms: int, *, include_text: bool) -> bytes:
        """The summary of the ended request, from its replay log."""
        texts: dict[int, list[str]] = {}
        end: FinalEvent | ErrorEvent | None = None
        for raw in await self._log.read(request_id):
            event = decode_event(raw)
            if isinstance(event, ChunkEvent):
                texts.setdefault(event.index, []).append(event.text)
            elif isinstance(event, (FinalEvent, ErrorEvent)):
                end = event
        if isinstance(end, FinalEvent):
            n = len(end.finish_reasons)
            summary = CallbackBody(
                request_id=request_id,
                state="finished",
                ended_ms=ended_ms,
                finish_reasons=[str(r) for r in end.finish_reasons],
                prompt_tokens=end.prompt_tokens,
                completion_tokens=end.completion_tokens,
                texts=["".join(texts.get(i, ())) for i in range(n)] if include_text else None,
            )
        elif isinstance(end, ErrorEvent):
            error = CallbackError(code=end.code, message=end.message)
            summary = CallbackBody(request_id=request_id, state="failed", ended_ms=ended_ms, error=error)
        else:
            raise ValueError("the request's replay log holds no final or error event (expired?)")
        return msgspec.json.encode(summary)
