"""The finalizer's side of the remote tier (protocol page, steps 8-11): decide which locally
committed steps are uploaded, collect the ranks' upload reports, then upload what no rank
confirmed, the commit record, the tracker, and run remote retention.

It lives inside the finalizer actor and runs on its event loop (no lock needed for the
ledger), and its waits share the actor's one notifier (protocol.event_loop.Changes); store
calls run in threads, one remote commit at a time, and never while holding the local
tier's lock: a local commit never waits for the remote tier.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from verl_ckpt.protocol.deadlines import deadline_in, time_left
from verl_ckpt.protocol.errors import CommitTimeoutError
from verl_ckpt.protocol.event_loop import Changes, TaskSet
from verl_ckpt.protocol.messages import StepStatus
from verl_ckpt.protocol.phases import participants_text
from verl_ckpt.remote.ledger import UploadLedger, UploadReport, UploadStatus
from verl_ckpt.remote.tier import commit_remote_step, withdraw_other_remote_record
from verl_ckpt.store.commit_record import (
    COMMIT_RECORD_MAX_BYTES,
    committed_steps,
    is_committed,
    read_record_bytes,
)
from verl_ckpt.store.fsspec_store import call_with_deadline, describe_store_error
from verl_ckpt.store.layout import COMMIT_RECORD_FILENAME, DRIVER_ROLE, TRACKER_FILENAME, step_dir
from verl_ckpt.store.open_store import open_store
from verl_ckpt.store.recovery import roll_tracker_forward
from verl_ckpt.store.retention import apply_retention
from verl_ckpt.store.signing import Keyring

__all__ = ["RemoteTier"]

logger = logging.getLogger(__name__)


class RemoteTier:
    """Uploads of one checkpoint root to one remote tier URL. `settings` are the fields of
    `RemoteConfig` plus `timeout_s`; `local_status(step)` is the step's state in the local
    ledger (ledger.StepLedger.status); `on_upload_end()` is called when
    an upload ended, either way (the finalizer finishes a local retention that left the step
    for its upload, if one did). `changes` is the finalizer's notifier: a change of either
    tier wakes the waiters of both (a new one when the tier runs alone)."""

    def __init__(
        self,
        settings: dict[str, Any],
        root: Path,
        participants: dict[str, int],
        local_status: Callable[[int], StepStatus | None],
        on_upload_end: Callable[[], None] = lambda: None,
        changes: Changes | None = None,
        keyring: Keyring | None = None,
    ) -> None:
        self.url: str = settings["url"]
        # checkpoint.signing: the remote tier's recovery and retention trust only records
        # these keys verify (the records it uploads are the local, signed, bytes).
        self._keyring = keyring
        self._timeout_s = float(settings.get("timeout_s", 600.0))
        # Each of its calls ends at the deadline, naming the object (store.call_with_deadline):
        # the storage options alone do not bound them (s3fs retries on top of botocore's
        # timeouts), and a remote commit or retention hung here would hold every later
        # upload and keep their steps from local retention.
        self._store = open_store(
            self.url, settings.get("storage_options"), call_timeout_s=self._timeout_s
        )
        self._root = root
        self._keep = settings.get("keep")
        self._threads = int(settings.get("threads", 4))
        self._ledger = UploadLedger(int(settings.get("every", 1)))
        self._ranks = {
            (role, rank)
            for role, size in participants.items()
            if role != DRIVER_ROLE
            for rank in range(size)
        }
        self._local_status = local_status
        # Local retention after a commit left the steps being uploaded: the finalizer finishes
        # it once one ended.
        self._on_upload_end = on_upload_end
        self._changes = changes if changes is not None else Changes()
        # One remote commit at a time: two would race on the remote tracker and listing.
        self._work = asyncio.Lock()
        self._tasks = TaskSet()
        self._tracker: int | None = None
        self._uploaders: dict[int, dict[str, str]] = {}
        # Steps being uploaded whose remote step holds no other save's record any more: only
        # then are ranks told to upload (upload_turn).
        self._cleared: set[int] = set()
        # A remote commit interrupted between record and tracker is rolled forward; a store
        # that does not answer now does not stop the local tier (start-up checked it).
        try:
            # Left running past this deadline, it may still write the tracker: the store
            # sends no other tracker call before it ended (I2).
            self._tracker = call_with_deadline(
                lambda: roll_tracker_forward(
                    self._store, replace_unreadable=True, keyring=self._keyring
                ),
                min(60.0, self._timeout_s),
                self.url,
                left_running=lambda thread: self._store.hold_back(TRACKER_FILENAME, thread),
            )
        except Exception as exc:  # noqa: BLE001 - logged; the next remote commit retries
            logger.error("remote tier %s: recovery failed: %s", self.url, describe_store_error(exc))

    # ---- hooks called by the finalizer ---------------------------------------------------

    def after_local_commit(self, step: int) -> None:
        """Step 8 starts: decide whether `step` (committed locally) goes to the remote tier."""
        if self._ledger.decide(step, self._ranks) is UploadStatus.UPLOADING:
            self._tasks.spawn(self._commit(step))
        self._changes.notify()

    def protected(self) -> list[int]:
        """Steps being uploaded: local retention must not delete them yet."""
        return self._ledger.in_flight()

    # ---- actor methods -------------------------------------------------------------------

    async def upload_turn(self, step: int, timeout_s: float) -> bool:
        """Whether a rank uploads its files of `step`: waits until the step committed
        locally (a report-based wait, no collective: I6). False when the step is skipped
        (`every`), its local commit failed, or the remote commit no longer waits for ranks."""
        deadline = deadline_in(timeout_s)
        while (decided := self._ledger.status(step)) is None or (
            decided is UploadStatus.UPLOADING and step not in self._cleared
        ):
            if decided is None:
                local = self._local_status(step)
                if local in (StepStatus.FAILED, StepStatus.LOST):
                    return False
                # Unknown to both ledgers yet committed: committed before this finalizer
                # started (it restarted). Nobody decides it now; the end of the run or a newer
                # step catches up. (A step committing now is known to the local ledger until
                # after its decision.)
                step_path = step_dir(self._root, step)
                if local is None and await asyncio.to_thread(is_committed, step_path):
                    return False
            remaining = time_left(deadline)
            if remaining <= 0:
                what = (
                    f"did not commit locally within {timeout_s:g}s"
                    if decided is None
                    else f"could not be checked in the remote tier within {timeout_s:g}s"
                )
                raise CommitTimeoutError(f"step {step} {what}: nothing to upload to {self.url}")
            await self._changes.wait(remaining)
        return decided is UploadStatus.UPLOADING

    async def report(self, report: UploadReport) -> None:
        """Step 8 ends for one rank: what it uploaded and verified."""
        if report.errors:
            logger.warning(
                "%s rank %d could not upload %d files of step %d to %s (the finalizer uploads "
                "them): %s",
                report.role,
                report.rank,
                len(report.errors),
                report.step,
                self.url,
                report.errors[0],
            )
        if self._ledger.record(report):
            self._uploaders.setdefault(report.step, {})[f"{report.role} rank {report.rank}"] = (
                report.node
            )
            self._changes.notify()

    async def drain(self, timeout_s: float) -> dict[str, Any]:
        """Make sure the newest locally committed step reaches the remote tier (upload it
        whole if it was skipped, failed, or never tried: a catch-up), wait for every upload
        under way, and say where the remote tier stands."""
        steps = await asyncio.to_thread(committed_steps, self._root, self._keyring)
        newest = steps[-1] if steps else None
        if newest is not None and await self._needs_whole_upload(newest):
            self._ledger.upload_whole(newest)
            self._tasks.spawn(self._commit(newest))
        elif newest is not None and self._ledger.status(newest) is None:
            self._ledger.found_committed(newest)  # what the remote record says (no upload)
        # The tasks, not just the ledger: a task ends after its remote retention, which a
        # job that stops right after this must not cut short.
        if not await self._tasks.ended(timeout_s):
            raise CommitTimeoutError(
                f"uploads of steps {self._ledger.in_flight()} to {self.url} not finished "
                f"within {timeout_s:g}s"
            )
        return self.status(newest)

    def status(self, step: int | None = None) -> dict[str, Any]:
        entry = self._ledger.entry(step) if step is not None else None
        return {
            "url": self.url,
            "tracker": self._tracker,
            "step": step,
            "status": entry.status.value if entry is not None else None,
            "error": entry.error if entry is not None else None,
            "in_flight": self._ledger.in_flight(),
            "uploaders": dict(self._uploaders.get(step, {})) if step is not None else {},
        }

    # ---- steps 9-11 ----------------------------------------------------------------------

    def _local_record(self, step: int) -> bytes:
        """The local commit record's bytes, read bounded and from a regular file only."""
        data = read_record_bytes(self._root, step)
        if data is None:
            raise FileNotFoundError(f"{step_dir(self._root, step)} holds no commit record")
        return data

    async def _commit(self, step: int) -> None:
        try:
            if await self._withdraw_other_record(step):
                await self._commit_step(step)
        finally:
            self._cleared.discard(step)
            self._on_upload_end()

    async def _withdraw_other_record(self, step: int) -> bool:
        """Before any rank is told to upload `step`: a remote step `step` holding another
        save's commit record (left by a rollback or a resume fallback) loses that record
        first, so that objects written under it never sit under a record that is not
        theirs (tier.withdraw_other_remote_record). False (the upload failed) when the
        store could not be asked."""

        def withdraw() -> bool:
            return withdraw_other_remote_record(self._store, step, self._local_record(step))

        # Left running past this deadline, it may still remove the step's record: the store
        # sends no other call on the record (the upload's own) before it ended.
        record_rel = self._store.step_rel(step, COMMIT_RECORD_FILENAME)
        try:
            await asyncio.to_thread(
                call_with_deadline,
                withdraw,
                min(60.0, self._timeout_s),
                self.url,
                lambda thread: self._store.hold_back(record_rel, thread),
            )
        except Exception as exc:  # noqa: BLE001 - the remote tier never fails the local one
            error = describe_store_error(exc)
            logger.error(
                "step %d is not uploaded to the remote tier %s (the next upload catches up): "
                "its remote commit record could not be checked: %s",
                step,
                self.url,
                error,
            )
            self._ledger.begin_commit(step)
            self._ledger.finish_commit(step, error)
            self._changes.notify()
            return False
        self._cleared.add(step)
        self._changes.notify()
        return True

    async def _commit_step(self, step: int) -> None:
        await self._wait_for_upload_reports(step)
        async with self._work:
            if not await self._commit_remotely(step):
                return
            # Retention after the remote tracker moved, never before (as the local tier's
            # step 7 after 6): a failure here never un-commits the step just committed.
            try:
                outcome = await asyncio.to_thread(
                    apply_retention,
                    self._store,
                    self._keep,
                    self._ledger.in_flight(),
                    keyring=self._keyring,
                )
                errors = outcome.errors
            except Exception as exc:  # noqa: BLE001 - retention never un-commits a step
                errors = [describe_store_error(exc)]
        if errors:
            logger.error(
                "remote retention after step %d failed (retried after the next remote commit): %s",
                step,
                "; ".join(errors),
            )

    async def _wait_for_upload_reports(self, step: int) -> None:
        """The ranks' upload reports, up to the deadline; what a missing rank did not
        confirm is uploaded by the finalizer, so a dead rank delays the remote tier but never
        blocks it."""
        deadline = deadline_in(self._timeout_s)
        while not self._ledger.all_reported(step) and time.monotonic() < deadline:
            await self._changes.wait(time_left(deadline))
        missing = self._ledger.missing(step)
        if missing:
            logger.warning(
                "step %d: no upload report from %s; the finalizer uploads their files",
                step,
                participants_text(missing, ()),
            )

    async def _commit_remotely(self, step: int) -> bool:
        """Steps 9 and 10 (commit_remote_step), under the remote work lock; whether the step
        committed with a durable tracker (only then does remote retention run). A failure is
        logged: the remote tier never fails the local one."""
        self._ledger.begin_commit(step)
        self._changes.notify()
        confirmed = self._ledger.confirmed_paths(step)
        try:
            summary = await asyncio.to_thread(
                commit_remote_step,
                self._store,
                self._root,
                step,
                confirmed,
                self._threads,
                self._timeout_s,
            )
        except Exception as exc:  # noqa: BLE001 - the remote tier never fails the local one
            error = describe_store_error(exc)
            logger.error(
                "step %d is not committed in the remote tier %s (the next upload catches up): %s",
                step,
                self.url,
                error,
            )
            self._ledger.finish_commit(step, error)
            self._changes.notify()
            return False
        self._ledger.finish_commit(step)
        if summary.tracker is not None:  # None: the tracker could not be read (logged)
            self._tracker = summary.tracker
        logger.info(
            "step %d committed in the remote tier %s: %d files, %d bytes (%d uploaded by the "
            "finalizer); remote tracker names step %s",
            step,
            self.url,
            summary.files,
            summary.bytes,
            summary.uploaded_here,
            summary.tracker,
        )
        self._changes.notify()
        if not summary.durable:
            logger.error(
                "remote retention after step %d not run: the remote tracker's move was not made "
                "durable, so no older remote step is deleted until a commit is",
                step,
            )
        return summary.durable

    async def _needs_whole_upload(self, step: int) -> bool:
        status = self._ledger.status(step)
        if status in (UploadStatus.UPLOADING, UploadStatus.COMMITTING, UploadStatus.COMMITTED):
            return False
        if status is None:
            # Not there, or another save's record (or an unreadable one): upload it again.
            rel = self._store.step_rel(step, COMMIT_RECORD_FILENAME)
            try:
                local, remote = await asyncio.to_thread(
                    lambda: (
                        self._local_record(step),
                        self._store.read_bytes(rel, COMMIT_RECORD_MAX_BYTES),
                    )
                )
            except Exception:  # noqa: BLE001 - unreadable: upload it again
                return True
            return remote != local
        return True
