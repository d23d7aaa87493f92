"""The events of one request, numbered and handed to the publisher.

Every event of a request passes here, so this is also where its latency metrics are
taken, per engine DELTA of a streamed request, and its events counted (``worker/metrics.py``);
the publisher counts what it sends. A request that is not streamed has its DELTAs held
here until a checkpoint's worth (``worker/delivery.py``).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from msgspec import UNSET

from streamq.protocol import (
    TERMINAL_EVENTS,
    ChunkEvent,
    ErrorEvent,
    Event,
    FinalEvent,
    ParsedOutput,
    PooledEvent,
    TokenLogprob,
    encode_event,
)
from worker import metrics
from worker.publisher import EventPublisher, append_delta

if TYPE_CHECKING:
    from worker.prompt_report import PromptReport


class RequestEvents:
    """Numbers one request's events contiguously from 0 and publishes them.

    Chunks, the final event and an error all share one sequence, so a reader can
    tell a gap or a duplicate from the numbers alone. A DELTA that finds the request's
    last event still waiting in the publisher's buffer, a chunk of the same completion
    that is not its last, joins that chunk instead of taking a number of its own.

    With ``checkpoint_tokens`` (a request that is not streamed) each completion's DELTAs
    are held and published as one chunk once that many tokens are held, when the
    completion finishes, or before the request's end: a checkpoint.
    """

    def __init__(
        self,
        publisher: EventPublisher,
        request_id: str,
        *,
        next_seq: int = 0,
        attempt: int = 1,
        worker_id: str | None = None,
        checkpoint_tokens: int | None = None,
    ) -> None:
        self.request_id = request_id
        self.attempt = attempt
        self.worker_id = worker_id
        """Named in the final event: the worker that served the request."""
        self.model: str | None = None
        """The model the request named (its base model's or a LoRA adapter's name), once
        known: the label its end is counted under."""
        self.checkpoint_tokens = checkpoint_tokens
        """``None``: streamed, each DELTA published as it comes; else tokens per checkpoint."""
        self._publisher = publisher
        self.next_seq = next_seq
        self._first_seq = next_seq
        self._held: dict[int, tuple[ChunkEvent, int]] = {}
        """Completion index -> its DELTAs held since its last checkpoint, as one chunk
        (numbered when published), and how many DELTAs it holds."""
        self.closed = False
        self._started = time.perf_counter()  # the job's start: created as the job begins
        self._last_chunk_at: dict[int, float] = {}  # per completion index, for inter-token latency
        self._open: ChunkEvent | None = None
        """The last event published, if it is a chunk (``extend`` may still add to it)."""
        self._open_generation = -1

    def _take_seq(self) -> int:
        seq = self.next_seq
        self.next_seq += 1
        return seq

    def go_on_from(self, next_seq: int) -> None:
        """Number this attempt's events on from ``next_seq``: a take-over's first event
        follows what the earlier attempts logged."""
        self.next_seq = self._first_seq = next_seq

    @property
    def published(self) -> int:
        """Events this attempt has published (chunks, merged ones counting once, and its end)."""
        return self.next_seq - self._first_seq

    def _publish(self, event: Event) -> None:
        terminal = isinstance(event, TERMINAL_EVENTS)
        self._open = None
        self._publisher.publish(self.request_id, event.seq, self.attempt, encode_event(event), terminal=terminal)

    def chunk(
        self,
        index: int,
        text: str,
        token_ids: Sequence[int],
        finish_reason: str | None,
        logprobs: list[TokenLogprob] | None = None,
        prompt: PromptReport | None = None,
        parsed: ParsedOutput | None = None,
    ) -> None:
        """Publish one DELTA of completion ``index``, with its tokens' ``logprobs`` when
        the request asked for them (and what ``prompt`` reports of the prompt, on the
        request's first chunk; what the parsers made of it, ``parsed``: a parsed DELTA is
        a chunk of its own, never merged with another)."""
        if self.checkpoint_tokens is not None:  # not streamed: held until a checkpoint's worth
            if index in self._held:
                held, deltas = self._held[index]
                append_delta(held, text, token_ids, finish_reason, logprobs)
                if prompt is not None:
                    prompt.apply(held)
                if parsed is not None:
                    held.parsed = parsed
                self._held[index] = (held, deltas + 1)
            else:
                held = self._new_chunk(-1, index, text, token_ids, finish_reason, logprobs, prompt, parsed)
                self._held[index] = (held, 1)
            if finish_reason is not None or len(held.token_ids) >= self.checkpoint_tokens:
                self._checkpoint(index)
            return
        now = time.perf_counter()
        last = self._last_chunk_at.get(index)
        if last is not None:
            metrics.INTER_TOKEN_LATENCY.observe(now - last)
        elif not self._last_chunk_at:
            metrics.TIME_TO_FIRST_TOKEN.observe(now - self._started)
        self._last_chunk_at[index] = now
        publisher = self._publisher
        open_chunk = self._open
        if (
            open_chunk is not None
            and open_chunk.index == index
            and open_chunk.finish_reason is None
            and publisher.extendable(self._open_generation)
            and prompt is None
            and parsed is None
            and open_chunk.parsed is UNSET
        ):
            publisher.extend(open_chunk, text, token_ids, finish_reason, logprobs)
            return
        event = self._new_chunk(self._take_seq(), index, text, token_ids, finish_reason, logprobs, prompt, parsed)
        self._open = event
        self._open_generation = publisher.publish_chunk(event)

    def _new_chunk(
        self,
        seq: int,
        index: int,
        text: str,
        token_ids: Sequence[int],
        finish_reason: str | None,
        logprobs: list[TokenLogprob] | None,
        prompt: PromptReport | None,
        parsed: ParsedOutput | None = None,
    ) -> ChunkEvent:
        event = ChunkEvent(
            request_id=self.request_id,
            seq=seq,
            attempt=self.attempt,
            index=index,
            text=text,
            token_ids=list(token_ids),
            finish_reason=finish_reason,
        )
        if logprobs is not None:
            event.logprobs = logprobs
        if prompt is not None:
            prompt.apply(event)
        if parsed is not None:
            event.parsed = parsed
        return event

    def _checkpoint(self, index: int) -> None:
        """Publish what completion ``index`` holds as one chunk event."""
        held, deltas = self._held.pop(index)
        held.seq = self._take_seq()
        self._open = None
        self._publisher.publish_chunk(held, deltas=deltas)

    def _end(self, event: FinalEvent | ErrorEvent) -> None:
        """Publish the request's last event, after whatever is still held."""
        for index in sorted(self._held):
            self._checkpoint(index)
        event.seq = self._take_seq()
        self._publish(event)
        self.closed = True
        metrics.EVENTS_BY_STREAMED[self.checkpoint_tokens is None].observe(self.published)

    def final(
        self,
        finish_reasons: list[str | None],
        prompt_tokens: int,
        completion_tokens: int,
    ) -> None:
        """Publish the event that ends a completed request."""
        for reason in finish_reasons:
            by_reason = metrics.COMPLETIONS_BY_REASON.get(str(reason))
            (by_reason or metrics.COMPLETIONS_FINISHED.labels(finish_reason=str(reason))).inc()
        metrics.REQUESTS_FINISHED.inc()
        if self.model is not None:
            metrics.MODEL_REQUESTS_FINISHED.labels(model=self.model).inc()
            metrics.MODEL_COMPLETION_TOKENS.labels(model=self.model).inc(completion_tokens)
        event = FinalEvent(
            request_id=self.request_id,
            seq=-1,
            attempt=self.attempt,
            finish_reasons=finish_reasons,
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            worker=self.worker_id,
        )
        self._end(event)

    def pooled(self, shapes: list[list[int]], prompt_tokens: list[int], data: bytes) -> None:
        """Publish a pooling request's results (its final event follows)."""
        self._publish(
            PooledEvent(
                request_id=self.request_id,
                seq=self._take_seq(),
                attempt=self.attempt,
                shapes=shapes,
                prompt_tokens=prompt_tokens,
                data=data,
            )
        )

    def error(self, code: str, message: str) -> None:
        """Publish the event that ends a failed request."""
        self._end(ErrorEvent(request_id=self.request_id, seq=-1, attempt=self.attempt, code=code, message=message))

    async def delivered(self) -> None:
        """Wait until every event published so far has reached Redis."""
        await self._publisher.flushed(self.request_id)
