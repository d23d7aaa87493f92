"""Aborting, in the engine core, the requests of a front end that died.

A front end killed mid-stream leaves its requests running in the engine core it shared
with its siblings: the core streams their outputs into the dead front end's channel and
would go on generating tokens nobody reads until each reaches its length limit, holding
batch slots and KV cache the live front ends (and the requests taken over from the dead
one) need. The core has no call that lists or aborts a client's requests, and vLLM names
each request with a random suffix the parent never saw, so the parent reads the names off
the channel itself: it adopts the dead front end's two ZMQ listeners (bound by the parent,
so the core reconnects to them), and answers every output of an unfinished request with
an abort, the message a front end's own ``abort`` sends. An abort lost while the core is
still reconnecting is sent again at the request's next output; the core's answer to a
call sent after it confirms it.
"""

from __future__ import annotations

import logging
import threading

import zmq
from vllm.utils.network_utils import ZmqListener, make_zmq_socket
from vllm.v1.engine import EngineCoreOutputs, EngineCoreRequestType
from vllm.v1.engine.core import EngineCoreProc
from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

logger = logging.getLogger("streamq.worker")

POLL_MS = 200
"""How often the reaper looks up from its channel to see whether it was stopped."""
CONFIRMING_CALL = "is_sleeping"
"""A utility call of the engine core that does nothing, asked right after an abort: its
answer confirms the abort was applied (the abort itself has none)."""


def engine_identity(engine_index: int) -> bytes:
    """The ZMQ identity an engine core (data-parallel rank) uses towards its clients."""
    return engine_index.to_bytes(2, "little")


class OrphanReaper:
    """Aborts each request that a dead front end left in the engine, from a thread of the
    parent process, until ``stop`` (or the engine's end)."""

    def __init__(self, front_end: int, input_listener: ZmqListener, output_listener: ZmqListener) -> None:
        self.front_end = front_end
        self._input_listener = input_listener
        self._output_listener = output_listener
        self.aborted: set[str] = set()
        """The engine's names of the requests aborted (vLLM's request id with its suffix)."""
        self.dropped: set[str] = set()
        """Those the engine has since confirmed it stopped."""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"orphan-reaper-{front_end}", daemon=True)

    def start(self) -> OrphanReaper:
        self._thread.start()
        return self

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        self._thread.join(timeout_s)

    def _run(self) -> None:
        context = zmq.Context()
        inputs = make_zmq_socket(
            context, self._input_listener.address, zmq.ROUTER, bind=True, listener=self._input_listener.socket
        )
        outputs = make_zmq_socket(
            context, self._output_listener.address, zmq.PULL, bind=True, listener=self._output_listener.socket
        )
        try:
            self._reap(inputs, outputs)
        except Exception:
            logger.exception("front end %d: aborting its requests in the engine failed", self.front_end)
        finally:
            inputs.close(linger=0)
            outputs.close(linger=0)
            context.term()

    def _reap(self, inputs: zmq.Socket, outputs: zmq.Socket) -> None:  # type: ignore[type-arg]
        decoder = MsgpackDecoder(EngineCoreOutputs)
        encoder = MsgpackEncoder()
        confirming: dict[int, list[str]] = {}
        """Requests aborted, by the call that confirms it: the engine handles its input in
        order, so its answer to a call sent after the abort means the abort was applied."""
        calls = 0
        while not self._stop.is_set():
            if not outputs.poll(POLL_MS):
                continue
            frames = outputs.recv_multipart(copy=False)
            if len(frames) == 1 and frames[0].buffer == EngineCoreProc.ENGINE_CORE_DEAD:
                return
            batch: EngineCoreOutputs = decoder.decode(frames)
            engine = engine_identity(batch.engine_index)
            if batch.utility_output is not None:
                dropped = [r for r in confirming.pop(batch.utility_output.call_id, []) if r not in self.dropped]
                self.dropped.update(dropped)
                if dropped:
                    logger.info("front end %d: the engine dropped its request(s) %s", self.front_end, " ".join(dropped))
                continue
            running = [output.request_id for output in batch.outputs if not output.finished]
            if not running:
                continue
            inputs.send_multipart((engine, EngineCoreRequestType.ABORT.value, *encoder.encode(running)))
            new = [request_id for request_id in running if request_id not in self.aborted]
            if new:
                self.aborted.update(new)
                logger.warning("front end %d: aborting in the engine its request(s) %s", self.front_end, " ".join(new))
            unconfirmed = [request_id for request_id in running if request_id not in self.dropped]
            if unconfirmed:  # asked again at each output: a call sent before the core reconnected is lost
                calls += 1
                confirming[calls] = unconfirmed
                call = (self.front_end, calls, CONFIRMING_CALL, ())
                inputs.send_multipart((engine, EngineCoreRequestType.UTILITY.value, *encoder.encode(call)))
            late = [request_id for request_id in running if request_id in self.dropped]
            if late:
                logger.error("front end %d: request(s) %s still ran after their abort", self.front_end, " ".join(late))
