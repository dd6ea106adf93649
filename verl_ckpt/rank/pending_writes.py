"""The saves of one rank whose write and report still run in the background (protocol page,
steps 3-4): their queue in save order, their deadlines, and the failure of one of them,
raised to the caller once."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import wait as wait_for_futures
from dataclasses import dataclass
from typing import Any

from verl_ckpt.protocol.deadlines import time_left
from verl_ckpt.protocol.errors import CommitTimeoutError

__all__ = ["PendingWrites"]


@dataclass
class _Save:
    step: int
    deadline: float  # monotonic
    future: Future
    stats: Any  # SaveStats, filled in by the background job
    # Its failure was already raised to the caller (by the save() that started it): waited
    # for like any save in flight, never raised again.
    raised: bool = False


class PendingWrites:
    """At most `limit` saves in flight; the oldest is waited for (with its own deadline)
    before another starts. `owner` names the rank in errors ("actor rank 0 of /ckpt")."""

    def __init__(self, limit: int, owner: str, timeout_s: float) -> None:
        self._limit = limit
        self._owner = owner
        self._timeout_s = timeout_s
        self._queue: deque[_Save] = deque()
        self._pending_error: BaseException | None = None
        self._completed: list[Any] = []

    def __len__(self) -> int:
        return len(self._queue)

    def add(
        self, step: int, deadline: float, future: Future, stats: Any, raised: bool = False
    ) -> None:
        self._queue.append(_Save(step, deadline, future, stats, raised))

    def wait_for_room(self) -> None:
        """Back-pressure before a new save: wait while `limit` saves are in flight, then
        raise the failure of an earlier save, once."""
        self.collect()
        while len(self._queue) >= self._limit:
            oldest = self._queue[0]
            if not self._wait(oldest.future, oldest.deadline):
                # What it is doing (SaveStats.doing) tells a slow disk from a finalizer
                # that does not answer.
                doing = getattr(oldest.stats, "doing", None)
                raise CommitTimeoutError(
                    f"{self._owner}: the write of step {oldest.step} is still running after "
                    f"checkpoint.timeout_s={self._timeout_s:g}s"
                    + (f" ({doing})" if doing else "")
                    + "; not starting another save"
                )
            self.collect()
        self.raise_pending()

    def drain(self, deadline: float) -> None:
        """Wait until every save in flight ended, or raise at `deadline` naming the steps."""
        while self._queue:
            if not self._wait(self._queue[0].future, deadline):
                steps = [save.step for save in self._queue]
                raise CommitTimeoutError(
                    f"{self._owner}: writes of steps {steps} not finished within the deadline"
                )
            self.collect()

    def drain_where(self, wanted: Callable[[Any], bool], deadline: float) -> None:
        """Wait until every save in flight whose stats are `wanted` ended (saves end in order:
        up to the last of them), or raise at `deadline` naming its step."""
        last = max((i for i, save in enumerate(self._queue) if wanted(save.stats)), default=-1)
        for save in list(self._queue)[: last + 1]:
            if not self._wait(save.future, deadline):
                raise CommitTimeoutError(
                    f"{self._owner}: the write of step {save.step} not finished within the deadline"
                )
        self.collect()

    def collect(self) -> None:
        """Move the saves that ended out of the queue, in order; keep the first failure."""
        while self._queue and self._queue[0].future.done():
            save = self._queue.popleft()
            error = save.future.exception()
            if error is None:
                self._completed.append(save.stats)
            elif self._pending_error is None and not save.raised:
                self._pending_error = error

    def raise_pending(self) -> None:
        error, self._pending_error = self._pending_error, None
        if error is not None:
            raise error

    def take_completed(self) -> list[Any]:
        done, self._completed = self._completed, []
        return done

    @staticmethod
    def _wait(future: Future, deadline: float) -> bool:
        # `wait` rather than `future.result(timeout)`: the job's own exceptions (some are
        # TimeoutErrors) must not read as "still running", and nothing here catches
        # BaseException, so Ctrl-C in a waiting trainer is never swallowed.
        done, _ = wait_for_futures([future], timeout=time_left(deadline))
        return bool(done)
