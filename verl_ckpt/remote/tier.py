"""Protocol steps 9 (remote commit record) and 10 (remote tracker): the local tier's commit
of a step, done again on a second store. No Ray, no bookkeeping. Step 11 (remote retention)
is store/retention.py's apply_retention on that store, the remote tier's recovery
store/recovery.py's roll_tracker_forward, its rollback store/rollback.py's.

The remote tier keeps invariant I1 the way the local one does: the commit record is copied
only after every file it names is there with its size, the tracker only after the record,
and retention removes a step's record before its files. A step without a record is never
taken as committed, whatever else of it was uploaded.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass

from verl_ckpt.protocol.errors import CheckpointError
from verl_ckpt.remote.transfer import copy_files
from verl_ckpt.store.base import Store
from verl_ckpt.store.commit_record import (
    COMMIT_RECORD_MAX_BYTES,
    parse_commit_record,
    read_record_bytes,
)
from verl_ckpt.store.layout import COMMIT_RECORD_FILENAME
from verl_ckpt.store.open_store import Where, as_store
from verl_ckpt.store.tracker import move_tracker

__all__ = ["RemoteCommitSummary", "commit_remote_step", "withdraw_other_remote_record"]

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
    # The tracker's move was made durable (a `file://` tier's directory fsync can fail):
    # remote retention waits for a commit that is, as the local tier's does.
    durable: bool = True


def commit_remote_step(
    store: Store,
    root: Where,
    step: int,
    confirmed: Iterable[str],
    threads: int,
    timeout_s: float,
) -> RemoteCommitSummary:
    """Steps 9 and 10 for `step`, committed in `root` (a local root, or any store): copy
    every file of its record that no rank `confirmed` (sent and verified against the
    record), check that every file is in `store` with its size, copy the record, then move
    the tracker of `store` (move_tracker, as the local commit does)."""
    source = as_store(root)
    record_rel = source.step_rel(step, COMMIT_RECORD_FILENAME)
    record_bytes = read_record_bytes(source, step)
    if record_bytes is None:
        raise CheckpointError(f"{source.uri(record_rel)}: step {step} is not committed there")
    record = parse_commit_record(record_bytes, source.uri(record_rel))
    # Before any object is written under the step (the finalizer's RemoteTier did it before
    # the ranks' uploads already; again here, for any other caller).
    withdraw_other_remote_record(store, step, record_bytes)
    confirmed = set(confirmed)
    present = store.list_files(store.step_rel(step))
    # A file a rank confirmed is trusted (it hashed what it sent); anything else is sent
    # again, even if an object of the right size is there: an earlier, interrupted upload
    # may have left other bytes.
    missing = [e for e in record.files if e.path not in confirmed or present.get(e.path) != e.size]
    outcome = copy_files(
        store, source, step, missing, record.checksum_algorithm, threads, timeout_s
    )
    if outcome.errors:
        raise CheckpointError(
            f"upload of step {step} to {store.url} failed: " + "; ".join(outcome.errors[:3])
        )
    # One more listing before the record: the record must never name an absent object (I1).
    present = store.list_files(store.step_rel(step))
    absent = [e.path for e in record.files if present.get(e.path) != e.size]
    if absent:
        raise CheckpointError(
            f"step {step} under {store.url}: {len(absent)} files missing or of the wrong size "
            f"after the upload (e.g. {absent[0]}); its commit record is not uploaded"
        )
    # THE REMOTE COMMIT POINT: from here the remote step is committed. The very bytes of
    # the local record: another save of the step is told apart by them.
    store.put_bytes(record_rel, record_bytes)
    # The tracker goes after the record: the other order could name a step that a failure
    # leaves without one.
    tracker, durable = move_tracker(store, step)
    return RemoteCommitSummary(
        step, len(record.files), sum(e.size for e in record.files), len(missing), tracker, durable
    )


def withdraw_other_remote_record(store: Store, step: int, record_bytes: bytes) -> bool:
    """Remove the commit record of `step` from `store` when it is not `record_bytes` (the
    local record of the step about to be uploaded): the remote step is another save of it
    (one a rollback or a resume fallback left behind). Its record goes first, as in
    retention, before any object is written under the step: an upload that fails half-way
    then leaves an uncommitted remote step, never a committed one whose objects are mixed.
    Its objects are replaced by the upload (or removed by retention). Returns whether it
    removed one."""
    rel = store.step_rel(step, COMMIT_RECORD_FILENAME)
    remote = store.read_bytes(rel, COMMIT_RECORD_MAX_BYTES)
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
