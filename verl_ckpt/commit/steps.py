"""Protocol steps 5 (commit record), 6 (tracker) and 7 (retention) as plain functions on a
checkpoint root: no Ray, no bookkeeping, so each is tested on a temporary directory. The
finalizer actor calls them in this order, one step at a time (protocol.py).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from verl_ckpt.protocol import Phase, faults
from verl_ckpt.protocol.errors import CheckpointError
from verl_ckpt.protocol.messages import RankReport
from verl_ckpt.store.commit_record import (
    CommitRecord,
    FileEntry,
    committed_steps,
    read_commit_record,
    write_commit_record,
)
from verl_ckpt.store.fsio import RenameNotDurable, file_checksum, fsync_dir
from verl_ckpt.store.layout import (
    COMMIT_RECORD_FILENAME,
    DRIVER_ROLE,
    RUN_MARKER_FILENAME,
    step_dir,
)
from verl_ckpt.store.retention import DELETING_PREFIX, delete_step_dir, remove_tree, steps_to_delete
from verl_ckpt.store.tracker import read_tracker, write_tracker

__all__ = [
    "CommitPhaseError",
    "CommitSummary",
    "RetentionOutcome",
    "advance_tracker",
    "apply_retention",
    "commit_step",
    "discard_failed_steps",
    "reported_files_problem",
    "step_summary",
]

logger = logging.getLogger(__name__)


class CommitPhaseError(CheckpointError):
    """The commit of a step failed in `phase` (commit record or tracker); not committed."""

    def __init__(self, phase: Phase, cause: BaseException) -> None:
        super().__init__(f"{type(cause).__name__}: {cause}")
        self.phase = phase
        self.errno = cause.errno if isinstance(cause, OSError) else None


@dataclass(frozen=True)
class CommitSummary:
    step: int
    files: int
    bytes: int
    # What the tracker names once the commit returned (a newer step, if one committed first).
    tracker: int | None
    # Wall-clock times (time.time()) for the time-to-durable breakdown: the last report
    # arrived (set by the finalizer), the commit record was durable, the tracker moved.
    ready_at: float = 0.0
    record_at: float = 0.0
    tracker_at: float = 0.0


def commit_step(
    root: Path,
    step: int,
    participants: dict[str, int],
    reports: Iterable[RankReport],
    metadata_files: dict[str, bytes | None] | None = None,
) -> CommitSummary:
    """Steps 5 and 6: complete every role's directory, write the commit record, move the
    tracker. Raises CommitPhaseError when the step did not commit; once the record is
    durable it stays committed, whatever the tracker does. `metadata_files`: a role's
    `.metadata` made beforehand from exactly these reports (metadata_forecast), if any."""
    path = step_dir(root, step)
    reports = list(reports)
    try:
        files = _reported_files(path, reports)
        # Each role's torch_dist directory is completed before the commit record exists: a
        # record naming an incomplete directory would make the step committed but unloadable.
        for role in sorted(participants):
            if role != DRIVER_ROLE:
                made = (metadata_files or {}).get(role)
                files.extend(_complete_role(path, role, step, reports, made))
        # The finalizer's mark of the job that opened the step goes: a committed step holds
        # exactly the files its record names (and the record).
        (path / RUN_MARKER_FILENAME).unlink(missing_ok=True)
        fsync_dir(path)
        faults.inject(Phase.COMMIT)
        record = CommitRecord(step=step, participants=dict(participants), files=files)
        _write_record(path, record)
    except Exception as exc:
        raise CommitPhaseError(Phase.COMMIT, exc) from exc
    record_at = time.time()
    # The tracker moves only after the record is durable (I1): the other order would name
    # a step that a crash could leave uncommitted.
    tracker = advance_tracker(root, step)
    logger.info("committed step %d under %s", step, root)
    size = sum(f.size for f in files)
    return CommitSummary(
        step, len(files), size, tracker, record_at=record_at, tracker_at=time.time()
    )


def advance_tracker(root: Path, step: int) -> int | None:
    """Step 6: point the tracker at the committed `step` unless it names a newer one (it
    never moves backwards: a late commit of an older step leaves it). Returns what the
    tracker names afterwards.

    A failure before the tracker's rename withdraws the commit record, so that disk and the
    reported failure agree (unlinking needs no free space). After the rename nothing
    un-commits the step: a failed directory fsync there is only logged.
    """
    current = _tracker_or_none(root)
    if current is not None and current >= step:
        return current
    try:
        write_tracker(root, step)
    except RenameNotDurable as exc:
        logger.warning("tracker of %s moved to step %d, but not made durable: %s", root, step, exc)
    except Exception as exc:
        if _withdraw_record(step_dir(root, step)):
            raise CommitPhaseError(Phase.TRACKER, exc) from exc
        logger.error(
            "the tracker of %s could not move to step %d (%s), and its commit record could not "
            "be withdrawn: the step stays committed and the tracker is rolled forward to it at "
            "the next start",
            root,
            step,
            exc,
        )
        return current
    return step


@dataclass
class RetentionOutcome:
    deleted: list[int] = field(default_factory=list)
    # Half-deleted leftovers (`.deleting_*`) of an earlier failed or interrupted retention.
    purged: list[str] = field(default_factory=list)
    # Committed steps beyond `keep` that stayed only because they were protected.
    spared: list[int] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


def apply_retention(
    root: Path, keep: int | None, protected: Iterable[int] = ()
) -> RetentionOutcome:
    """Step 7, after a commit only: finish earlier half-done deletions, then delete committed
    steps beyond the newest `keep`. Never the tracker's target nor a `protected` step (in
    flight). Failures are collected, not raised: retention failing never un-commits the step
    that triggered it, and the next commit retries."""
    outcome = RetentionOutcome()
    for leftover in sorted(root.glob(f"{DELETING_PREFIX}*")):
        try:
            remove_tree(leftover)
            outcome.purged.append(leftover.name)
        except OSError as exc:
            outcome.errors.append(f"{leftover}: {exc.strerror or exc}")
    protected = set(protected)
    tracker = _tracker_or_none(root)
    if tracker is not None:
        protected.add(tracker)
    committed = committed_steps(root)
    outcome.spared = [s for s in steps_to_delete(committed, keep) if s in protected]
    for step in steps_to_delete(committed, keep, protected):
        path = step_dir(root, step)
        try:
            logger.info("retention: deleting committed step %d (%s)", step, path)
            delete_step_dir(path)
            outcome.deleted.append(step)
        except Exception as exc:  # noqa: BLE001 - any failure is retried after the next commit
            detail = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
            where = exc.filename if isinstance(exc, OSError) and exc.filename else path
            outcome.errors.append(f"{where}: {detail}")
    return outcome


def discard_failed_steps(root: Path, steps: Iterable[int]) -> list[str]:
    """Delete the directories of steps that failed, once nobody writes into them (the
    ledger's `discardable`): their files can never be loaded, and a disk that filled up
    needs their space back before the next step can commit. Deleted as retention deletes
    (out of the step namespace first). A directory holding a commit record is left alone
    whatever the ledger says (a commit whose record could not be withdrawn is committed,
    and the next start rolls the tracker forward to it). Errors are returned, not raised:
    a leftover is removed anyway before its step number is saved again."""
    errors = []
    for step in steps:
        path = step_dir(root, step)
        if not path.is_dir() or (path / COMMIT_RECORD_FILENAME).exists():
            continue
        try:
            logger.info("deleting the directory of failed step %d (%s)", step, path)
            delete_step_dir(path)
        except OSError as exc:
            errors.append(f"{exc.filename or path}: {exc.strerror or exc}")
    return errors


def step_summary(root: Path, step: int) -> CommitSummary:
    """The summary of a step already committed, read back from its record."""
    record = read_commit_record(step_dir(root, step))
    size = sum(f.size for f in record.files)
    return CommitSummary(step, len(record.files), size, _tracker_or_none(root))


# ---- helpers -------------------------------------------------------------------------------


def _reported_files(path: Path, reports: list[RankReport]) -> list[FileEntry]:
    """Every reported file, checked to exist with the reported size: when its report
    arrived (the finalizer's intake, `RankReport.files_on_arrival`), or here."""
    files = []
    for report in reports:
        problem = report.files_on_arrival
        if problem is None:
            problem = reported_files_problem(path, report)
        if problem:
            raise CheckpointError(problem)
        files.extend(report.files)
    return files


def reported_files_problem(path: Path, report: RankReport) -> str:
    """What is wrong on disk with the files `report` names under the step directory `path`
    (the first missing file or file of another size), or "" when nothing."""
    base = str(path)  # plain strings: thousands of ranks' files are checked per step
    for entry in report.files:
        actual = os.path.join(base, entry.path)
        try:
            size: int | None = os.stat(actual).st_size
        except (FileNotFoundError, NotADirectoryError):
            size = None
        if size != entry.size:
            found = size if size is not None else "no file"
            return (
                f"{actual}: reported by {report.role} rank {report.rank} with "
                f"{entry.size} bytes, found {found}"
            )
    return ""


def _complete_role(
    path: Path, role: str, step: int, reports: list[RankReport], metadata_file: bytes | None
) -> list[FileEntry]:
    # Imported here: it imports torch, which the CLI's commands that read roots do not need.
    from verl_ckpt.format.torch_dist_dir import (
        METADATA_FILENAMES,
        complete_role_dir,
        metadata_file_bytes,
    )

    mine = sorted((r for r in reports if r.role == role), key=lambda r: r.rank)
    metadata = [r.global_metadata for r in mine if r.global_metadata is not None]
    if len(metadata) != 1:
        raise CheckpointError(
            f"step {step} role {role}: expected the DCP metadata from exactly one rank (rank 0 "
            f"of the save group), got {len(metadata)}"
        )
    directory = path / role
    if metadata_file is None:  # no forecast of it (metadata_forecast) fits these reports
        results = [r.unpacked_write_results() for r in mine]
        metadata_file = metadata_file_bytes(directory, metadata[0], results)
    complete_role_dir(directory, metadata_file)
    entries = []
    for name in METADATA_FILENAMES:
        size, checksum = file_checksum(directory / name)
        entries.append(FileEntry(f"{role}/{name}", size, checksum))
    return entries


def _write_record(path: Path, record: CommitRecord) -> None:
    """Step 5's record. Renamed into place but not made durable (the directory's fsync
    failed), readers already see the step committed: it is withdrawn, so that disk and the
    reported failure agree; where even that fails, the step stays committed (a restart would
    find it so) and the commit goes on."""
    try:
        write_commit_record(path, record)
    except RenameNotDurable as exc:
        if _withdraw_record(path):
            raise
        logger.error(
            "the commit record of %s is in place but not durable (%s), and could not be "
            "withdrawn: the step stays committed",
            path,
            exc,
        )


def _withdraw_record(path: Path) -> bool:
    """Remove a step's commit record again; True once readers no longer see it, so that the
    step is no commit. Then only a failed directory fsync can be left, logged: a power loss
    might bring the record back, and the next start would roll the tracker forward to it."""
    try:
        (path / COMMIT_RECORD_FILENAME).unlink(missing_ok=True)
    except OSError:
        return False
    try:
        fsync_dir(path)
    except OSError as exc:
        logger.warning("commit record of %s withdrawn, but not made durable: %s", path, exc)
    return True


def _tracker_or_none(root: Path) -> int | None:
    try:
        return read_tracker(root)
    except CheckpointError as exc:
        # Start-up refuses an unreadable tracker; one damaged while a job runs is replaced by
        # the next commit rather than blocking every commit after it.
        logger.warning("unreadable tracker (the next commit replaces it): %s", exc)
        return None
