"""The events of one request, numbered and handed to the publisher.

Every event of a request passes here, so this is also where its latency metrics are
taken, per engine DELTA (``worker/metrics.py``); the publisher counts what it sends.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from streamq.protocol import TERMINAL_EVENTS, ChunkEvent, ErrorEvent, Event, FinalEvent, TokenLogprob, encode_event
from worker import metrics
from worker.publisher import EventPublisher


class RequestEvents:
    """Numbers one request's events contiguously from 0 and publishes them.

    Chunks, the final event and an error all share one sequence, so a reader can
    tell a gap or a duplicate from the numbers alone. A DELTA that finds the request's
    last event still waiting in the publisher's buffer, a chunk of the same completion
    that is not its last, joins that chunk instead of taking a number of its own.
    """

    def __init__(
        self,
        publisher: EventPublisher,
        request_id: str,
        *,
        next_seq: int = 0,
        attempt: int = 1,
        worker_id: str | None = None,
    ) -> None:
        self.request_id = request_id
        self.attempt = attempt
        self.worker_id = worker_id
        """Named in the final event: the worker that served the request."""
        self._publisher = publisher
        self.next_seq = next_seq
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
        prompt_logprobs: tuple[list[int], list[TokenLogprob | None]] | None = None,
    ) -> None:
        """Publish one DELTA of completion ``index``, with its tokens' ``logprobs`` when
        the request asked for them (and the prompt's token ids and logprobs, on the
        request's first chunk)."""
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
            and prompt_logprobs is None
        ):
            publisher.extend(open_chunk, text, token_ids, finish_reason, logprobs)
            return
        seq = self.next_seq
        self.next_seq = seq + 1
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
        if prompt_logprobs is not None:
            event.prompt_token_ids, event.prompt_logprobs = prompt_logprobs
        self._open = event
        self._open_generation = publisher.publish_chunk(event)

    def final(
        self,
        finish_reasons: list[str | None],
        prompt_tokens: int,
        completion_tokens: int,
    ) -> None:
        """Publish the event that ends a completed request."""
        for reason in finish_reasons:
            metrics.COMPLETIONS_FINISHED.labels(finish_reason=str(reason)).inc()
        metrics.REQUESTS_FINISHED.inc()
        event = FinalEvent(
            request_id=self.request_id,
            seq=self._take_seq(),
            attempt=self.attempt,
            finish_reasons=finish_reasons,
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            worker=self.worker_id,
        )
        self._publish(event)
        self.closed = True

    def error(self, code: str, message: str) -> None:
        """Publish the event that ends a failed request."""
        event = ErrorEvent(
            request_id=self.request_id, seq=self._take_seq(), attempt=self.attempt, code=code, message=message
        )
        self._publish(event)
        self.closed = True

    async def delivered(self) -> None:
        """Wait until every event published so far has reached Redis."""
        await self._publisher.flushed(self.request_id)
