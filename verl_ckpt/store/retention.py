"""Which committed steps to keep (a pure policy), how to delete one safely, and retention
itself (invariant I3; protocol page steps 7 and 11), on every store (store/base.py)."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass, field

from verl_ckpt.protocol import faults
from verl_ckpt.protocol.phases import Phase
from verl_ckpt.store.base import Store
from verl_ckpt.store.commit_record import StepStates, locate_step, read_step_states
from verl_ckpt.store.layout import COMMIT_RECORD_FILENAME, step_of_dir
from verl_ckpt.store.open_store import Where, as_store
from verl_ckpt.store.record_cache import VerifiedRecords
from verl_ckpt.store.signing import Keyring
from verl_ckpt.store.tracker import tracker_or_none

__all__ = [
    "RetentionOutcome",
    "apply_retention",
    "delete_step",
    "steps_to_delete",
]

logger = logging.getLogger(__name__)


def steps_to_delete(
    committed_steps: Iterable[int], keep: int | None, protected: Iterable[int] = ()
) -> list[int]:
    """The committed steps to delete so that the newest `keep` committed steps remain.

    `keep=None` keeps everything. Protected steps (the tracker's target, steps in flight) are
    never returned. Only committed steps are passed in, so uncommitted leftovers never count
    toward `keep`.
    """
    if keep is None:
        return []
    if keep < 1:
        raise ValueError(f"keep must be >= 1 or None, got {keep}")
    newest_first = sorted(set(committed_steps), reverse=True)
    protected = set(protected)
    return sorted(step for step in newest_first[keep:] if step not in protected)


def delete_step(where: Where, step: int | None = None) -> None:
    """Delete a step so that no crash can leave a loadable half-deleted step. `where`: a
    store (or local root) and `step`, or a local step directory alone.

    The step first leaves the step namespace where the store can (store.retire_step: one
    durable rename to `.deleting_*`, which the next retention removes if this one is
    interrupted); its commit record goes next, so that what is left is never loadable (on an
    object store, this is what takes it out), then its files.
    """
    store, rel = locate_step(where, step)
    doomed = store.retire_step(step_of_dir(rel))
    if doomed is None:
        return  # a link to a step elsewhere: only the link was the store's
    if store.fault_hooks:
        faults.inject(Phase.RETENTION)
    store.remove(f"{doomed}/{COMMIT_RECORD_FILENAME}")
    store.remove_tree(doomed)


@dataclass
class RetentionOutcome:
    deleted: list[int] = field(default_factory=list)
    # Leftovers of earlier deletions and uploads that failed or were interrupted: the names
    # of `.deleting_*` directories where the store renames steps out of their namespace,
    # else the steps without a record older than the newest committed step.
    purged: list[str | int] = field(default_factory=list)
    # Committed steps beyond `keep` that stayed only because they were protected.
    spared: list[int] = field(default_factory=list)
    # Steps whose record does not read: neither counted toward keep nor deleted.
    unreadable: list[int] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


def apply_retention(
    where: Where,
    keep: int | None,
    protected: Iterable[int] = (),
    dry_run: bool = False,
    keyring: Keyring | None = None,
    verified: VerifiedRecords | None = None,
) -> RetentionOutcome:
    """Step 7 (11 on a remote tier), after a commit only: finish earlier half-done
    deletions, then delete committed steps beyond the newest `keep`. Never the tracker's
    target nor a `protected` step (in flight). Only steps whose record reads are committed:
    one whose record does not read is neither counted toward `keep` nor deleted. Failures
    are collected, not raised: retention failing never un-commits the step that triggered
    it, and the next commit retries. `dry_run`: decide, delete nothing. With a keyring
    (checkpoint.signing), a step whose record it does not verify counts as unreadable: a
    planted step takes no place of `keep`, and is not deleted either. `verified`: a
    long-lived caller's memory of the records it found valid (read_step_states)."""
    store = as_store(where)
    outcome = RetentionOutcome()
    states = read_step_states(store, keyring, verified)
    outcome.unreadable = list(states.unreadable)
    protected = set(protected) | set(states.unreadable)
    tracker = tracker_or_none(store)
    if tracker is not None:
        protected.add(tracker)
    committed = list(states.committed)
    outcome.spared = [s for s in steps_to_delete(committed, keep) if s in protected]
    for leftover in _leftovers(store, states, protected):
        _remove(store, leftover, outcome.purged, outcome, dry_run)
    for step in steps_to_delete(committed, keep, protected):
        logger.info("retention: deleting committed step %d of %s", step, store.url)
        _remove(store, step, outcome.deleted, outcome, dry_run)
    return outcome


def _leftovers(store: Store, states: StepStates, protected: set[int]) -> list[str | int]:
    if store.can_rename:
        # Steps without a record may be in flight; interrupted deletions are renamed out.
        return list(store.retired_leftovers())
    # No rename: an interrupted deletion (record gone first) or upload (record last) is a
    # step without a record; one older than the newest commit is no step in flight.
    newest = states.committed[-1] if states.committed else None
    return [
        s for s in states.uncommitted if newest is not None and s < newest and s not in protected
    ]


def _remove(
    store: Store, what: str | int, done: list, outcome: RetentionOutcome, dry_run: bool
) -> None:
    try:
        if not dry_run:
            if isinstance(what, int):
                delete_step(store, what)
            else:
                store.remove_tree(what)
        done.append(what)
    except Exception as exc:  # noqa: BLE001 - any failure is retried after the next commit
        default = store.uri(what) if isinstance(what, str) else store.uri(store.step_rel(what))
        detail = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
        where = exc.filename if isinstance(exc, OSError) and exc.filename else default
        outcome.errors.append(f"{where}: {detail}")
