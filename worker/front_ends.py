"""``python -m worker --front-ends N``: one engine core fed by N worker processes.

On a GPU host the model leaves the CPU alone, and what bounds a node is the one Python
process that turns the engine's outputs into tokens: vLLM's output processing and the
queue's per-token work share its core. ``vllm serve --api-server-count N`` answers this
with N API-server processes over one engine core; this is the same for the worker. The
parent process starts the engine core as ``vllm serve`` does (ZMQ listeners bound first,
then ``launch_core_engines``), and N front ends, each a whole worker (its own worker id,
lease, registration, stats report, publisher and cancel listener) whose ``AsyncLLM``
connects to that core with its own client index. They share the engine's request slots
(``SharedSlots``): together they never run more requests than it schedules at once.

The parent then watches:

- a front end that dies before every front end has started fails the whole worker at
  start-up (nothing is left half up);
- a front end that dies later: its requests are taken over through their leases (by a
  sibling or another worker), its slots are given back, and its requests still running
  in the engine are aborted (``OrphanReaper``); the siblings go on serving;
- the engine core dying: the parent tells every front end (``tell_engine_death``), which
  hands its requests back as a single worker does, and exits with
  ``ENGINE_DEAD_EXIT_CODE``, for its supervisor to restart it;
- SIGTERM or SIGINT: every front end drains, then the engine stops.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import multiprocessing
import os
import signal
import time
from dataclasses import dataclass, field
from multiprocessing.connection import wait
from multiprocessing.process import BaseProcess
from types import FrameType
from typing import Any

import zmq
from vllm.utils.network_utils import ZmqListener
from vllm.v1.engine.core import EngineCoreProc
from vllm.v1.engine.utils import CoreEngineProcManager, bind_engine_zmq_listeners, launch_core_engines
from vllm.v1.executor import Executor

from worker.config import FrontEndSeat
from worker.engine import engine_args_from_namespace, engine_config, log_scheduler_limits
from worker.orphans import OrphanReaper
from worker.scheduling import lower_worker_cpu_weight
from worker.shared_slots import SharedSlots
from worker.startup import config_from_args, configure_logging, parse_args, run_worker
from worker.state import ENGINE_DEAD_EXIT_CODE

logger = logging.getLogger("streamq.worker")

START_FAILED_EXIT_CODE = 1
STOP_GRACE_S = 30.0
"""How long a front end may take to stop beyond its drain before it is killed."""
ANNOUNCE_LINGER_S = 2.0
"""How long the news of the engine's death may wait for a front end to take it."""


def run_front_end(argv: list[str], seat: FrontEndSeat) -> None:
    """A front end's process: the worker's command line, run as front end ``seat.index``."""
    args = parse_args(argv)
    configure_logging(args, front_ends=True)
    raise SystemExit(run_worker(config_from_args(args, seat)))


@dataclass
class FrontEnd:
    """A front end's process as its parent sees it."""

    seat: FrontEndSeat
    process: BaseProcess
    input_listener: ZmqListener
    output_listener: ZmqListener
    """The parent keeps its copies of the listeners: after the front end's death, the
    orphan reaper adopts them to reach the engine core on the front end's channel."""
    reaper: OrphanReaper | None = field(default=None)

    @property
    def name(self) -> str:
        return f"front end {self.seat.index} (pid {self.process.pid})"


class _Stop(Exception):
    """SIGTERM or SIGINT arrived."""


class FrontEndsSupervisor:
    """Starts the engine core and the front ends, and watches them until they end."""

    def __init__(self, argv: list[str], args: argparse.Namespace) -> None:
        if args.engine_factory:
            raise SystemExit("--front-ends needs vLLM's engine core; it cannot be combined with --engine-factory")
        self.argv = argv
        self.args = args
        self.count: int = args.front_ends
        self.front_ends: list[FrontEnd] = []
        self.engine: CoreEngineProcManager | None = None
        """The engine core's process manager (vLLM's ``CoreEngineProcManager``), once started."""
        self.stop_requested = False

    def run(self) -> int:
        """Serve until a signal or the engine's death; the exit code."""
        lower_worker_cpu_weight(self.args.cpu_nice)  # the engine core and the front ends inherit it
        engine_args = engine_args_from_namespace(self.args)
        engine_args._api_process_count = self.count
        engine_args._api_process_rank = -1
        config = engine_config(engine_args)
        log_scheduler_limits(config)
        slots = SharedSlots(self.args.max_jobs or config.scheduler_config.max_num_seqs, self.count)
        listeners = bind_engine_zmq_listeners(config, self.count)
        previous = {sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
        try:
            try:
                self._start(config, engine_args.disable_log_stats, listeners, slots)
            except _Stop:
                logger.info("stopped while starting")
                self._stop_front_ends()
                return 0
            except Exception as exc:
                logger.error("the worker failed to start: %s", exc)
                self._stop_front_ends()
                return START_FAILED_EXIT_CODE
            return self._watch(slots)
        finally:
            if self.engine is not None:
                self.engine.shutdown()
                logger.info("engine core shut down")
            for front_end in self.front_ends:
                if front_end.reaper is not None:
                    front_end.reaper.stop()
            for listener in (*listeners.inputs, *listeners.outputs):
                listener.cleanup()
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if not self.stop_requested:
            self.stop_requested = True
            logger.info("%s: stopping the front ends, then the engine", signal.Signals(signum).name)
            raise _Stop

    def _start(self, config: Any, disable_log_stats: bool, listeners: Any, slots: SharedSlots) -> None:
        """Start the engine core and the front ends (which connect to it as it loads), and
        wait until every front end serves."""
        spawn = multiprocessing.get_context("spawn")
        executor = Executor.get_class(config)
        with launch_core_engines(config, executor, not disable_log_stats, listeners.addresses) as launch:
            if isinstance(launch.engine_manager, CoreEngineProcManager):
                self.engine = launch.engine_manager  # run() shuts it down, even if stopped while it loads
            for index, (inputs, outputs) in enumerate(zip(listeners.inputs, listeners.outputs, strict=True)):
                client_config: dict[str, Any] = {
                    "input_address": inputs.address,
                    "output_address": outputs.address,
                    "input_listener": inputs.socket,
                    "output_listener": outputs.socket,
                }
                if launch.coordinator is not None:
                    client_config["stats_update_address"] = launch.coordinator.get_stats_publish_address()
                if launch.tensor_queue is not None:
                    client_config["tensor_queue"] = launch.tensor_queue
                seat = FrontEndSeat(index, self.count, client_config, slots, ready=spawn.Event())
                process = spawn.Process(target=run_front_end, args=(self.argv, seat), name=f"FrontEnd_{index}")
                process.start()
                self.front_ends.append(FrontEnd(seat, process, inputs, outputs))
            launch.watched_frontend_processes = [front_end.process for front_end in self.front_ends]
        engine = self.engine
        if engine is None:
            raise RuntimeError("--front-ends needs engine cores started on this host (not by Ray)")
        logger.info("engine core started; waiting for %d front ends", self.count)
        while not all(front_end.seat.ready.is_set() for front_end in self.front_ends):
            for front_end in self.front_ends:
                if not front_end.process.is_alive():
                    raise RuntimeError(f"{front_end.name} exited with {front_end.process.exitcode} while starting")
            for core in engine.processes:
                if not core.is_alive():
                    raise RuntimeError(f"the engine core exited with {core.exitcode} while front ends started")
            wait([front_end.process.sentinel for front_end in self.front_ends], timeout=0.2)
        logger.info("%d front ends serving one engine core, %d request slots between them", self.count, slots.limit)

    def _watch(self, slots: SharedSlots) -> int:
        """Watch the front ends and the engine core until a signal or the engine's death."""
        engine = self.engine
        assert engine is not None
        try:
            while True:
                live = [front_end for front_end in self.front_ends if front_end.reaper is None]
                sentinels = [front_end.process.sentinel for front_end in live]
                sentinels += [process.sentinel for process in engine.processes]
                wait(sentinels, timeout=1.0)
                dead_engine = [process for process in engine.processes if not process.is_alive()]
                if dead_engine:
                    logger.critical(
                        "the engine core died (exit code %s): the front ends hand their requests back",
                        dead_engine[0].exitcode,
                    )
                    tell_engine_death([front_end.output_listener.address for front_end in live])
                    self._wait_for_front_ends()
                    return ENGINE_DEAD_EXIT_CODE
                for front_end in live:
                    if not front_end.process.is_alive():
                        self._front_end_died(front_end, slots)
                if all(front_end.reaper is not None for front_end in self.front_ends):
                    logger.critical("every front end died: stopping the engine")
                    return START_FAILED_EXIT_CODE
        except _Stop:
            return self._stop_front_ends()

    def _front_end_died(self, front_end: FrontEnd, slots: SharedSlots) -> None:
        freed = slots.give_back_all_of(front_end.seat.index)
        logger.error(
            "%s died (exit code %s): its requests go to other front ends or workers as their leases lapse; "
            "%d engine slots given back; %d front ends left",
            front_end.name,
            front_end.process.exitcode,
            freed,
            sum(1 for other in self.front_ends if other.process.is_alive()),
        )
        front_end.reaper = OrphanReaper(front_end.seat.index, front_end.input_listener, front_end.output_listener)
        front_end.reaper.start()

    def _stop_front_ends(self) -> int:
        """SIGTERM every front end (each drains, as a single worker does), then wait; the
        worst exit code among them."""
        for front_end in self.front_ends:
            if front_end.process.is_alive() and front_end.process.pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(front_end.process.pid, signal.SIGTERM)
        return self._wait_for_front_ends()

    def _wait_for_front_ends(self) -> int:
        deadline = time.monotonic() + self.args.drain_seconds + STOP_GRACE_S
        codes = []
        for front_end in self.front_ends:
            if front_end.reaper is not None:
                continue  # died earlier, and said so then
            front_end.process.join(max(0.0, deadline - time.monotonic()))
            if front_end.process.is_alive():
                logger.error("%s did not stop in time: killing it", front_end.name)
                front_end.process.kill()
                front_end.process.join()
            code = front_end.process.exitcode or 0
            codes.append(code if code >= 0 else 1)  # killed by a signal: a failure, as an exit code
        return max(codes, default=0)


def tell_engine_death(output_addresses: list[str]) -> None:
    """Send each front end, on its output channel, the message vLLM's engine core sends its
    clients when it fails: an engine killed outright cannot, and a front end, whose engine
    core another process started, does not watch that process. Each then takes the path of
    a worker whose engine died: its requests handed back, exit code 3."""
    context = zmq.Context()
    try:
        for address in output_addresses:
            announcer = context.socket(zmq.PUSH)
            announcer.connect(address)
            announcer.send(EngineCoreProc.ENGINE_CORE_DEAD)
            announcer.close(linger=int(ANNOUNCE_LINGER_S * 1000))
    finally:
        context.term()


def serve_front_ends(argv: list[str], args: argparse.Namespace) -> int:
    """``python -m worker --front-ends N``: the engine core and N front ends; the exit code."""
    return FrontEndsSupervisor(argv, args).run()
