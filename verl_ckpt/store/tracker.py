"""`latest_checkpointed_iteration.txt`: read strictly, written atomically, never moved
backwards (invariant I2; protocol page steps 6 and 10), on every store (store/base.py).

The tracker stays a bare integer so that Megatron-LM and verl read it unchanged; the commit
record beside each step carries the format version.
"""

from __future__ import annotations

import logging
from pathlib import Path

from verl_ckpt.protocol import faults
from verl_ckpt.protocol.errors import CheckpointError, TrackerError
from verl_ckpt.protocol.phases import Phase
from verl_ckpt.store.commit_record import locate_step
from verl_ckpt.store.fsio import FileTooLarge, NotARegularFile, RenameNotDurable
from verl_ckpt.store.layout import (
    COMMIT_RECORD_FILENAME,
    MAX_STEP,
    TRACKER_FILENAME,
    step_number_problem,
)
from verl_ckpt.store.open_store import Where, as_store

__all__ = [
    "TRACKER_MAX_BYTES",
    "CommitPhaseError",
    "advance_tracker",
    "move_tracker",
    "parse_tracker",
    "read_tracker",
    "tracker_or_none",
    "tracker_path",
    "withdraw_record",
    "write_tracker",
]

logger = logging.getLogger(__name__)

_ASCII_WHITESPACE = " \t\n\r\v\f"
# A tracker is at most 18 digits and some whitespace: a larger one is refused unread (a huge
# file planted in a root must not cost every start its size in memory and time).
TRACKER_MAX_BYTES = 64


class CommitPhaseError(CheckpointError):
    """The commit of a step failed in `phase` (commit record or tracker); not committed."""

    def __init__(self, phase: Phase, cause: BaseException) -> None:
        super().__init__(f"{type(cause).__name__}: {cause}")
        self.phase = phase
        self.errno = cause.errno if isinstance(cause, OSError) else None


def tracker_path(root: str | Path) -> Path:
    return Path(root) / TRACKER_FILENAME


def read_tracker(where: Where) -> int | None:
    """The step the tracker names, or None when there is no tracker file.

    One non-negative integer, with surrounding ASCII whitespace allowed (Megatron-LM and
    verl strip it: a tracker written by hand or by them reads the same). Anything else is an
    error naming the file: a tracker we cannot read is never taken as "start from scratch".
    """
    store = as_store(where)
    where_text = store.uri(TRACKER_FILENAME)
    try:
        raw = store.read_bytes(TRACKER_FILENAME, TRACKER_MAX_BYTES)
    except FileTooLarge:
        raise TrackerError(
            f"tracker {where_text} is larger than {TRACKER_MAX_BYTES} bytes, not a file holding "
            "a step"
        ) from None
    except IsADirectoryError:
        raise TrackerError(
            f"tracker {where_text} is a directory, not a file holding a step"
        ) from None
    except NotARegularFile:
        raise TrackerError(f"tracker {where_text} is not a regular file holding a step") from None
    except CheckpointError:
        raise  # a store call past its deadline: it names the object itself
    except OSError as exc:
        raise TrackerError(f"tracker {where_text} cannot be read: {exc.strerror or exc}") from None
    return None if raw is None else parse_tracker(raw, where_text)


def parse_tracker(raw: bytes, where: str) -> int:
    """The step in a tracker's bytes (read from `where`, named in errors)."""
    try:
        text = raw.decode("ascii")
    except UnicodeDecodeError:
        raise TrackerError(
            f"tracker {where} is not plain ASCII (a byte-order mark or binary data?): {raw[:20]!r}"
        ) from None
    body = text.strip(_ASCII_WHITESPACE)
    # No step has more digits than MAX_STEP; int() refuses thousands of them with its own
    # error.
    if not body.isdigit() or len(body) > len(str(MAX_STEP)):
        raise TrackerError(
            f"tracker {where} must hold one non-negative integer step, found {text[:40]!r}"
        )
    return int(body)


def write_tracker(where: Where, step: int) -> None:
    """Atomically point the tracker at `step` (store.put_bytes: locally tmp file, fsync,
    rename, directory fsync; one PUT on an object store)."""
    problem = step_number_problem(step)
    if problem is not None:
        raise ValueError(f"tracker: {problem}")
    store = as_store(where)
    store.put_bytes(
        TRACKER_FILENAME,
        f"{step}\n".encode("ascii"),
        before_replace=(lambda: faults.inject(Phase.TRACKER)) if store.fault_hooks else None,
    )


def tracker_or_none(where: Where) -> int | None:
    """The tracker's step; None (logged) when there is none or it does not read."""
    try:
        return read_tracker(where)
    except TrackerError as exc:
        # Start-up refuses an unreadable tracker; one damaged while a job runs is replaced by
        # the next commit rather than blocking every commit after it.
        logger.warning("unreadable tracker (the next commit replaces it): %s", exc)
        return None


def advance_tracker(where: Where, step: int) -> int | None:
    """Step 6 (10 on a remote tier): point the tracker at the committed `step` unless it
    names a newer one (it never moves backwards: a late commit of an older step leaves it).
    Returns what the tracker names afterwards (None: there is none, or it could not be read).
    move_tracker also says whether the move was made durable."""
    return move_tracker(where, step)[0]


def move_tracker(where: Where, step: int) -> tuple[int | None, bool]:
    """advance_tracker's move, and whether what the tracker names is durable: False where it
    was renamed to `step` but its directory's fsync failed, so that a power loss may bring
    back the step before (which retention must then not delete).

    A failure before the tracker's rename withdraws the commit record, so that the store and
    the reported failure agree (unlinking needs no free space). After the rename nothing
    un-commits the step: a failed directory fsync there is only logged. Where a failed write
    proves nothing (an object store's PUT may still land: `Store.failed_put_left_old`), the
    record stays: withdrawn under a tracker that did move, it would leave the tracker naming
    a step without a record (I1); the step stays committed and the tracker is rolled forward
    to it at the next start.
    """
    store = as_store(where)
    try:
        current = tracker_or_none(store)
    except CheckpointError as exc:
        # A store call past its deadline (it names the object). The record is there: the
        # step is committed, and a tracker of unknown content is never written over (it may
        # name a newer step); the next start rolls it forward.
        logger.error(
            "the tracker of %s is not moved to step %d, which stays committed (the tracker is "
            "rolled forward to it at the next start): %s",
            store.url,
            step,
            exc,
        )
        return None, True
    if current is not None and current >= step:
        return current, True
    try:
        write_tracker(store, step)
    except RenameNotDurable as exc:
        logger.warning(
            "tracker of %s moved to step %d, but not made durable: %s", store.url, step, exc
        )
        return step, False
    except Exception as exc:
        if store.failed_put_left_old and withdraw_record(store, step):
            raise CommitPhaseError(Phase.TRACKER, exc) from exc
        logger.error(
            "the tracker of %s could not move to step %d (%s), and its commit record was not "
            "withdrawn: the step stays committed and the tracker is rolled forward to it at "
            "the next start",
            store.url,
            step,
            exc,
        )
        return current, True
    return step, True


def withdraw_record(where: Where, step: int | None = None) -> bool:
    """Remove a step's commit record again; True once readers no longer see it, so that the
    step is no commit. Then only a failed directory fsync can be left, logged: a power loss
    might bring the record back, and the next start would roll the tracker forward to it."""
    store, rel = locate_step(where, step)
    try:
        store.remove(f"{rel}/{COMMIT_RECORD_FILENAME}")
    except RenameNotDurable as exc:
        logger.warning(
            "commit record of %s withdrawn, but not made durable: %s", store.uri(rel), exc
        )
    except Exception:  # noqa: BLE001 - the store may be what failed
        return False
    return True
