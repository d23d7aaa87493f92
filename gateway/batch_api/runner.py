"""Runs batches: every gateway scans the unfinished ones each second and takes the lease of
any that no gateway holds, then moves it on until it ends or the lease is lost.

A batch's lines run through the queue as any request does, each under the request id
``<batch id>-<line>``, recorded in the batch's in-flight hash before it is sent. Its result is
recorded once (``scripts.RECORD_RESULT``) and written to storage in parts of ``PART_LINES``;
the read position moves with each line sent. So a gateway that takes a batch over follows
the lines in flight (sending one again finds its request running, or ended and kept in its
replay log for an hour, and follows it) and reads on from where the last one stopped: no
line whose result was recorded runs again, and each line's result is written once.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Final

from redis.exceptions import RedisError

from gateway.auth import ApiKeyAuth, Tenant
from gateway.batch_api import names
from gateway.batch_api.config import BatchApiConfig
from gateway.batch_api.files import FileStore
from gateway.batch_api.metrics import BATCH_LINES
from gateway.batch_api.objects import FINAL_STATES, BatchRecord, FileRecord
from gateway.batch_api.records import BatchStore
from gateway.batch_api.scripts import BatchScripts, LeaseLost
from gateway.batch_api.validate import validate_input
from gateway.key_limits import Admission, KeyLimiter, KeyRevoked
from producer.batch import BatchLine, line_submit_kwargs
from producer.client import MIN_IN_FLIGHT
from producer.errors import DuplicateRequest, NoLiveWorker, QueueFull, RedisFull, RequestLost, StreamqError
from producer.handle import Completion
from producer.internal_client import InternalClient
from producer.openai_api.endpoints import ENDPOINTS, Endpoint
from producer.openai_api.errors import ApiError, api_error_for
from producer.openai_api.limits import DEFAULT_LIMITS, RequestLimits
from producer.openai_api.pooling import PoolingCall
from producer.openai_api.requests import ResponseShape
from streamq.broker.registry import DEFAULT_SLOTS
from streamq.broker.replies import as_text

logger = logging.getLogger("streamq.gateway.batches")

SCAN_S: Final = 1.0
"""How often a gateway looks for batches nobody runs (a dead gateway's, new ones)."""
CHECK_S: Final = 0.5
"""How often a batch's owner rereads its state (a cancel, its window) while lines run."""
PART_LINES: Final = 1000
"""Recorded lines written to storage at a time: what Redis holds of a batch's output."""
RESERVE_SHARE: Final = 8
"""The reserve for online requests is at most an eighth of a worker's slots: a small worker
keeps most of its slots for the batch."""
SLOTS_READ_S: Final = 5.0
"""How often the lines kept in flight are sized again to the live workers' slots."""
RETRY_S: Final = 2.0
"""How long a line waits to be sent again when the queue cannot take it now (full, no
worker of its model alive, Redis full): a batch waits for room, it does not fail."""
LOST_TRIES: Final = 3
"""How many times a line whose request Redis lost is sent again before it is answered as lost."""
TRANSIENT: Final = (RedisError, OSError)
"""What leaves a line in flight rather than answering it: Redis (``RedisUnavailable`` is an
``OSError``) or the file storage away a moment. The batch's run comes back for such a line
until it is answered."""
ENDING_MESSAGES: Final = {
    "cancelled": ("batch_cancelled", "This request was not run: its batch was cancelled."),
    "expired": ("batch_expired", "This request could not be executed before the completion window expired."),
}


class _NotSent(Exception):
    """The batch ended before the line could be sent."""


@dataclass(frozen=True)
class _Line:
    """One input line as sent: enough to rebuild its request and its output line."""

    number: int
    offset: int
    """Where it starts in the input file: a gateway that takes the batch over reads it again there."""
    custom_id: str | None
    request_id: str

    def to_json(self) -> bytes:
        return json.dumps({"line": self.number, "offset": self.offset, "custom_id": self.custom_id}).encode()

    @classmethod
    def from_json(cls, request_id: str, raw: bytes | str) -> _Line:
        obj = json.loads(raw)
        return cls(obj["line"], obj["offset"], obj["custom_id"], request_id)


@dataclass(frozen=True)
class _Prepared:
    kwargs: dict[str, Any]
    endpoint: Endpoint
    shape: ResponseShape | PoolingCall
    model: str | None


class BatchRunner:
    """This gateway's share of the batches: it scans, takes leases, renews them, and runs
    each batch it holds in a task of its own."""

    def __init__(
        self,
        client: InternalClient,
        files: FileStore,
        batches: BatchStore,
        auth: ApiKeyAuth,
        limiter: KeyLimiter,
        config: BatchApiConfig,
        limits: RequestLimits = DEFAULT_LIMITS,
    ) -> None:
        self.client, self.files, self.batches = client, files, batches
        self.auth, self.limiter, self.config, self.limits = auth, limiter, config, limits
        self.redis: Any = client.redis
        self.scripts = BatchScripts(client.redis)
        self.token = uuid.uuid4().hex
        """This gateway's lease token."""
        self._owned: dict[str, asyncio.Task[None]] = {}
        self._loops: list[asyncio.Task[None]] = []

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._loops = [
            loop.create_task(self._scan_forever(), name="batch-scan"),
            loop.create_task(self._renew_forever(), name="batch-leases"),
        ]

    async def stop(self) -> None:
        """Stop running batches and hand them over at once (their leases released); the
        lines in flight go on in the workers, and whoever takes a batch follows them."""
        tasks = [*self._loops, *self._owned.values()]
        owned = list(self._owned)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for batch_id in owned:
            with contextlib.suppress(Exception):
                await self.scripts.release(batch_id, self.token)

    @property
    def owned(self) -> list[str]:
        """The batches this gateway runs now."""
        return list(self._owned)

    async def _scan_forever(self) -> None:
        while True:
            try:
                await self.scan()
            except Exception as exc:
                logger.warning("could not look for batches to run: %s", exc)
            await asyncio.sleep(SCAN_S)

    async def scan(self) -> None:
        """Take the lease of every unfinished batch that no gateway holds, and run it."""
        for raw in await self.redis.smembers(names.ACTIVE_BATCHES_KEY):
            batch_id = as_text(raw)
            if batch_id in self._owned:
                continue
            if await self.redis.set(names.batch_lease_key(batch_id), self.token, nx=True, px=self.config.lease_ms):
                task = asyncio.get_running_loop().create_task(self._own(batch_id), name=f"batch-{batch_id}")
                self._owned[batch_id] = task

    async def _renew_forever(self) -> None:
        while True:
            await asyncio.sleep(self.config.lease_ms / 3000)
            for batch_id, task in list(self._owned.items()):
                try:
                    kept = await self.scripts.renew(batch_id, self.token, self.config.lease_ms)
                except Exception as exc:
                    logger.warning("could not renew the lease of batch %s: %s", batch_id, exc)
                    continue
                if not kept:
                    logger.warning("batch %s: its lease passed to another gateway; this one stops running it", batch_id)
                    task.cancel()

    async def _own(self, batch_id: str) -> None:
        try:
            await _BatchRun(self, batch_id).run()
        except (LeaseLost, asyncio.CancelledError):
            pass
        except Exception:
            logger.exception("batch %s: its run failed; a gateway takes it up again within %g s", batch_id, SCAN_S)
        finally:
            self._owned.pop(batch_id, None)
            with contextlib.suppress(Exception):
                await self.scripts.release(batch_id, self.token)


class _BatchRun:
    """One batch, run by the gateway holding its lease, from wherever it stands."""

    def __init__(self, runner: BatchRunner, batch_id: str) -> None:
        self.runner = runner
        self.id = batch_id
        self.scripts = runner.scripts
        self.token = runner.token
        self._tenant: Tenant | None = None
        self.ending: str | None = None
        """``cancelled`` or ``expired`` once the batch is being wound down: lines not sent
        by then are not sent, and requests cancelled then are answered with its error."""

    async def run(self) -> None:
        while True:
            record = await self.runner.batches.get(self.id, None)
            if record is None:
                await self.runner.redis.srem(names.ACTIVE_BATCHES_KEY, self.id)
                return
            if record.status in FINAL_STATES:  # its end's clean-up again: a retried call may have missed it
                await self._clean_up(record)
                return
            if record.status in ("validating", "in_progress") and not record.ending and _now() >= record.expires_at:
                await self._move(record.status, ending="expired")
                continue
            if record.ending == "expired" and record.status in ("validating", "in_progress"):
                await self._wind_down(record, "expired")
            elif record.status == "validating":
                await self._validate(record)
            elif record.status == "in_progress":
                await self._run_lines(record)
            elif record.status == "cancelling":
                await self._wind_down(record, "cancelled")
            elif record.status == "finalizing":
                await self._finalize(record, "completed")

    async def _move(self, from_states: str, **fields: Any) -> bool:
        return await self.scripts.transition(self.id, self.token, from_states, fields)

    async def _input(self, record: BatchRecord) -> FileRecord | None:
        return await self.runner.files.get(record.input_file_id, record.owner)

    # validating

    async def _validate(self, record: BatchRecord) -> None:
        source = await self._input(record)
        if source is None:
            error = {"code": "file_not_found", "message": "the input file is gone", "line": None, "param": None}
            await self._fail(record, [error])
            return
        config = self.runner.config
        result = await validate_input(
            self.runner.files.read_lines(source),
            endpoint=record.endpoint,
            max_lines=config.max_lines,
            max_bytes=config.max_file_bytes,
        )
        if result.errors:
            await self._fail(record, result.errors)
            return
        await self._move(
            "validating", status="in_progress", in_progress_at=_now(), total=result.total, model=result.model
        )

    async def _fail(self, record: BatchRecord, errors: list[dict[str, Any]]) -> None:
        await self._move("validating", status="failed", failed_at=_now(), errors=json.dumps(errors))

    # in_progress

    async def _run_lines(self, record: BatchRecord) -> None:
        """Send lines as room frees until every line is answered, or the batch is cancelled
        or past its window (then the requests in flight are cancelled and answered so)."""
        source = await self._input(record)
        if source is None:
            raise RuntimeError(f"the input file {record.input_file_id} of batch {self.id} is gone")
        running: dict[asyncio.Task[None], str] = {}
        try:
            await self._send_lines(record, source, running)
        finally:  # the lease lost, or the gateway stopping: the requests go on, followed by the next owner
            for task in running:
                task.cancel()

    async def _send_lines(
        self, record: BatchRecord, source: FileRecord, running: dict[asyncio.Task[None], str]
    ) -> None:
        await self._adopt_in_flight(record, source, running)
        lines = aiter(self._requests_in(source, record.next_offset, record.next_line))
        exhausted = False
        window = _Window(self, record.model, record.online_reserve)
        checked = time.monotonic()
        while True:
            while not exhausted and len(running) < await window.size():
                item = await anext(lines, None)
                if item is None:
                    exhausted = True
                    break
                line, raw, end = item
                await self.scripts.start_line(
                    self.id, self.token, line.request_id, line.to_json(), end, line.number + 1
                )
                running[self._start(record, source, line, raw)] = line.request_id
            if not running:
                break
            done, _ = await asyncio.wait(running, timeout=CHECK_S, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                request_id = running.pop(task)
                if not task.cancelled() and (error := task.exception()) is not None:
                    logger.warning(
                        "batch %s: %s stays in flight, tried again in a moment: %s", self.id, request_id, error
                    )
            await self._flush(final=False)
            if time.monotonic() - checked >= CHECK_S:
                checked = time.monotonic()
                if (ending := await self._ending(record)) is not None:
                    await self._cancel_running(running, ending)
                    return
        await self._flush(final=True)
        if await self.runner.redis.hlen(names.batch_inflight_key(self.id)):
            await asyncio.sleep(RETRY_S)  # a line could not be answered (Redis away, say): run() comes back for it
            return
        record = await self._reload()
        if record.completed + record.failed < record.total and await self._send_unanswered(record, source, running):
            return  # run() comes back: every line answered, or this again
        await self._move(
            "in_progress",
            status="finalizing",
            finalizing_at=_now(),
            output_file_id=_file_id() if record.completed else None,
            error_file_id=_file_id() if record.failed else None,
        )

    async def _send_unanswered(
        self, record: BatchRecord, source: FileRecord, running: dict[asyncio.Task[None], str]
    ) -> int:
        """Send again the lines that a Redis which lost writes it had acknowledged left neither
        answered nor in flight (their note was lost, and the read position moved on); how many."""
        missing = record.total - record.completed - record.failed
        logger.warning("batch %s: %d lines unanswered (Redis lost writes): sending them again", self.id, missing)
        sent = 0
        async for line, raw in self._unanswered(source):
            sent += 1
            await self.scripts.start_line(
                self.id, self.token, line.request_id, line.to_json(), record.next_offset, record.next_line
            )
            running[self._start(record, source, line, raw)] = line.request_id
        if running:
            await asyncio.wait(running)
        running.clear()
        return sent

    async def _unanswered(self, source: FileRecord) -> AsyncIterator[tuple[_Line, bytes]]:
        """The lines of the input that hold a request and are neither answered nor in flight."""
        redis = self.runner.redis
        answered = await redis.get(names.batch_answered_key(self.id)) or b""
        in_flight = {as_text(key) for key in await redis.hkeys(names.batch_inflight_key(self.id))}
        async for line, raw, _ in self._requests_in(source, 0, 1):
            byte = line.number >> 3
            done = byte < len(answered) and answered[byte] >> (7 - (line.number & 7)) & 1
            if not done and line.request_id not in in_flight:
                yield line, raw

    async def _requests_in(
        self, source: FileRecord, offset: int, number: int
    ) -> AsyncIterator[tuple[_Line, bytes, int]]:
        """The input's lines that hold a request, from ``offset`` (line ``number``) on: each
        with its raw bytes and the offset just past it (blank lines are counted, not yielded)."""
        async for end, raw in self.runner.files.read_lines(source, offset):
            if raw.strip():
                yield _Line(number, offset, _custom_id(raw), f"{self.id}-{number}"), raw, end
            number, offset = number + 1, end

    async def _adopt_in_flight(
        self, record: BatchRecord, source: FileRecord, running: dict[asyncio.Task[None], str]
    ) -> None:
        """Follow the lines recorded in flight (sent by this gateway or the one before it)."""
        for request_id, raw in (await self.runner.redis.hgetall(names.batch_inflight_key(self.id))).items():
            line = _Line.from_json(as_text(request_id), raw)
            running[self._start(record, source, line)] = line.request_id

    async def _ending(self, record: BatchRecord) -> str | None:
        """``cancelled`` when the batch was cancelled, ``expired`` once its window has passed
        (then it says so), else ``None``."""
        status = as_text(await self.runner.redis.hget(names.batch_key(self.id), "status") or b"")
        if status != "in_progress":
            return "cancelled"
        if _now() >= record.expires_at:
            await self._move("in_progress", ending="expired")
            return "expired"
        return None

    async def _cancel_running(self, running: dict[asyncio.Task[None], str], ending: str) -> None:
        """Cancel the requests in flight and wait for their answers (``ending``'s error lines,
        or what they finished with first); a line still waiting to be sent is answered so."""
        self.ending = ending
        for request_id in running.values():
            with contextlib.suppress(StreamqError):
                await self.runner.client.cancel(request_id)
        if running:
            await asyncio.wait(running)

    def _start(
        self, record: BatchRecord, source: FileRecord, line: _Line, raw: bytes | None = None
    ) -> asyncio.Task[None]:
        return asyncio.get_running_loop().create_task(self._answer(record, source, line, raw))

    async def _answer(self, record: BatchRecord, source: FileRecord, line: _Line, raw: bytes | None) -> None:
        """Run one line (or follow its request, already sent) and record its output line."""
        try:
            if raw is None:  # a line a gateway sent before this one took the batch over
                raw = await self._line_at(source, line.offset)
            output, ok, tokens = await self._result(record, line, raw)
        except (asyncio.CancelledError, *TRANSIENT):
            raise  # the line stays in flight: its batch's run comes back for it
        except Exception as exc:  # a defect: answered all the same, the line must not stay in flight forever
            logger.exception("batch %s, line %d: %s", self.id, line.number, exc)
            error = ApiError(500, f"the gateway could not run this line: {exc}", type="server_error")
            output, ok, tokens = _response_line(line, 500, error.body()), False, (0, 0)
        recorded = await self.scripts.record_result(
            self.id, line.request_id, line.number, output, ok=ok, input_tokens=tokens[0], output_tokens=tokens[1]
        )
        if recorded:
            BATCH_LINES.labels(result="completed" if ok else "failed").inc()

    async def _line_at(self, source: FileRecord, offset: int) -> bytes:
        async for _, raw in self.runner.files.read_lines(source, offset):
            return raw
        raise RuntimeError(f"no line at offset {offset} of {source.id}")

    async def _result(self, record: BatchRecord, line: _Line, raw: bytes) -> tuple[bytes, bool, tuple[int, int]]:
        """The line's output line, whether it succeeded, and its tokens (prompt, completion)."""
        try:
            prepared = self._prepare(record, raw)
        except (StreamqError, ValueError) as exc:
            error = api_error_for(exc)
            return _response_line(line, error.status, error.body()), False, (0, 0)
        admission = None
        try:
            admission = await self._admit(record, prepared.model)
            if self._tenant is not None:  # the key that created the batch sees its lines' status
                await self.runner.limiter.claim(line.request_id, self._tenant)
            completion = await self._complete(line.request_id, prepared)
        except _NotSent:
            assert self.ending is not None
            return _error_line(line, *ENDING_MESSAGES[self.ending]), False, (0, 0)
        except KeyRevoked:
            error = ApiError(401, "the API key that created this batch was revoked", type="invalid_request_error")
            return _response_line(line, 401, error.body()), False, (0, 0)
        except ApiError as refused:  # the key may not use the line's model
            return _response_line(line, refused.status, refused.body()), False, (0, 0)
        except TRANSIENT:
            if admission is not None:
                await self.runner.limiter.finish(admission)
            raise
        except StreamqError as exc:
            error = api_error_for(exc)  # the status and body the gateway answers the request with
            if admission is not None:
                await self.runner.limiter.finish(admission)
            return _response_line(line, error.status, error.body()), False, (0, 0)
        tokens = (completion.prompt_tokens, completion.completion_tokens)
        if admission is not None:
            admission.prompt_tokens, admission.completion_tokens = tokens
            await self.runner.limiter.finish(admission)
        ending = await self._ending_of_cancelled(completion)
        if ending is not None:
            code, message = ENDING_MESSAGES[ending]
            return _error_line(line, code, message), False, tokens
        body = prepared.endpoint.to_response([completion], model=prepared.model or "streamq", shape=prepared.shape)
        return _response_line(line, 200, body), True, tokens

    def _prepare(self, record: BatchRecord, raw: bytes) -> _Prepared:
        obj = json.loads(raw)
        body, url = obj.get("body"), obj.get("url")
        batch_line = BatchLine(str(obj.get("custom_id")), obj.get("custom_id"), url=str(url), body=body)
        if url not in ENDPOINTS or not isinstance(body, dict):
            raise ValueError(f"line {url!r} cannot run")  # validation refused these
        kwargs = line_submit_kwargs(
            batch_line,
            limits=self.runner.limits,
            priority=record.priority,
            tenant=record.queue_tenant or None,
            affinity={},
        )
        kwargs["priority"] = max(int(kwargs.get("priority", record.priority)), record.priority)
        endpoint = ENDPOINTS[url]
        return _Prepared(kwargs, endpoint, endpoint.shape(body), kwargs.get("model"))

    async def _admit(self, record: BatchRecord, model: str | None) -> Admission | None:
        """Count the line against the quotas of the key that created the batch, waiting while
        it is over one (a batch waits for its key's room; it does not fail)."""
        if not record.key_digest:
            return None
        while True:
            if self._tenant is None:
                self._tenant = await self.runner.auth.stored_tenant(record.key_digest)
                if self._tenant is None:
                    raise KeyRevoked()
            try:
                return await self.runner.limiter.admit(self._tenant, model or "")
            except ApiError as exc:
                if exc.status != 429:
                    raise
                await self._wait(float((exc.headers or {}).get("Retry-After", RETRY_S)))

    async def _complete(self, request_id: str, prepared: _Prepared) -> Completion:
        """Send the line's request, or follow it if it was sent already, and wait for its end.
        Sent with no queue timeout: a batch line waits for a worker within its batch's window."""
        client = self.runner.client
        lost = 0
        if self.ending is not None:  # winding down: follow what was sent, send nothing more
            if not await client.exists(request_id):
                raise _NotSent()
            async with await client.follow(request_id) as handle:
                return await handle.result()
        while True:
            try:
                handle = await client.submit(
                    request_id=request_id, stream=False, queue_timeout_s=None, **prepared.kwargs
                )
            except DuplicateRequest:
                handle = await client.follow(request_id)
            except (QueueFull, NoLiveWorker, RedisFull) as exc:
                logger.info("batch %s: line %s waits: %s", self.id, request_id, exc)
                await self._wait(RETRY_S)
                continue
            async with handle:
                try:
                    return await handle.result()
                except RequestLost as exc:  # Redis lost it (writes it had acknowledged): send it again
                    lost += 1
                    if lost > LOST_TRIES:
                        raise
                    logger.warning("batch %s: line %s was lost, sent again: %s", self.id, request_id, exc)
            await self._wait(RETRY_S)

    async def _wait(self, seconds: float) -> None:
        """Wait before trying to send a line again, unless the batch is ending by then."""
        deadline = time.monotonic() + seconds
        while self.ending is None and time.monotonic() < deadline:
            await asyncio.sleep(min(CHECK_S, seconds))
        if self.ending is not None:
            raise _NotSent()

    async def _ending_of_cancelled(self, completion: Completion) -> str | None:
        """``cancelled`` or ``expired`` when the batch's end cancelled this request."""
        return self.ending if "cancelled" in completion.finish_reasons else None

    # parts

    async def _flush(self, *, final: bool) -> None:
        """Write the recorded lines to storage as parts of ``PART_LINES`` (every one left, when
        ``final``), then drop them from Redis."""
        redis = self.runner.redis
        for kind in ("out", "err"):
            key = names.batch_results_key(self.id, kind)
            while (waiting := await redis.llen(key)) >= (1 if final else PART_LINES):
                count = min(waiting, PART_LINES)
                lines = await redis.lrange(key, 0, count - 1)
                seq = await redis.llen(names.batch_parts_key(self.id))
                part = f"batches/{self.id}/{kind}/{seq:06d}-{self.token[:8]}.jsonl"
                await self.runner.files.storage.write(part, _chunks(lines))
                await self.scripts.commit_part(self.id, self.token, kind, count, part)

    # ends

    async def _wind_down(self, record: BatchRecord, ending: str) -> None:
        """Cancel what runs, answer every line not yet answered with ``ending``'s error, keep
        what finished, and end the batch ``ending`` with its files."""
        source = await self._input(record)
        running: dict[asyncio.Task[None], str] = {}
        if source is not None:
            await self._adopt_in_flight(record, source, running)
        await self._cancel_running(running, ending)
        if source is not None:
            code, message = ENDING_MESSAGES[ending]
            written = 0
            async for line, _, end in self._requests_in(source, record.next_offset, record.next_line):
                output = _error_line(line, code, message)
                await self.scripts.line_failed(self.id, self.token, output, end, line.number + 1, line.number)
                written += 1
                if written % PART_LINES == 0:
                    await self._flush(final=False)
            record = await self._reload()
            async for line, _ in self._unanswered(source):  # lost by a Redis that lost writes
                output = _error_line(line, code, message)
                await self.scripts.line_failed(
                    self.id, self.token, output, record.next_offset, record.next_line, line.number
                )
        await self._flush(final=True)
        record = await self._reload()
        status = record.status
        fields = {
            "output_file_id": record.output_file_id or (_file_id() if record.completed else None),
            "error_file_id": record.error_file_id or (_file_id() if record.failed else None),
        }
        await self._move(status, **fields)
        await self._finalize(await self._reload(), ending)

    async def _finalize(self, record: BatchRecord, final: str) -> None:
        """Write the output and error files from the parts, then end the batch ``final``."""
        await self._flush(final=True)
        parts = [as_text(part) for part in await self.runner.redis.lrange(names.batch_parts_key(self.id), 0, -1)]
        expiry = record.output_expires_after_s
        files = self.runner.files
        if record.output_file_id:
            out = [part for part in parts if f"/{self.id}/out/" in part]
            await files.create_output(record.owner, record.output_file_id, f"{self.id}_output.jsonl", out, expiry)
        if record.error_file_id:
            err = [part for part in parts if f"/{self.id}/err/" in part]
            await files.create_output(record.owner, record.error_file_id, f"{self.id}_error.jsonl", err, expiry)
        stamp = {"completed": "completed_at", "cancelled": "cancelled_at", "expired": "expired_at"}[final]
        await self._move(record.status, status=final, **{stamp: _now()})  # run() cleans up what it kept

    async def _clean_up(self, record: BatchRecord) -> None:
        """Once the batch is final: it leaves the scan, its input may be deleted, and what it
        kept while it ran goes."""
        redis = self.runner.redis
        async with redis.pipeline(transaction=True) as pipe:
            pipe.srem(names.ACTIVE_BATCHES_KEY, self.id)
            pipe.srem(names.file_users_key(record.input_file_id), self.id)
            pipe.delete(
                names.batch_inflight_key(self.id),
                names.batch_results_key(self.id, "out"),
                names.batch_results_key(self.id, "err"),
                names.batch_parts_key(self.id),
                names.batch_answered_key(self.id),
            )
            await pipe.execute()
        await self.runner.files.storage.delete_prefix(f"batches/{self.id}/")

    async def _reload(self) -> BatchRecord:
        record = await self.runner.batches.get(self.id, None)
        if record is None:
            raise LeaseLost()
        return record


class _Window:
    """How many lines a batch keeps in flight: as many as the live workers of its model run
    at once, less its ``online_reserve`` slots of each (at most an eighth of a worker's: an
    online request starts at once, rather than after a batch line ends), shared equally with
    the other batches of its model that run (each one's share shrinks as its lines end, so
    one started later ramps up while the first winds down to its share). No more: a line
    waiting in an engine's queue would take the next free slot ahead of an online request.
    With no worker live, ``MIN_IN_FLIGHT`` lines wait queued for one."""

    def __init__(self, run: _BatchRun, model: str | None, online_reserve: int) -> None:
        self._run, self._model, self._reserve = run, model, online_reserve
        self._size, self._read_at = MIN_IN_FLIGHT, -SLOTS_READ_S

    async def size(self) -> int:
        now = time.monotonic()
        if now - self._read_at >= SLOTS_READ_S:
            self._read_at = now
            with contextlib.suppress(StreamqError, RedisError):
                self._size = await self._read()
        return self._size

    async def _read(self) -> int:
        runner = self._run.runner
        routes = await runner.client.routes()
        live = [worker for worker in routes.workers if self._model is None or worker.serves(self._model)]
        if not live:
            return MIN_IN_FLIGHT
        slots = [worker.slots or DEFAULT_SLOTS for worker in live]
        reserved = sum(min(self._reserve, count // RESERVE_SHARE) for count in slots)
        return max(1, (sum(slots) - reserved) // (1 + await self._others_running()))

    async def _others_running(self) -> int:
        """The other unfinished batches of this model (in progress or validating): the
        workers' slots are shared between them equally."""
        redis = self._run.runner.redis
        others = [as_text(raw) for raw in await redis.smembers(names.ACTIVE_BATCHES_KEY)]
        others = [batch_id for batch_id in others if batch_id != self._run.id]
        if not others:
            return 0
        async with redis.pipeline(transaction=False) as pipe:
            for batch_id in others:
                pipe.hmget(names.batch_key(batch_id), ["model", "status"])
            replies = await pipe.execute()
        return sum(
            1
            for model, status in replies
            if as_text(status or b"") in ("validating", "in_progress")
            and (self._model is None or as_text(model or b"") in ("", self._model))
        )


def _custom_id(raw: bytes) -> str | None:
    try:
        value = json.loads(raw).get("custom_id")
    except (ValueError, AttributeError):
        return None
    return value if isinstance(value, str) else None


def _response_line(line: _Line, status: int, body: dict[str, Any]) -> bytes:
    """An output (or error) line in OpenAI's shape: the response as the gateway gives it."""
    return json.dumps(
        {
            "id": f"batch_req_{line.request_id}",
            "custom_id": line.custom_id,
            "response": {"status_code": status, "request_id": line.request_id, "body": body},
            "error": None,
        },
        ensure_ascii=False,
    ).encode()


def _error_line(line: _Line, code: str, message: str) -> bytes:
    """An error line for a request that did not run to its end (the batch ended first)."""
    return json.dumps(
        {
            "id": f"batch_req_{line.request_id}",
            "custom_id": line.custom_id,
            "response": None,
            "error": {"code": code, "message": message},
        },
        ensure_ascii=False,
    ).encode()


async def _chunks(lines: list[bytes]) -> AsyncIterator[bytes]:
    for line in lines:
        yield line + b"\n"


def _file_id() -> str:
    return f"file-{uuid.uuid4().hex}"


def _now() -> int:
    return int(time.time())
