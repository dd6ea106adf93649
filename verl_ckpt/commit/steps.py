"""Protocol step 5 (commit record) on a checkpoint root: complete each role's directory,
write the record, move the tracker (step 6, store/tracker.py); and the deletion of failed
steps. No Ray, no bookkeeping, so each is tested on a temporary directory. The finalizer
actor calls them, then retention (step 7, store/retention.py), one step at a time
(the protocol page, verl_ckpt/protocol).
"""

from __future__ import annotations

import logging
import os
import stat
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from verl_ckpt.protocol import Phase, faults
from verl_ckpt.protocol.errors import CheckpointError
from verl_ckpt.protocol.messages import RankReport
from verl_ckpt.store.commit_record import (
    CommitRecord,
    FileEntry,
    read_commit_record,
    sign_record,
    write_commit_record,
)
from verl_ckpt.store.fsio import RenameNotDurable, file_checksum, unlink_beneath
from verl_ckpt.store.layout import (
    COMMIT_RECORD_FILENAME,
    DRIVER_ROLE,
    RUN_MARKER_FILENAME,
    step_dir,
    step_name,
)
from verl_ckpt.store.local import LocalStore
from verl_ckpt.store.retention import delete_step
from verl_ckpt.store.signing import Keyring
from verl_ckpt.store.tracker import (
    CommitPhaseError,
    move_tracker,
    tracker_or_none,
    withdraw_record,
)

__all__ = [
    "CommitSummary",
    "commit_step",
    "discard_failed_steps",
    "reported_files_problem",
    "step_summary",
]

logger = logging.getLogger(__name__)


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
    # The record and the tracker's move were made durable. Where a directory fsync failed,
    # a power loss may bring back the step before, which retention must then not delete.
    durable: bool = True


def commit_step(
    root: Path,
    step: int,
    participants: dict[str, int],
    reports: Iterable[RankReport],
    metadata_files: dict[str, bytes | None] | None = None,
    keyring: Keyring | None = None,
    state_participants: dict[str, int] | None = None,
) -> CommitSummary:
    """Steps 5 and 6: complete every role's directory, write the commit record, move the
    tracker. Raises CommitPhaseError when the step did not commit; once the record is
    durable it stays committed, whatever the tracker does. `metadata_files`: a role's
    `.metadata` made beforehand from exactly these reports (metadata_forecast), if any.
    `keyring`: checkpoint.signing's keys; the record is signed by its first.
    `state_participants` (declared participants, no `.metadata`): only their reported
    files, listed in the record."""
    store = LocalStore(root)
    path = step_dir(root, step)
    reports = list(reports)
    try:
        files = _reported_files(path, reports)
        # Each role's torch_dist directory is completed before the commit record exists: a
        # record naming an incomplete directory would make the step committed but unloadable.
        for role in sorted(participants):
            if role != DRIVER_ROLE:
                made = (metadata_files or {}).get(role)
                files.extend(_complete_role(root, path, role, step, reports, made))
        # A declared participant's files have no .metadata whose write syncs their
        # directory: synced here, or a crash after the commit could keep the record and
        # lose the directory entry of a file it names.
        for name in sorted(state_participants or {}):
            store.make_durable(f"{step_name(step)}/{name}")
        store.make_durable(step_name(step))
        faults.inject(Phase.COMMIT)
        record = CommitRecord(
            step=step,
            participants=dict(participants),
            files=files,
            state_participants=dict(state_participants or {}),
        )
        record_durable = _write_record(store, sign_record(record, keyring))
    except Exception as exc:
        raise CommitPhaseError(Phase.COMMIT, exc) from exc
    record_at = time.time()
    # The finalizer's mark of the job that opened the step goes only now that the record is
    # durable: a restart takes a marked step without a record for one of this job's that was
    # lost with the old instance (admission.steps_lost_in_a_restart); unmarked before the
    # record, a crash in between left it an earlier job's leftover, its waiters told nothing
    # until their deadline. Not synced: a committed step is never lost, marked or not. Kept
    # with a record that is not durable: a power loss could take the record and not this.
    if record_durable:
        _drop_run_marker(root, step)
    # The tracker moves only after the record is durable (I1): the other order would name
    # a step that a crash could leave uncommitted.
    tracker, tracker_durable = move_tracker(store, step)
    logger.info("committed step %d under %s", step, root)
    size = sum(f.size for f in files)
    return CommitSummary(
        step,
        len(files),
        size,
        tracker,
        record_at=record_at,
        tracker_at=time.time(),
        durable=record_durable and tracker_durable,
    )


def _drop_run_marker(root: Path, step: int) -> None:
    """Remove a committed step's run marker: it then holds exactly the files its record
    names (and the record). A failure is logged, never raised: the step is committed."""
    try:
        unlink_beneath(root, f"{step_name(step)}/{RUN_MARKER_FILENAME}")
    except OSError as exc:
        logger.warning("step %d committed, but its run marker stays: %s", step, exc)


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
            delete_step(root, step)
        except OSError as exc:
            errors.append(f"{exc.filename or path}: {exc.strerror or exc}")
    return errors


def step_summary(root: Path, step: int) -> CommitSummary:
    """The summary of a step already committed, read back from its record."""
    record = read_commit_record(step_dir(root, step))
    size = sum(f.size for f in record.files)
    return CommitSummary(step, len(record.files), size, tracker_or_none(root))


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


def reported_files_problem(path: Path | str, report: RankReport) -> str:
    """What is wrong on disk with the files `report` names under the step directory `path`
    (the first missing file or file of another size), or "" when nothing."""
    # Plain strings: thousands of ranks' files are checked per step. Joined with "/", not
    # os.path.join, which would also follow a reported absolute path out of the step.
    base = f"{path}/"
    for entry in report.files:
        actual = base + entry.path
        try:
            # lstat, as verification checks a step: a link is not the rank's file (it could
            # name anything, of any size), and a step committed with one could not be resumed.
            info = os.lstat(actual)
            size: int | str | None = (
                info.st_size if stat.S_ISREG(info.st_mode) else "not a regular file"
            )
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
    root: Path,
    path: Path,
    role: str,
    step: int,
    reports: list[RankReport],
    metadata_file: bytes | None,
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
    complete_role_dir(directory, metadata_file, beneath=root)
    entries = []
    for name in METADATA_FILENAMES:
        size, checksum = file_checksum(directory / name)
        entries.append(FileEntry(f"{role}/{name}", size, checksum))
    return entries


def _write_record(store: LocalStore, record: CommitRecord) -> bool:
    """Step 5's record; whether it is durable. Renamed into place but not made durable (the
    directory's fsync failed), readers already see the step committed: it is withdrawn, so
    that disk and the reported failure agree; where even that fails, the step stays
    committed (a restart would find it so), the commit goes on, and this returns False."""
    try:
        write_commit_record(store, record)
    except RenameNotDurable as exc:
        if withdraw_record(store, record.step):
            raise
        logger.error(
            "the commit record of %s is in place but not durable (%s), and could not be "
            "withdrawn: the step stays committed",
            store.uri(step_name(record.step)),
            exc,
        )
        return False
    return True
