"""Fetch a committed step from a store (the remote tier) into a local root (resume from the
remote tier, `verl-ckpt pull`), with the local tier's guarantees: a store-to-store copy
(transfer.py) into a staging directory, then one rename.

Order: every file is downloaded in parallel into `.pulling_global_step_<N>/`, verified against
the remote commit record and fsynced; then the record is written there, last; then the
directory takes its `global_step_<N>` name by one atomic rename, made durable. A crash at any
point leaves no `global_step_<N>` that looks committed, only a `.pulling_*` directory that the
next pull replaces. The step is then a committed step newer than the tracker, which start-up
recovery rolls the tracker forward to, as it does for an interrupted commit (I2).

With a keyring (checkpoint.signing), the remote record's signature is checked before
anything else of the step is read or downloaded: an unsigned record, or one signed with
another key, is refused in one line naming the step (store/signing.py).
"""

from __future__ import annotations

import logging
import os
import shutil
import stat
from dataclasses import dataclass
from pathlib import Path

from verl_ckpt.protocol.errors import CheckpointError, CommitRecordError
from verl_ckpt.remote.transfer import copy_files
from verl_ckpt.store.base import Store
from verl_ckpt.store.commit_record import (
    check_record_signature,
    is_committed,
    parse_commit_record,
    read_record_bytes,
)
from verl_ckpt.store.fsio import fsync_dir, make_dir
from verl_ckpt.store.layout import COMMIT_RECORD_FILENAME, step_dir
from verl_ckpt.store.local import LocalStore
from verl_ckpt.store.retention import delete_step
from verl_ckpt.store.signing import Keyring

__all__ = [
    "PULLING_PREFIX",
    "PullSummary",
    "StagedStep",
    "install_staged",
    "pull_step",
    "stage_step",
]

logger = logging.getLogger(__name__)

PULLING_PREFIX = ".pulling_"


@dataclass(frozen=True)
class PullSummary:
    step: int
    path: Path
    files: int
    bytes: int
    seconds: float
    # False when the step was committed locally already (nothing downloaded).
    downloaded: bool = True


@dataclass(frozen=True)
class StagedStep:
    """A remote step downloaded and verified beside the root, its record written last: it
    only has to take its `global_step_<N>` name (install_staged)."""

    staging: Path
    target: Path
    summary: PullSummary
    # The staging directory's (st_dev, st_ino) when it was made: the directory that must
    # take the step's name, not whatever a writer of the root put at its name since.
    identity: tuple[int, int]


def pull_step(
    store: Store,
    step: int,
    root: Path,
    threads: int,
    timeout_s: float,
    keyring: Keyring | None = None,
) -> PullSummary:
    """Download the remote committed `step` into `root` (see the module docstring)."""
    target = step_dir(root, step)
    if is_committed(target, keyring=keyring):
        return PullSummary(step, target, 0, 0, 0.0, downloaded=False)
    return install_staged(stage_step(store, step, root, threads, timeout_s, keyring))


def stage_step(
    store: Store,
    step: int,
    root: Path,
    threads: int,
    timeout_s: float,
    keyring: Keyring | None = None,
) -> StagedStep:
    """Download and verify the remote committed `step` into `.pulling_global_step_<N>/`,
    record last; nothing in the step namespace changes. On failure nothing is left. With
    a keyring, a record it does not verify is refused before anything is downloaded."""
    target = step_dir(root, step)
    record_rel = store.step_rel(step, COMMIT_RECORD_FILENAME)
    data = read_record_bytes(store, step)
    if data is None:
        raise CommitRecordError(
            f"{store.uri(target.name)} is not a committed step of the remote tier: its commit "
            f"record {COMMIT_RECORD_FILENAME} is missing"
        )
    # The signature before anything else of the step is read (module docstring).
    check_record_signature(data, keyring, store.uri(target.name))
    # Its names are checked there (store/layout.py relative_path_problem): every file lands
    # below the staging directory.
    record = parse_commit_record(data, store.uri(record_rel))
    if record.step != step:
        raise CommitRecordError(f"{store.uri(record_rel)} names step {record.step}, not {step}")
    staging = root / f"{PULLING_PREFIX}{target.name}"
    if staging.is_symlink():
        staging.unlink()  # only the link is the root's: never followed
    elif staging.exists():
        shutil.rmtree(staging)  # an earlier pull interrupted: never mixed with this one
    make_dir(staging, parents=True)
    made = os.lstat(staging)
    # Every file goes below the root by names no link redirects (LocalStore of the root,
    # fsio.open_dir_beneath): a writer of the root who swaps the staging directory for a
    # link to anywhere makes the download fail, never write there.
    outcome = copy_files(
        staging,
        store,
        step,
        record.files,
        record.checksum_algorithm,
        threads,
        timeout_s,
        what="download",
    )
    if outcome.errors:
        shutil.rmtree(staging, ignore_errors=True)
        raise CheckpointError(
            f"download of step {step} from {store.url} failed ({len(outcome.errors)} of "
            f"{len(record.files)} files): " + "; ".join(outcome.errors[:3])
        )
    for directory in {staging / Path(e.path).parent for e in record.files} | {staging}:
        fsync_dir(directory)
    # The record last: a staging directory without it is never mistaken for a step.
    LocalStore(root).put_bytes(f"{staging.name}/{COMMIT_RECORD_FILENAME}", data)
    summary = PullSummary(step, target, len(record.files), outcome.nbytes, outcome.seconds)
    return StagedStep(staging, target, summary, (made.st_dev, made.st_ino))


def install_staged(staged: StagedStep) -> PullSummary:
    """Give a staged step its `global_step_<N>` name by one atomic rename, made durable."""
    target = staged.target
    if target.exists():
        # An uncommitted leftover of the same step (a save that never finished).
        logger.warning("replacing uncommitted leftover %s by the remote tier's step", target)
        delete_step(target)
    # Checked before the rename and again after it (a swap can land between the two).
    before = os.lstat(staged.staging)
    if not stat.S_ISDIR(before.st_mode) or (before.st_dev, before.st_ino) != staged.identity:
        raise CheckpointError(
            f"{staged.staging} was replaced while step {staged.summary.step} was pulled into it "
            "(another writer of the root?); the pulled step is not installed"
        )
    os.replace(staged.staging, target)
    fsync_dir(target.parent)
    now = os.lstat(target)
    if not stat.S_ISDIR(now.st_mode) or (now.st_dev, now.st_ino) != staged.identity:
        # Something a writer of the root put at the staging name took the step's name:
        # it goes again (a link: only the link), and the pull fails.
        if stat.S_ISDIR(now.st_mode):
            delete_step(target)
        else:
            target.unlink()
            fsync_dir(target.parent)
        raise CheckpointError(
            f"{staged.staging} was replaced while step {staged.summary.step} was pulled into it "
            "(another writer of the root?); the pulled step is not installed"
        )
    return staged.summary
