"""The helper thread of one file written around the page cache (direct_io.DirectFile): it
hands the file's requests to the device, first in first out, and tells a device that stopped
taking them (hung) from one that is only slow.

Why a thread of its own: while it waits for the device, the writer goes on filling the next
buffer, so that the device never waits for the copy. Why "hung" is judged by requests and not
by jobs: one job may be many requests (each a write of at most one buffer,
direct_io._BUFFER_BYTES); a long job whose requests go on ending is slow, not hung.
"""

from __future__ import annotations

import errno
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import wait as wait_for_futures

from verl_ckpt.protocol.threads import DaemonPool

__all__ = ["DeviceQueue", "hung_error"]

# How long the device may end no request of a job (one write of at most a buffer: from a
# buffer, vectored, or from the caller's memory) before it is named as hung; the save's own
# deadline bounds the whole write as well.
_HELPER_WAIT_S = 300.0


def hung_error() -> OSError:
    return OSError(errno.ETIMEDOUT, f"a direct write hung for {_HELPER_WAIT_S:.0f}s")


class DeviceQueue:
    """The jobs queued for one file's helper thread. A job's requests call
    `request_ended()` as each ends. `submit` queues a job the queue keeps track of (its
    error is raised by a later wait); `run` queues one the caller waits for itself."""

    def __init__(self) -> None:
        self._pool: DaemonPool | None = None
        # The last tracked job, if it may still run; its end means every earlier one ended
        # (one helper, first in first out), whose errors wait in `unchecked`.
        self.last: Future | None = None
        self.unchecked: list[Future] = []
        # Requests seen to end (on the helper, or on the writer once the helper is idle:
        # DirectFile.finish): a long job is hung only once none of its requests ended for
        # _HELPER_WAIT_S.
        self.requests_ended = 0
        self.hung = False  # a job outlasted _HELPER_WAIT_S: close() does not wait for it again

    def request_ended(self) -> None:
        """Called as each request ends (on the helper, or on the writer while the helper is
        idle)."""
        self.requests_ended += 1

    def submit(self, job: Callable[..., object], *args: object) -> None:
        """Queue `job`; it is then the last one."""
        if self.last is not None:
            self.unchecked.append(self.last)
        self.last = self._helper().submit(job, *args)

    def run(self, job: Callable[..., object], *args: object) -> Future:
        """Queue `job` (after every earlier one), untracked: the caller waits for it."""
        return self._helper().submit(job, *args)

    def wait_for_oldest(self) -> None:
        """Wait for the oldest tracked job not waited for yet (raising its error)."""
        oldest = self.unchecked[0]
        if not self.ended_in_time(oldest, self.requests_ended):
            raise hung_error()
        self.unchecked.pop(0).result()

    def wait_for_all(self) -> None:
        """Wait for every tracked job (raising the first error); a device on which none of
        their requests ended for _HELPER_WAIT_S is named as hung."""
        last, self.last = self.last, None
        if last is None:
            return
        if not self.ended_in_time(last, self.requests_ended):
            self.last = last  # still reading its buffer: close() must not unmap it
            raise hung_error()
        earlier, self.unchecked = self.unchecked, []
        for job in earlier:  # ended before `last` began
            job.result()
        last.result()

    def ended_in_time(self, job: Future, ended: int | None = None) -> bool:
        """Whether `job` ended before the device looked hung: _HELPER_WAIT_S without it
        ending or, given `ended` (the count of ended requests when it was queued),
        _HELPER_WAIT_S in which none of its requests ended. If not, `hung` is set: close()
        does not wait for the helper again."""
        while True:
            done, _ = wait_for_futures([job], timeout=_HELPER_WAIT_S)
            if done:
                return True
            if ended is None or self.requests_ended == ended:
                self.hung = True
                return False
            ended = self.requests_ended

    def close(self) -> list[str]:
        """Cancel the jobs not started; wait for the one running (not again where it was
        found hung). Returns the labels of those still running then."""
        if self._pool is None:
            return []
        return self._pool.close(0.1 if self.hung else _HELPER_WAIT_S)

    def _helper(self) -> DaemonPool:
        """The helper thread, started once. It runs in the normal scheduling class: it
        takes next to no CPU, and in the idle class it could be starved while the writer
        waits for it."""
        if self._pool is None:
            self._pool = DaemonPool(1, "verl_ckpt_direct_write", normal_class=True)
        return self._pool
