"""The finalizer's waits on the local tier: whoever waits for a step to commit
(wait_for_commit, protocol page step 5) or for room to begin one (back-pressure, step 1).

Each wait re-checks its condition after every change (protocol.event_loop.Changes, the
one notifier of the actor, which the remote tier's waits share) and ends at its deadline,
naming who is missing or what failed (I5). A step whose reports are overdue fails while
anyone waits (Committer.expire_overdue), so that no wait outlives the step it waits on.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from verl_ckpt.commit.committer import Committer
from verl_ckpt.commit.ledger import StepLedger, StepStatus
from verl_ckpt.commit.steps import step_summary
from verl_ckpt.protocol import describe_failures
from verl_ckpt.protocol.deadlines import deadline_in, time_left
from verl_ckpt.protocol.errors import CommitTimeoutError, StepNotCommittedError
from verl_ckpt.protocol.event_loop import Changes
from verl_ckpt.protocol.messages import Participant
from verl_ckpt.store.commit_record import is_committed
from verl_ckpt.store.layout import step_dir

__all__ = ["Waiters", "describe_participants"]


def describe_participants(participants: list[Participant]) -> str:
    return ", ".join(f"{role} rank {rank}" for role, rank in sorted(participants))


class Waiters:
    """Waits on the steps of one checkpoint root."""

    def __init__(
        self, root: Path, ledger: StepLedger, changes: Changes, committer: Committer
    ) -> None:
        self._root = root
        self._ledger = ledger
        self._changes = changes
        self._committer = committer

    async def wait_for_commit(self, step: int, timeout_s: float) -> dict[str, Any]:
        """Wait until `step` committed; raise naming who is missing or what failed."""
        deadline = deadline_in(timeout_s)
        while True:
            status = self._ledger.status(step)
            recent = self._committer.recent(step)
            if status is StepStatus.COMMITTED or recent is not None:
                return asdict(recent or self._ledger.entry(step).summary)
            if status is None and is_committed(step_dir(self._root, step)):
                return asdict(step_summary(self._root, step))  # long retired: the record says
            if status in (StepStatus.FAILED, StepStatus.LOST):
                raise self.not_committed(step, status)
            remaining = time_left(deadline)
            if remaining <= 0:
                missing = self._ledger.missing(step)
                what = "missing reports from: " + self._ledger.describe(missing)
                if status is StepStatus.COMMITTING:
                    what = "every report arrived; its commit is still running"
                raise CommitTimeoutError(
                    f"step {step} not committed within {timeout_s:.0f}s under {self._root}; {what}"
                )
            await self.changed_or_timeout(remaining)

    async def wait_until(
        self, ready: Callable[[], bool], timeout_s: float, message: Callable[[], str]
    ) -> None:
        """Wait until `ready()`; at `timeout_s`, raise CommitTimeoutError(message())."""
        deadline = deadline_in(timeout_s)
        while not ready():
            remaining = time_left(deadline)
            if remaining <= 0:
                raise CommitTimeoutError(message())
            await self.changed_or_timeout(remaining)

    async def changed_or_timeout(self, timeout_s: float) -> None:
        """Wait for the next change, at most `timeout_s`; a step whose reports are overdue
        fails meanwhile (a change: its waiters and back-pressure see it)."""
        # Everything runs on one event loop: no change can slip in between a caller's check
        # and this wait, so no wake-up is lost.
        until_expiry = self._ledger.next_expiry() - time.monotonic()
        await self._changes.wait(min(timeout_s, until_expiry))
        self._committer.expire_overdue()

    def not_committed(self, step: int, status: StepStatus) -> StepNotCommittedError:
        if status is StepStatus.LOST:
            return StepNotCommittedError(
                f"step {step} will not commit: its reports were lost in a finalizer restart"
            )
        return StepNotCommittedError(
            f"step {step} will not commit: " + describe_failures(self._ledger.failures(step))
        )
