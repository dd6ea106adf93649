"""Which committed steps to keep (a pure policy) and how to delete one safely (invariant I3)."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterable
from pathlib import Path

from verl_ckpt.protocol import faults
from verl_ckpt.protocol.phases import Phase
from verl_ckpt.store.fsio import fsync_dir
from verl_ckpt.store.layout import COMMIT_RECORD_FILENAME

__all__ = ["DELETING_PREFIX", "delete_step_dir", "remove_tree", "steps_to_delete"]

# A step being deleted is renamed to this prefix first: out of the step namespace at once.
DELETING_PREFIX = ".deleting_"


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


def delete_step_dir(path: Path) -> None:
    """Delete a step directory so that no crash can leave a loadable half-deleted step.

    The directory first leaves the `global_step_<N>` namespace by one atomic rename,
    made durable: from then on no loader finds it. A crash or an error during the slow
    recursive delete leaves only a `.deleting_*` directory, which the next retention removes
    (commit.apply_retention). Its commit record goes first within it, so even a copy of it is
    not loadable.
    """
    doomed = path.with_name(f"{DELETING_PREFIX}{path.name}")
    if doomed.is_symlink() or doomed.exists():
        remove_tree(doomed)
    if path.is_symlink():
        # A step linked in from elsewhere: only the link is the root's. Deleting through it
        # would take the commit record of a checkpoint outside the root (another run's).
        path.unlink()
        fsync_dir(path.parent)
        return
    os.replace(path, doomed)
    fsync_dir(path.parent)
    faults.inject(Phase.RETENTION)
    (doomed / COMMIT_RECORD_FILENAME).unlink(missing_ok=True)
    remove_tree(doomed)


def remove_tree(path: Path) -> None:
    """Remove a directory tree, or only the link where `path` is a symbolic link (never what
    it points to)."""
    if path.is_symlink():
        path.unlink()
    else:
        shutil.rmtree(path)
