"""The finalizer's committer (protocol page, steps 5-7): it commits a step once its last
report was counted (intake.py; commit record, tracker), runs retention after the commit,
keeps from retention every step someone still reads, and deletes the directories of failed
steps once nobody writes into them.

It runs on the finalizer actor's one event loop (the ledger needs no lock); file work runs
in a thread, one commit, retention or removal at a time (`file_work`, shared with
admission's removal of leftovers).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any, TypeVar

from verl_ckpt.commit.ledger import StepLedger
from verl_ckpt.commit.metadata_forecast import MetadataForecast, role_inputs
from verl_ckpt.commit.steps import (
    CommitSummary,
    commit_step,
    discard_failed_steps,
)
from verl_ckpt.hf.scheduler import ExportQueue
from verl_ckpt.protocol import Failure, Phase, describe_failures
from verl_ckpt.protocol.errors import CheckpointError, RootLockedError
from verl_ckpt.protocol.event_loop import Changes, TaskSet
from verl_ckpt.protocol.messages import RankReport
from verl_ckpt.store.layout import DRIVER_ROLE, role_dir
from verl_ckpt.store.record_cache import VerifiedRecords
from verl_ckpt.store.retention import RetentionOutcome, apply_retention
from verl_ckpt.store.signing import Keyring
from verl_ckpt.store.tracker import CommitPhaseError

__all__ = ["Committer"]

logger = logging.getLogger(__name__)

_RECENT_SUMMARIES = 16

T = TypeVar("T")


class Committer:
    """Steps 5-7 of one checkpoint root. `uploading()` names the steps the remote tier reads
    now; `after_commit(step)` starts step 8 for a step just committed (both no-ops without a
    remote tier)."""

    def __init__(
        self,
        root: Path,
        participants: dict[str, int],
        keep: int | None,
        ledger: StepLedger,
        changes: Changes,
        tasks: TaskSet,
        forecast: MetadataForecast,
        exports: ExportQueue,
        uploading: Callable[[], set[int]],
        after_commit: Callable[[int], None],
        keyring: Keyring | None = None,
        check_lease: Callable[[str], None] = lambda what: None,
    ) -> None:
        self._root = root
        # checkpoint.signing: signs each record; retention counts only records it verifies.
        self._keyring = keyring
        self._participants = participants
        self._keep = keep
        self._ledger = ledger
        self._changes = changes
        self._tasks = tasks
        self._forecast = forecast
        self._exports = exports
        self._uploading = uploading
        self._after_commit = after_commit
        # Raises once the job's lease on the root is lost: checked in the file thread right
        # before each commit and each deletion, so that none happens after the loss.
        self._check_lease = check_lease
        # One commit or retention at a time: two would race on the tracker and the listing.
        self.file_work = asyncio.Lock()
        # The summaries of the last commits (with their timings), for waiters that ask after
        # the step was retired; bounded, like everything the finalizer keeps.
        self._recent: OrderedDict[int, CommitSummary] = OrderedDict()
        # The steps the last retention after a commit of this finalizer left only because
        # they were being uploaded: the end of their upload finishes that retention. Empty
        # until this finalizer commits, so an upload alone (the end of a run that committed
        # nothing uploads its newest step) never deletes a step (I3: only after a commit).
        self._spared_for_uploads: set[int] = set()
        # Whether the last commit's record and tracker move were made durable: until one is,
        # no retention runs (after that commit, nor when an upload it waited for ends).
        self._last_commit_durable = True
        # The records retention found valid (by their bytes): after every commit it reads
        # every step's record, and with thousands of ranks parsing them again was most of
        # its time (store/record_cache.py). Used only in the file thread, one run at a time.
        self._verified_records = VerifiedRecords(keyring)
        # Set when the coordinator closes (after its drain): no commit may start after that,
        # since the finalizer is killed once the exports ended, possibly in the middle of it.
        self._closed_by: str | None = None

    def recent(self, step: int) -> CommitSummary | None:
        """The summary of a recent commit of `step`, if this finalizer made it."""
        return self._recent.get(step)

    # ---- protocol step 5 starts: the last report arrived (intake.py) ---------------------

    def start_commit(self, step: int) -> None:
        """Commit `step`, whose last report was just counted (ledger READY), in the
        background."""
        # Committing from here on: a duplicate report can no longer start a second commit.
        entry = self._ledger.begin_commit(step)
        if self._closed_by is not None:
            self._commit_failed(
                step, CheckpointError(f"{self._closed_by} before its last report arrived")
            )
            return
        # The commit runs on its own: the last reporter (often the driver, in its training
        # loop) is not kept waiting for fsyncs it does not need to see.
        self._tasks.spawn(self._commit(step, list(entry.reports.values()), time.time()))

    def refuse_new_commits(self, closed_by: str) -> None:
        """From now on a step whose last report arrives fails, naming `closed_by`, instead
        of starting a commit that nothing would wait for."""
        self._closed_by = closed_by

    # ---- failed steps --------------------------------------------------------------------

    def expire_overdue(self) -> None:
        """Fail every step whose reports are overdue (a change: its waiters and
        back-pressure see it)."""
        expired = self._ledger.expire(time.monotonic())
        for entry in expired:
            logger.error(
                "step %d will not commit: %s", entry.step, describe_failures(entry.failures)
            )
        if expired:
            self.discard_settled_failures()
            self._changes.notify()

    def discard_settled_failures(self) -> None:
        """Delete, in the background, the directories of failed steps that nobody writes
        into any more (ledger.discardable). Called wherever a step may have settled: a
        failure, a late report of a failed step, an expiry, a begin_step."""
        steps = self._ledger.discardable(time.monotonic())
        if steps:
            self._tasks.spawn(self._discard(steps))

    async def _discard(self, steps: list[int]) -> None:
        # Under the lock of commits and retention: one of them lists the step directories.
        async with self.file_work:
            try:
                errors = await asyncio.to_thread(
                    self.guarded, "deleting failed steps", discard_failed_steps, self._root, steps
                )
            except RootLockedError as exc:
                errors = [str(exc)]
        if errors:
            logger.error(
                "could not delete failed steps %s (removed before the step is saved again): %s",
                steps,
                "; ".join(errors),
            )

    # ---- protocol steps 5-7: commit record, tracker, retention ----------------------------

    async def _commit(self, step: int, reports: list[RankReport], ready_at: float) -> None:
        async with self.file_work:
            roles = [role for role in self._participants if role != DRIVER_ROLE]
            inputs = {role: role_inputs([r for r in reports if r.role == role]) for role in roles}
            # A role's `.metadata` made while its ranks wrote, where exactly these reports
            # make it (otherwise commit_step makes it).
            made = {
                role: self._forecast.take(
                    step, role, role_dir(self._root, step, role), inputs[role]
                )
                for role in roles
            }
            try:
                summary = await asyncio.to_thread(
                    self.guarded,
                    f"the commit of step {step}",
                    commit_step,
                    self._root,
                    step,
                    self._participants,
                    reports,
                    made,
                    self._keyring,
                    self._ledger.state_participants,
                )
            except Exception as exc:  # noqa: BLE001 - any failure means "not committed"
                self._commit_failed(step, exc)
                return
            for role in roles:
                self._forecast.committed(role, inputs[role])
            errors = await self._committed(step, replace(summary, ready_at=ready_at))
        if errors:
            logger.error(
                "retention after step %d failed (retried after the next commit; step %d stays "
                "committed): %s",
                step,
                step,
                "; ".join(errors),
            )

    def _commit_failed(self, step: int, exc: Exception) -> None:
        logger.error("commit of step %d failed: %s", step, exc)
        phase = exc.phase if isinstance(exc, CommitPhaseError) else Phase.COMMIT
        code = exc.errno if isinstance(exc, (CommitPhaseError, OSError)) else None
        failure = Failure("finalizer", None, phase, str(exc), code)
        self._ledger.finish_commit(step, failure)
        self._changes.notify()
        # Queued behind this commit's lock: it runs once the commit has let go.
        self.discard_settled_failures()

    async def _committed(self, step: int, summary: CommitSummary) -> list[str]:
        """Step 7 after a commit, under the commit's lock: tell waiters, start the export and
        the upload, run retention, retire the step; the errors of retention."""
        self._ledger.finish_commit(step, summary=summary)
        self._recent[step] = summary
        while len(self._recent) > _RECENT_SUMMARIES:
            self._recent.popitem(last=False)
        # Queued in the same turn of the event loop as the commit is recorded: a waiter
        # that saw the commit also sees its export pending, and retention below keeps it.
        self._exports.submit(step)
        # Waiters learn of the commit before retention runs: deleting old steps need not
        # delay wait_for_commit.
        self._changes.notify()
        # Step 8 starts (in the background): the remote tier never delays a local commit.
        self._after_commit(step)
        # Taken in the same turn of the event loop as the steps retention keeps: an upload
        # that ends while retention runs still finds its step in the spared ones below.
        uploading = self._uploading()
        self._last_commit_durable = summary.durable
        if not summary.durable:
            # Old steps go only once a new tracker is durable (I3): a power loss may bring
            # back the tracker, or the record, of the step before this one.
            errors = [
                f"not run: step {step}'s commit record or tracker move was not made durable "
                "(a directory fsync failed), so no older step is deleted until a commit is"
            ]
        else:
            errors = await self._run_retention(step, uploading)
        # Only now may another step start (back-pressure counts the deleted step's
        # directory until it is gone), whether or not retention succeeded.
        self._ledger.retire(step)
        self._changes.notify()
        return errors

    async def _run_retention(self, step: int, uploading: set[int]) -> list[str]:
        """Retention after the commit of `step`, in the file thread; its errors."""
        try:
            # What it keeps is read here, on the event loop that changes it (a begin_step,
            # an export, an upload), never from the file thread while the loop runs.
            outcome = await asyncio.to_thread(
                self.guarded,
                f"retention after step {step}",
                self._retention,
                self.retention_keeps(),
            )
            errors = outcome.errors
            self._spared_for_uploads = uploading.intersection(outcome.spared)
        except Exception as exc:  # noqa: BLE001 - retention never un-commits a step
            errors = [f"{type(exc).__name__}: {exc}"]
            # What it left is unknown: the end of any of these uploads runs it again.
            self._spared_for_uploads = uploading
        return errors

    def _retention(self, keeps: list[int]) -> RetentionOutcome:
        return apply_retention(
            self._root,
            self._keep,
            keeps,
            keyring=self._keyring,
            verified=self._verified_records,
        )

    def guarded(self, what: str, work: Callable[..., T], *args: Any) -> T:
        """`work(*args)` in the file thread, unless the lease on the root is lost."""
        self._check_lease(what)
        return work(*args)

    def retention_keeps(self) -> list[int]:
        """Steps that retention must not delete whatever their age: steps in flight, steps
        queued for or under a Hugging Face export, and steps being uploaded (each is read
        by whoever works on it). One list for every retention run, so that none forgets one."""
        return sorted({*self._ledger.in_flight(), *self._exports.protected(), *self._uploading()})

    # ---- retention that waited for an upload ---------------------------------------------

    def retain_after_upload(self) -> None:
        """An upload ended: finish the retention of a commit that left its step, if any."""
        if self._keep is not None:
            self._tasks.spawn(self._retain_again())

    async def _retain_again(self) -> None:
        # The spared steps are read under the lock: a commit's retention running when the
        # upload ended sets them once it is done, and this runs after it.
        async with self.file_work:
            uploading = self._uploading()
            if not self._spared_for_uploads - uploading or not self._last_commit_durable:
                # No retention of this finalizer waits for an upload that ended, or the last
                # commit is not durable (_committed): the next durable commit runs it.
                return
            try:
                outcome = await asyncio.to_thread(
                    self.guarded,
                    "retention after an upload",
                    self._retention,
                    self.retention_keeps(),
                )
            except Exception as exc:  # noqa: BLE001 - a background task: logged, retried later
                logger.error("retention after an upload failed: %s: %s", type(exc).__name__, exc)
                return
            self._spared_for_uploads = uploading.intersection(outcome.spared)
        if outcome.errors:
            logger.error("retention after an upload failed: %s", "; ".join(outcome.errors))
