"""A worker stopped while its engine loads exits at once.

arq stops a worker from handlers on its event loop, and vLLM's ``AsyncLLM`` start-up
blocks that loop's thread in C (waiting for the engine core, up to
``VLLM_ENGINE_READY_TIMEOUT_S``): a SIGTERM then waits for the whole load, past a
supervisor's grace period, and the SIGKILL that follows leaves the engine core behind.
A Python signal handler would wait just the same (it runs only when the main thread runs
bytecode). The C-level handler still writes the signal's number to the interpreter's
wakeup fd, so ``exit_on_stop_signal`` points that fd at a pipe that a thread reads for
the duration of the load.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from typing import Final

import psutil

logger = logging.getLogger("streamq.worker")

STOP_SIGNALS: Final = (signal.SIGTERM, signal.SIGINT)
CHILD_STOP_GRACE_S: Final = 5.0
"""How long the engine's processes get to end after SIGTERM before they are killed."""


def handled_in_python(signum: int) -> bool:
    """Whether ``signum`` has a Python handler that stops the process (the event loop's,
    where arq installed them): not Python's default SIGINT handler, which a test run
    leaves in place to raise ``KeyboardInterrupt`` where it expects it."""
    handler = signal.getsignal(signum)
    return callable(handler) and handler is not signal.default_int_handler


@contextlib.contextmanager
def exit_on_stop_signal(during: str = "the engine was loading") -> Iterator[None]:
    """While the block runs, SIGTERM or SIGINT (those with a handler of the event loop)
    ends the process at once, exit code 0: the multiprocessing children (vLLM's engine
    core) terminated, killed after ``CHILD_STOP_GRACE_S``. For a block before the worker
    registers or claims anything, so that nothing is lost. Other signals reach the wakeup
    fd they had; afterwards the previous fd (asyncio's) is back, and a stop signal that
    came as the block ended goes to the loop's own handler."""
    watched = frozenset(int(sig) for sig in STOP_SIGNALS if handled_in_python(sig))
    if not watched or threading.current_thread() is not threading.main_thread():
        yield  # nothing stops this process from the loop, or the wakeup fd is not ours to set
        return
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    previous = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
    watch = _StopWatch(read_fd, previous, watched, during)
    thread = threading.Thread(target=watch.run, name="stop-while-loading", daemon=True)
    thread.start()
    try:
        yield
    finally:
        signal.set_wakeup_fd(previous)
        if watch.finish():
            thread.join()  # it is stopping the process: wait for the exit, go no further
        os.close(write_fd)  # the thread reads the end of the pipe and returns
        thread.join(timeout=1.0)


class _StopWatch:
    """The thread's side: read signal numbers off the pipe; stop on a watched one."""

    def __init__(self, read_fd: int, previous_fd: int, watched: frozenset[int], during: str) -> None:
        self._read_fd = read_fd
        self._previous_fd = previous_fd
        self._watched = watched
        self._during = during
        self._lock = threading.Lock()
        self._finished = False
        self._stopping = False

    def finish(self) -> bool:
        """The block ended; True when a stop signal came first (the process is ending)."""
        with self._lock:
            self._finished = True
            return self._stopping

    def run(self) -> None:
        try:
            while data := os.read(self._read_fd, 64):
                for signum in data:
                    if signum in self._watched:
                        self._stop(signum)
                    elif self._previous_fd >= 0:
                        with contextlib.suppress(OSError):  # its reader is gone, or full
                            os.write(self._previous_fd, bytes([signum]))
        finally:
            os.close(self._read_fd)

    def _stop(self, signum: int) -> None:
        with self._lock:
            if self._finished:  # the loop's handler is in place again: let it take the signal
                os.kill(os.getpid(), signum)
                return
            self._stopping = True
        try:
            logger.info("stopped before serving (%s while %s)", signal.Signals(signum).name, self._during)
            stop_children(CHILD_STOP_GRACE_S)
        finally:
            for handler in logging.getLogger().handlers:
                with contextlib.suppress(Exception):
                    handler.flush()
            for stream in (sys.stdout, sys.stderr):
                with contextlib.suppress(Exception):
                    stream.flush()
            os._exit(0)  # nothing registered or claimed yet: nothing to hand back


def stop_children(grace_s: float) -> None:
    """Terminate this process's multiprocessing children (vLLM's engine core), and kill
    those still alive after ``grace_s``, with their own children (the engine core's model
    processes, which it would have stopped)."""
    children = multiprocessing.active_children()
    family = {child.pid: _descendants(child.pid) for child in children}
    for child in children:
        with contextlib.suppress(Exception):
            child.terminate()
    deadline = time.monotonic() + grace_s
    for child in children:
        child.join(max(0.0, deadline - time.monotonic()))
    for child in children:
        if child.is_alive():
            logger.warning("%s (pid %s) did not stop within %.0fs: killing it", child.name, child.pid, grace_s)
            family[child.pid] += _descendants(child.pid)
            with contextlib.suppress(Exception):
                child.kill()
                child.join(1.0)
    for descendant in (process for processes in family.values() for process in processes):
        with contextlib.suppress(psutil.Error):
            descendant.kill()  # psutil checks it is still the same process first


def _descendants(pid: int | None) -> list[psutil.Process]:
    try:
        return list(psutil.Process(pid).children(recursive=True))
    except (psutil.Error, ValueError):
        return []
