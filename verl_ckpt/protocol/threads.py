"""A small pool of daemon threads whose shutdown honours a deadline.

`concurrent.futures.ThreadPoolExecutor` cannot: `shutdown(wait=True)` waits for a hung task
forever, and its threads are joined at interpreter exit, so a write stuck on a dead disk
would also keep the process from exiting. Here a hung task is named at the deadline and
left to a daemon thread that does not hold the process up.
"""

from __future__ import annotations

import logging
import os
import queue
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from verl_ckpt.protocol.deadlines import deadline_in, time_left

logger = logging.getLogger(__name__)

__all__ = [
    "DaemonPool",
    "idle_until_starved",
    "leave_idle_class",
    "lower_priority",
    "made_progress",
    "run_when_idle",
]

_STOP = None


def lower_priority(nice: int) -> None:
    """Lower the calling thread's CPU priority to `nice` (and its I/O to the best-effort
    class's lowest level), so that background writes yield to the training thread.

    On Linux, niceness and I/O priority belong to each thread (a thread id is a task of its
    own), and threads started afterwards by this one inherit them. Elsewhere, and where the
    system refuses, this does nothing: priorities are an optimisation, never a requirement.
    """
    if nice <= 0 or not sys.platform.startswith("linux"):
        return
    tid = threading.get_native_id()
    try:
        os.setpriority(os.PRIO_PROCESS, tid, max(nice, os.getpriority(os.PRIO_PROCESS, tid)))
        import psutil

        psutil.Process(tid).ionice(psutil.IOPRIO_CLASS_BE, 7)
    except Exception:  # noqa: BLE001 - OSError, psutil's NoSuchProcess/AccessDenied: optional
        pass


def run_when_idle() -> None:
    """Put the calling thread in Linux's SCHED_IDLE class: it runs only on a core that
    nothing else wants, however low its niceness (a nice-19 thread still takes a share of a
    busy core). For work whose result is optional: its callers must never wait for it
    unboundedly, since a busy machine may not run it at all. Elsewhere, does nothing."""
    if not sys.platform.startswith("linux") or not hasattr(os, "SCHED_IDLE"):
        return
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))  # 0: the calling thread
    except OSError:
        pass


# A thread in idle_until_starved() that has waited this long for a core in all (runnable
# but not running) leaves the idle class: a busy machine gave it no idle core, and its
# result is awaited (a save). The bound also ends a priority inversion: a starved writer
# thread holding the GIL holds up the trainer's thread.
STARVED_AFTER_S = 0.5
# made_progress reads the kernel's count at most this often: a save writes hundreds of small
# pieces (a blob's head and tail, padding), and a read of /proc per piece cost the writer
# thread more CPU than the bytes themselves. Small against STARVED_AFTER_S, so a starved
# thread still leaves the idle class in time.
_CHECK_EVERY_S = 0.01

_idle_state = threading.local()
_may_leave: dict[int, bool] = {}  # niceness -> whether a thread at it may leave SCHED_IDLE
_probe_lock = threading.Lock()
_warned = False


def idle_until_starved(nice: int) -> bool:
    """Put the calling thread in SCHED_IDLE (run_when_idle) for work that is awaited, such
    as a save's writes: it then takes no share of a core the training thread wants, and
    `made_progress` moves it back to the normal class at `nice` once it has waited
    STARVED_AFTER_S for a core since this call. Only where the thread may leave SCHED_IDLE
    again (an unprivileged process needs RLIMIT_NICE for it): elsewhere it stays in the
    normal class, and this returns False."""
    if not _may_leave_idle():
        return False
    run_when_idle()
    _idle_state.nice = nice
    _idle_state.waited = _waited_for_cores_s()
    _idle_state.since = time.monotonic()
    _idle_state.checked = _idle_state.since
    return True


def made_progress() -> None:
    """Called by a thread in idle_until_starved as its work goes on (each slice of a write):
    once it has waited STARVED_AFTER_S for a core in all since then, it leaves SCHED_IDLE
    for the normal class at its niceness, until the next idle_until_starved. The wait is
    the kernel's count of the thread's time runnable but not running (schedstat), which
    sleeps on the disk do not add to; without it, the time since idle_until_starved."""
    nice = getattr(_idle_state, "nice", None)
    if nice is None:
        return
    now = time.monotonic()
    if now - _idle_state.checked < _CHECK_EVERY_S:
        return
    _idle_state.checked = now
    waited = _waited_for_cores_s()
    if waited is not None and _idle_state.waited is not None:
        starved = waited - _idle_state.waited
    else:
        starved = now - _idle_state.since
    if starved <= STARVED_AFTER_S:
        return
    _idle_state.nice = None
    if not leave_idle_class():
        _warn_once("a starved writer thread could not leave SCHED_IDLE")
    lower_priority(nice)


def leave_idle_class() -> bool:
    """Move the calling thread from SCHED_IDLE back to the normal class, if it is in the
    idle class (its niceness stays). False only where that was refused."""
    if not hasattr(os, "SCHED_IDLE") or not sys.platform.startswith("linux"):
        return True
    try:
        if os.sched_getscheduler(0) == os.SCHED_IDLE:
            os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))
    except OSError:
        return False
    return True


def _waited_for_cores_s() -> float | None:
    """The calling thread's time runnable but waiting for a core, in seconds (the second
    field of Linux's schedstat), or None where the kernel does not count it."""
    try:
        with open(f"/proc/self/task/{threading.get_native_id()}/schedstat", "rb") as f:
            return int(f.read().split()[1]) / 1e9
    except (OSError, ValueError, IndexError):
        return None


def _may_leave_idle() -> bool:
    """Whether a thread at the calling thread's niceness can go back from SCHED_IDLE to
    SCHED_OTHER (the kernel checks it against RLIMIT_NICE at that niceness), tried once per
    niceness on a thread of its own, which inherits it: a thread stuck idle would starve on
    a busy machine."""
    if not sys.platform.startswith("linux") or not hasattr(os, "SCHED_IDLE"):
        return False
    try:
        nice = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    except OSError:
        return False
    with _probe_lock:
        if nice not in _may_leave:
            found: list[bool] = []

            def probe() -> None:
                try:
                    os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
                    os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))
                    found.append(True)
                except OSError:
                    found.append(False)

            thread = threading.Thread(target=probe, name="verl_ckpt_idle_probe", daemon=True)
            thread.start()
            # Two system calls; bounded anyway (a thread that never ran counts as a no).
            thread.join(5.0)
            _may_leave[nice] = bool(found and found[0])
        return _may_leave[nice]


def _warn_once(message: str) -> None:
    global _warned
    if not _warned:
        _warned = True
        logger.warning("%s", message)


class DaemonPool:
    """`threads` daemon threads running submitted calls in order of submission, at CPU
    niceness `nice` (0: unchanged), or, with `idle`, only when a core is idle
    (run_when_idle), or, with `idle_until_starved`, in the idle class for each call until
    the call reports it starved (threads.made_progress). `normal_class`: out of the idle
    class even when started by a thread in it (which a new thread inherits)."""

    def __init__(
        self,
        threads: int,
        name: str,
        nice: int = 0,
        idle: bool = False,
        idle_until_starved: bool = False,
        normal_class: bool = False,
    ) -> None:
        self._tasks: queue.SimpleQueue = queue.SimpleQueue()
        self._running: dict[int, str] = {}  # thread ident -> what it runs, for close()
        self._lock = threading.Lock()
        self._closed = False
        self._nice = nice
        self._idle = idle
        self._idle_until_starved = idle_until_starved
        self._normal_class = normal_class
        self._threads = [
            threading.Thread(target=self._work, name=f"{name}_{i}", daemon=True)
            for i in range(threads)
        ]
        for thread in self._threads:
            thread.start()

    def submit(self, fn: Callable[..., Any], *args: Any, label: str = "") -> Future:
        """Run `fn(*args)` on a pool thread; `label` names it if it is still running at
        close()."""
        with self._lock:
            if self._closed:
                raise RuntimeError("DaemonPool is closed")
            future: Future = Future()
            self._tasks.put((future, fn, args, label or getattr(fn, "__name__", "task")))
        return future

    def close(self, timeout_s: float) -> list[str]:
        """Stop the threads, waiting up to `timeout_s` for running tasks; calls not started
        yet are cancelled. Returns the labels of tasks still running at the deadline."""
        with self._lock:
            if not self._closed:
                self._closed = True
                for _ in self._threads:
                    self._tasks.put(_STOP)
        deadline = deadline_in(timeout_s)
        for thread in self._threads:
            thread.join(time_left(deadline))
        with self._lock:
            return [self._running[t.ident] for t in self._threads if t.ident in self._running]

    def _work(self) -> None:
        lower_priority(self._nice)
        if self._normal_class:
            leave_idle_class()
        if self._idle:
            run_when_idle()
        while True:
            # An idle worker's wait, deliberately without a deadline: every caller bounds
            # its own wait on the future it was handed, and close() posts _STOP for each
            # thread and joins them within its timeout (the threads are daemons).
            item = self._tasks.get()
            if item is _STOP:
                return
            future, fn, args, label = item
            # A call not started by close() is cancelled; notify_cancel wakes its waiters
            # (a future only cancel()ed never counts as done for concurrent.futures.wait).
            if self._closed:
                future.cancel()
            if not future.set_running_or_notify_cancel():
                continue
            with self._lock:
                self._running[threading.get_ident()] = label
            if self._idle_until_starved:
                # Back in the idle class for each call: a call that starved left it.
                idle_until_starved(self._nice)
            try:
                future.set_result(fn(*args))
            except BaseException as exc:  # noqa: BLE001 - handed to whoever waits on the future
                future.set_exception(exc)
            finally:
                with self._lock:
                    self._running.pop(threading.get_ident(), None)
