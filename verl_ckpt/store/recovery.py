"""Reading a checkpoint root as it is, and recovering it at start-up (protocol.py, step 0).

Recovery never deletes a step: it finishes an interrupted `verl-ckpt rollback` (which the
user asked for), removes the tracker's temporary files of a crashed write, and rolls the
tracker forward to the newest committed step. The commit record is the commit point, so a
committed step newer than the tracker can only be a commit interrupted before the tracker
moved (the finalizer killed, or the whole job); rolling forward completes it. Both the
driver (before Ray starts) and the finalizer (at every start, restarts included) run it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from verl_ckpt.store.commit_record import committed_steps
from verl_ckpt.store.fsio import remove_stale_temporaries
from verl_ckpt.store.layout import TRACKER_FILENAME, list_step_dirs
from verl_ckpt.store.rollback import complete_interrupted_rollback, read_rollback_intent
from verl_ckpt.store.tracker import read_tracker, tracker_path, write_tracker

__all__ = ["RootState", "read_root_state", "recover_root"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RootState:
    """What a root holds, read without writing anything."""

    root: Path
    # As written on disk (TrackerError when unreadable: never taken as "nothing").
    tracker: int | None
    committed: tuple[int, ...]
    uncommitted: tuple[int, ...]
    # The target of a rollback that was interrupted; recovery completes it.
    rollback_to: int | None = None

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


def read_root_state(root: Path) -> RootState:
    """The tracker, committed and uncommitted steps, and any interrupted rollback."""
    intent = read_rollback_intent(root)
    committed = committed_steps(root)
    uncommitted = sorted(set(list_step_dirs(root)) - set(committed))
    return RootState(
        root,
        read_tracker(root),
        tuple(committed),
        tuple(uncommitted),
        intent.to if intent is not None else None,
    )


def recover_root(root: Path) -> RootState:
    """Bring the root to a consistent state (see the module docstring); return it."""
    if complete_interrupted_rollback(root) is not None:
        logger.warning("completed an interrupted rollback of %s", root)
    # A crash inside the tracker's atomic write leaves only a temporary file; the tracker
    # itself holds the old or the new step (the rename is atomic).
    remove_stale_temporaries(root, TRACKER_FILENAME)
    state = read_root_state(root)
    target = state.effective_tracker
    if target is not None and target != state.tracker:
        logger.warning(
            "%s: step %d is committed but the tracker names %s; moving the tracker forward to "
            "it (its commit was interrupted before the tracker moved)",
            tracker_path(root),
            target,
            state.tracker,
        )
        write_tracker(root, target)
        state = read_root_state(root)
    return state
