"""The event loop's bookkeeping of an asyncio actor (the finalizer and its remote tier).

`Changes` is the one "something changed: wake the waiters, or time out" mechanism: every
waiter re-checks its own condition after each wake-up, so one notifier serves every tier.
`TaskSet` holds the background tasks a drain waits for.

Everything runs on one event loop: no change can slip in between a caller's check and its
wait, so no wake-up is lost, and neither class needs a lock.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any

from verl_ckpt.protocol.deadlines import deadline_in, time_left

__all__ = ["Changes", "TaskSet"]


class Changes:
    """Wakes every waiter at each change; a waiter re-checks what it waits for."""

    def __init__(self) -> None:
        self._event = asyncio.Event()

    def notify(self) -> None:
        # Waiters hold the event they waited on: set it, and give later waits a fresh one.
        self._event.set()
        self._event = asyncio.Event()

    async def wait(self, timeout_s: float) -> None:
        """Wait for the next change, at most `timeout_s` (never raises at the timeout: the
        caller checks its condition and its own deadline)."""
        # Taken before the first await: a notify after the caller's check wakes this wait.
        changed = self._event
        try:
            await asyncio.wait_for(changed.wait(), max(0.0, timeout_s))
        except TimeoutError:
            pass


class TaskSet:
    """Background tasks that are still referenced (the loop keeps only weak references)
    until they end, so that a drain can wait for them."""

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task] = set()

    def spawn(self, coroutine: Coroutine[Any, Any, Any]) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def pending(self) -> list[asyncio.Task]:
        return [task for task in self._tasks if not task.done()]

    async def ended(self, timeout_s: float) -> bool:
        """Wait up to `timeout_s` until no task is left; whether none is. Tasks spawned while
        it waits are waited for too: a drain's caller kills the actor once this returns, and
        a report that arrives meanwhile may start another commit."""
        deadline = deadline_in(timeout_s)
        while pending := self.pending():
            _, unfinished = await asyncio.wait(pending, timeout=time_left(deadline))
            if unfinished:
                return False
        return True

    def __len__(self) -> int:
        return len(self._tasks)
