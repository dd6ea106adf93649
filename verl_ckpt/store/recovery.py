"""Reading a store as it is, and recovering it at start-up (protocol page, steps 0 and 0').

Recovery never deletes a step: it finishes an interrupted `verl-ckpt rollback` (which the
user asked for), removes the tracker's temporary files of a crashed write, and rolls the
tracker forward to the newest committed step. The commit record is the commit point, so a
committed step newer than the tracker can only be a commit interrupted before the tracker
moved (the finalizer killed, or the whole job); rolling forward completes it. Both the
driver (before Ray starts) and the finalizer (at every start, restarts included) run it, on
the root and on a remote tier alike. With a keyring (checkpoint.signing, store/signing.py), a
step whose record is not signed by one of its keys counts as unreadable: never rolled
forward to, never resumed from.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

from verl_ckpt.protocol.errors import TrackerError
from verl_ckpt.store.base import Store
from verl_ckpt.store.commit_record import newest_committed, read_step_states
from verl_ckpt.store.layout import TRACKER_FILENAME
from verl_ckpt.store.open_store import Where, as_store
from verl_ckpt.store.rollback import complete_interrupted_rollback, read_rollback_intent
from verl_ckpt.store.signing import Keyring
from verl_ckpt.store.tracker import read_tracker, write_tracker

__all__ = ["RootState", "read_root_state", "recover_root", "roll_tracker_forward"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RootState:
    """What a store holds, read without writing anything."""

    url: str
    # As written (TrackerError when unreadable: never taken as "nothing").
    tracker: int | None
    committed: tuple[int, ...]
    # Steps without a readable commit record.
    uncommitted: tuple[int, ...]
    # The target of a rollback that was interrupted; recovery completes it.
    rollback_to: int | None = None
    store: Store | None = field(default=None, compare=False, repr=False)
    # The keys its records were checked with (checkpoint.signing); later reads use them too.
    keyring: Keyring | None = field(default=None, compare=False, repr=False)

    @property
    def root(self) -> Path:
        """The root directory (of a local store)."""
        return Path(self.url)

    @property
    def effective_tracker(self) -> int | None:
        """The step the tracker names once recovery ran: an interrupted rollback's target,
        else the newest of the tracker and the committed steps (roll-forward)."""
        if self.rollback_to is not None:
            return self.rollback_to
        newest = self.committed[-1] if self.committed else None
        if self.tracker is None or (newest is not None and newest > self.tracker):
            return newest
        return self.tracker

    @property
    def committed_after_recovery(self) -> tuple[int, ...]:
        if self.rollback_to is None:
            return self.committed
        return tuple(step for step in self.committed if step <= self.rollback_to)


def read_root_state(where: Where, keyring: Keyring | None = None) -> RootState:
    """The tracker, committed and uncommitted steps, and any interrupted rollback. With a
    keyring, a step whose record it does not verify counts as uncommitted."""
    store = as_store(where)
    intent = read_rollback_intent(store)
    states = read_step_states(store, keyring)
    return RootState(
        store.url,
        read_tracker(store),
        states.committed,
        tuple(sorted(states.uncommitted + states.unreadable)),
        intent.to if intent is not None else None,
        store,
        keyring,
    )


def roll_tracker_forward(
    where: Where, replace_unreadable: bool = False, keyring: Keyring | None = None
) -> int | None:
    """Point the tracker at the newest committed step when it names an older one (or none):
    a commit interrupted between its record and the tracker. Deletes nothing. Returns what
    the tracker names. An unreadable tracker raises TrackerError (a start never takes it as
    none), unless `replace_unreadable` (the finalizer's remote tier, which replaces one
    damaged while jobs run, as its next commit would). With a keyring, only a step whose
    record it verifies is rolled forward to (a planted step is skipped, logged)."""
    store = as_store(where)
    try:
        tracker = read_tracker(store)
    except TrackerError as exc:
        if not replace_unreadable:
            raise
        logger.warning("unreadable tracker (replaced now): %s", exc)
        tracker = None
    newest = newest_committed(store, keyring)
    if newest is None or (tracker is not None and tracker >= newest[0]):
        return tracker
    logger.warning(
        "%s: step %d is committed but the tracker names %s; moving the tracker forward to "
        "it (its commit was interrupted before the tracker moved)",
        store.uri(TRACKER_FILENAME),
        newest[0],
        tracker,
    )
    write_tracker(store, newest[0])
    return newest[0]


def recover_root(where: Where, keyring: Keyring | None = None) -> RootState:
    """Bring the store to a consistent state (see the module docstring); return it."""
    store = as_store(where)
    if complete_interrupted_rollback(store, keyring) is not None:
        logger.warning("completed an interrupted rollback of %s", store.url)
    # A crash inside the tracker's atomic write leaves only a temporary file; the tracker
    # itself holds the old or the new step (the rename is atomic).
    store.clear_temporaries(TRACKER_FILENAME)
    roll_tracker_forward(store, keyring=keyring)
    return read_root_state(store, keyring)
