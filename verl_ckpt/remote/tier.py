"""Protocol steps 9 (remote commit record), 10 (remote tracker) and 11 (remote retention), and
the remote tier's recovery, as plain functions on a `RemoteStore`: no Ray, no bookkeeping.
The finalizer calls them in this order, one step at a time (protocol.py).

The remote tier keeps invariant I1 the way the local one does: the commit record is uploaded
only after every file it names is there with its size, the tracker object only after the
record, and retention removes a step's record before its files. A step without a record is
never taken as committed, whatever else of it was uploaded.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from verl_ckpt.protocol.errors import CheckpointError, CommitRecordError, TrackerError
from verl_ckpt.remote.transfer import upload_files
from verl_ckpt.store.commit_record import CommitRecord, parse_commit_record
from verl_ckpt.store.fsspec_store import RemoteListing, RemoteStore
from verl_ckpt.store.layout import COMMIT_RECORD_FILENAME, TRACKER_FILENAME, step_dir
from verl_ckpt.store.retention import steps_to_delete
from verl_ckpt.store.tracker import parse_tracker

__all__ = [
    "RemoteCommitSummary",
    "RemoteHead",
    "RemoteRetention",
    "RemoteRollback",
    "advance_remote_tracker",
    "apply_remote_retention",
    "commit_remote_step",
    "delete_remote_step",
    "newest_remote_step",
    "plan_remote_rollback",
    "read_remote_head",
    "read_remote_record",
    "read_remote_tracker",
    "readable_remote_steps",
    "recover_remote",
    "roll_back_remote",
    "withdraw_other_remote_record",
]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RemoteCommitSummary:
    step: int
    files: int
    bytes: int
    # Files the finalizer uploaded itself (those no rank confirmed: its own, or a rank's
    # whose upload failed or never came).
    uploaded_here: int
    tracker: int | None


def _record_rel(step: int) -> str:
    return f"{step_dir('', step).name}/{COMMIT_RECORD_FILENAME}"


def read_remote_record(store: RemoteStore, step: int) -> CommitRecord | None:
    """The commit record of remote step `step`, or None when it has none (not committed)."""
    rel = _record_rel(step)
    data = store.read_bytes(rel)
    return None if data is None else parse_commit_record(data, store.uri(rel))


def read_remote_tracker(store: RemoteStore) -> int | None:
    data = store.tracker_bytes()
    return None if data is None else parse_tracker(data, store.uri(TRACKER_FILENAME))


def newest_remote_step(store: RemoteStore) -> int | None:
    """The newest remote step with a readable commit record: what a resume would load."""
    newest = _newest_readable(store, store.listing().committed())
    return None if newest is None else newest[0]


def _newest_readable(store: RemoteStore, committed: list[int]) -> tuple[int, bytes] | None:
    """The newest of `committed` whose record reads, with the record's bytes."""
    for step in reversed(committed):
        data = store.read_bytes(_record_rel(step))
        if data is None:
            continue  # deleted since the listing
        try:
            parse_commit_record(data, store.uri(_record_rel(step)))
        except CommitRecordError as exc:
            logger.warning("skipping remote step %d: %s", step, exc)
            continue
        return step, data
    return None


@dataclass(frozen=True)
class RemoteHead:
    """Where the remote tier stands for a start: what a resume from it would load."""

    # The newest step with a readable commit record (None: none), and that record's bytes.
    step: int | None
    record: bytes | None
    # Every step with a commit record object, readable or not, oldest first.
    committed: tuple[int, ...]
    # The remote tracker's step (None: none, or unreadable: the finalizer replaces it), and
    # why it cannot be resumed from when it is newer than `step` (its record is missing or
    # does not read); None when it can.
    tracker: int | None = None
    tracker_problem: str | None = None


def read_remote_head(store: RemoteStore) -> RemoteHead:
    """The newest remote step a resume would load, and whether the remote tracker names a
    newer step that cannot be loaded (start-up refuses to skip it silently)."""
    committed = store.listing().committed()
    newest = _newest_readable(store, committed)
    step, record = newest if newest is not None else (None, None)
    try:
        tracker = read_remote_tracker(store)
    except TrackerError as exc:
        # The finalizer replaces it at its start; the records say what is committed.
        logger.warning("unreadable remote tracker (replaced by the next run): %s", exc)
        tracker = None
    problem = None
    if tracker is not None and (step is None or tracker > step):
        problem = _record_problem(store, tracker)
    return RemoteHead(step, record, tuple(committed), tracker, problem)


def _record_problem(store: RemoteStore, step: int) -> str | None:
    """Why remote step `step` cannot be resumed from (its record is missing or does not
    read), in words naming the object; None when its record reads."""
    where = store.uri(_record_rel(step))
    data = store.read_bytes(_record_rel(step))
    if data is None:
        return (
            f"its commit record {where} is missing (an interrupted `verl-ckpt rollback "
            f"{store.url} --to N --delete`, or an upload of another save of step {step} under "
            "way or interrupted)"
        )
    try:
        parse_commit_record(data, where)
    except CommitRecordError as exc:
        return str(exc)
    return None  # committed since the listing: the next start sees it


def readable_remote_steps(store: RemoteStore, committed: Iterable[int]) -> list[int]:
    """The steps of `committed` (record objects present) whose record reads, oldest first;
    as the local tier's committed_steps, a record that does not read does not count."""
    readable = []
    for step in sorted(committed):
        try:
            if read_remote_record(store, step) is not None:
                readable.append(step)
        except CommitRecordError as exc:
            logger.warning("remote step %d is not counted as committed: %s", step, exc)
    return readable


def commit_remote_step(
    store: RemoteStore,
    root: Path,
    step: int,
    confirmed: Iterable[str],
    threads: int,
    timeout_s: float,
) -> RemoteCommitSummary:
    """Steps 9 and 10 for the locally committed `step`: upload every file of its record that
    no rank `confirmed` (sent and verified against the record), check that every file is
    there with its size, upload the record, then move the remote tracker."""
    local = step_dir(root, step)
    record_bytes = (local / COMMIT_RECORD_FILENAME).read_bytes()
    record = parse_commit_record(record_bytes, local / COMMIT_RECORD_FILENAME)
    # Before any object is written under the step (the finalizer's RemoteTier did it before
    # the ranks' uploads already; again here, for any other caller).
    withdraw_other_remote_record(store, step, record_bytes)
    confirmed = set(confirmed)
    present = store.listing().steps.get(step, {})
    # A file a rank confirmed is trusted (it hashed what it sent); anything else is sent
    # again, even if an object of the right size is there: an earlier, interrupted upload
    # may have left other bytes.
    missing = [e for e in record.files if e.path not in confirmed or present.get(e.path) != e.size]
    outcome = upload_files(
        store, local, step, missing, record.checksum_algorithm, threads, timeout_s
    )
    if outcome.errors:
        raise CheckpointError(
            f"upload of step {step} to {store.url} failed: " + "; ".join(outcome.errors[:3])
        )
    # One more listing before the record: the record must never name an absent object (I1).
    present = store.listing().steps.get(step, {})
    absent = [e.path for e in record.files if present.get(e.path) != e.size]
    if absent:
        raise CheckpointError(
            f"step {step} under {store.url}: {len(absent)} files missing or of the wrong size "
            f"after the upload (e.g. {absent[0]}); its commit record is not uploaded"
        )
    # THE REMOTE COMMIT POINT: from here the remote step is committed.
    store.put_bytes(f"{local.name}/{COMMIT_RECORD_FILENAME}", record_bytes)
    # The tracker goes after the record: the other order could name a step that a failure
    # leaves without one.
    tracker = advance_remote_tracker(store, step)
    return RemoteCommitSummary(
        step, len(record.files), sum(e.size for e in record.files), len(missing), tracker
    )


def withdraw_other_remote_record(store: RemoteStore, step: int, record_bytes: bytes) -> bool:
    """Remove the remote commit record of `step` when it is not `record_bytes` (the local
    record of the step about to be uploaded): the remote step is another save of it (one a
    rollback or a resume fallback left behind). Its record goes first, as in retention,
    before any object is written under the step: an upload that fails half-way then leaves
    an uncommitted remote step, never a committed one whose objects are mixed. Its objects
    are replaced by the upload (or removed by retention). Returns whether it removed one."""
    rel = _record_rel(step)
    remote = store.read_bytes(rel)
    if remote is None or remote == record_bytes:
        return False
    logger.warning(
        "%s is the commit record of another save of step %d than the local one: removed "
        "before the upload, remote step %d is not committed until the upload commits it",
        store.uri(rel),
        step,
        step,
    )
    store.remove(rel)
    return True


def advance_remote_tracker(store: RemoteStore, step: int) -> int | None:
    """Point the remote tracker at `step` (one PUT) unless it names a newer step: it never
    moves backwards. Returns what it names afterwards."""
    try:
        current = read_remote_tracker(store)
    except TrackerError as exc:
        logger.warning("unreadable remote tracker (replaced now): %s", exc)
        current = None
    if current is not None and current >= step:
        return current
    store.put_bytes(TRACKER_FILENAME, f"{step}\n".encode("ascii"))
    return step


def recover_remote(store: RemoteStore) -> int | None:
    """Roll the remote tracker forward to the newest remote step with a record (a remote
    commit interrupted between record and tracker). Deletes nothing. Returns the tracker."""
    newest = newest_remote_step(store)
    if newest is None:
        return read_remote_tracker(store)
    return advance_remote_tracker(store, newest)


@dataclass
class RemoteRetention:
    deleted: list[int] = field(default_factory=list)
    # Uncommitted leftovers older than the newest committed step (interrupted uploads).
    purged: list[int] = field(default_factory=list)
    # Steps whose record does not read: neither counted toward keep nor deleted.
    unreadable: list[int] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


def apply_remote_retention(
    store: RemoteStore, keep: int | None, protected: Iterable[int] = (), dry_run: bool = False
) -> RemoteRetention:
    """Step 11, after a remote commit only: delete committed steps beyond the newest `keep`
    and the leftovers of interrupted uploads older than the newest committed step. Never the
    remote tracker's target nor a `protected` step (an upload in flight). Only steps whose
    record reads are committed here, as in the local tier: a step whose record does not read
    (corrupt, a newer format_version) neither counts toward `keep` nor is deleted. Failures
    are collected, not raised: the next remote commit retries."""
    outcome = RemoteRetention()
    listing = store.listing()
    committed = readable_remote_steps(store, listing.committed())
    outcome.unreadable = sorted(set(listing.committed()) - set(committed))
    protected = set(protected) | set(outcome.unreadable)
    try:
        tracker = read_remote_tracker(store)
    except TrackerError:
        tracker = None
    if tracker is not None:
        protected.add(tracker)
    newest = committed[-1] if committed else None
    leftovers = [
        s for s in listing.uncommitted() if newest is not None and s < newest and s not in protected
    ]
    doomed = [(step, outcome.deleted) for step in steps_to_delete(committed, keep, protected)]
    doomed += [(step, outcome.purged) for step in leftovers]
    for step, done in doomed:
        try:
            if not dry_run:
                delete_remote_step(store, step)
            done.append(step)
        except Exception as exc:  # noqa: BLE001 - retried after the next remote commit
            outcome.errors.append(f"{store.uri(step_dir('', step).name)}: {exc}")
    return outcome


def delete_remote_step(store: RemoteStore, step: int) -> None:
    """Delete a remote step: its commit record first, so that a failure halfway never leaves
    a committed-looking step with files missing (I3)."""
    name = step_dir("", step).name
    store.remove(f"{name}/{COMMIT_RECORD_FILENAME}")
    store.remove_tree(name)


@dataclass(frozen=True)
class RemoteRollback:
    """What `verl-ckpt rollback URL --to N --delete` does to a remote tier."""

    to: int
    # Committed steps newer than `to`, and newer steps without a record (unfinished
    # uploads); newest first, the order they are deleted in.
    steps: tuple[int, ...]
    leftovers: tuple[int, ...]


def plan_remote_rollback(listing: RemoteListing, to: int) -> RemoteRollback:
    """Every remote step newer than `to` (the caller checked that `to` is committed)."""
    committed = set(listing.committed())
    newer = sorted((s for s in listing.steps if s > to), reverse=True)
    return RemoteRollback(
        to,
        tuple(s for s in newer if s in committed),
        tuple(s for s in newer if s not in committed),
    )


def roll_back_remote(store: RemoteStore, plan: RemoteRollback) -> None:
    """Delete every step of `plan`, newest first, each record first then its objects (as
    retention does: a half-deleted step never looks committed), then point the remote
    tracker at `plan.to` (one PUT): the one time it moves back, because a user asked.

    The tracker last: moved first, it would be rolled forward again (recover_remote, at
    every finalizer start) to a newer step still there. A crash half-way leaves the tracker
    naming a step without a record; start-up then refuses, naming it, and the same command
    run again completes the rollback."""
    for step in plan.steps + plan.leftovers:
        delete_remote_step(store, step)
    store.put_bytes(TRACKER_FILENAME, f"{plan.to}\n".encode("ascii"))
