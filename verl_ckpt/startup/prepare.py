"""Protocol step 0: everything decided about a checkpoint root before a job starts its work.

A recipe calls `prepare_start(config)` before Ray starts, so that every mistake it can see
(a root that is a file or not writable, a path component too long, an unreadable tracker, a
resume path that is missing or not committed, a resume step older than the root's newest
committed step, another job on the same root, and, given the run's roles, a resume step
they cannot load) is one line naming the key or path, and the run has written and deleted
nothing. `CheckpointCoordinator` calls it itself when it is not handed a plan.

Order: read-only checks first (a failure leaves the disk as it was; a remote tier's URL is
checked here too), then the root lock (another job on this root is refused), then recovery
(recovery.py: roll-forward), the download of a newer step from the remote tier
(startup/remote.py), and the same resume decision once more under the lock, where nobody
else can change the root; then the resume step is verified (resume_check.py:
`resume_verify`, and the quarantine and fallback of `resume_fallback=previous`), and last
whether the run's roles can load the step chosen (resume_fit.py), before any state is
touched.

With `checkpoint.signing`, the keys are read first (a missing key file or variable is one
line naming it), and every read of a commit record from here on checks its signature
(store/signing.py): a step whose record is unsigned or signed with another key is neither
rolled forward to, nor resumed from, nor downloaded.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from verl_ckpt.hf.scheduler import check_export_config
from verl_ckpt.protocol.config import CheckpointConfig, check_deadline_env, to_checkpoint_config
from verl_ckpt.protocol.errors import (
    CheckpointConfigError,
    CheckpointError,
    CommitRecordError,
    ResumeConflictError,
    TrackerError,
)
from verl_ckpt.startup.remote import (
    RemoteCopiesForResume,
    RemoteStart,
    check_remote_against_root,
    check_remote_start,
    fetch_newer_remote_step,
)
from verl_ckpt.startup.resume_check import check_resume_before_lock, settle_resume_step
from verl_ckpt.startup.resume_fit import check_resume_fits
from verl_ckpt.startup.root_lock import RootLock, this_job
from verl_ckpt.store.commit_record import read_commit_record
from verl_ckpt.store.layout import step_dir, step_of_dir
from verl_ckpt.store.recovery import RootState, read_root_state, recover_root
from verl_ckpt.store.signing import Keyring, load_keyring
from verl_ckpt.store.tracker import tracker_path

__all__ = ["StartPlan", "check_root_dir", "choose_resume_dir", "prepare_start"]

logger = logging.getLogger(__name__)


@dataclass
class StartPlan:
    """What `prepare_start` decided: hand it to `CheckpointCoordinator(..., start=plan)`."""

    config: CheckpointConfig
    root: Path
    # The committed step directory to resume from; None: a fresh start.
    resume_dir: Path | None
    # The root as recovery (and a resume fallback) left it.
    state: RootState
    # Held until the coordinator closes (or `release()`): one job per root.
    lock: RootLock

    @property
    def keyring(self) -> Keyring | None:
        """The keys of checkpoint.signing, read at start-up (None: records are not signed)."""
        return self.state.keyring

    def release(self) -> None:
        self.lock.release()


def prepare_start(
    config: CheckpointConfig | Any,
    purpose: str | None = None,
    roles: Mapping[str, int] | None = None,
    participants: Mapping[str, int] | None = None,
) -> StartPlan:
    """Check, lock and recover the root; decide the resume step (see the module docstring).

    `roles` (optional): the roles that will load the resume step, each with its number of
    ranks in this run. With it, a resume step they cannot load (a role it does not hold, or
    per-rank extra state saved by another number of ranks while `load_contents` asks for
    it: resume_fit.py) is refused here rather than in the ranks' `load()`. `participants`
    (optional): the participants the run declares to the coordinator (name -> count),
    checked the same way (resume_fit.check_participants_fit); the coordinator checks them
    again in any case.

    Raises a CheckpointError subclass naming the key or path: CheckpointConfigError,
    TrackerError, CommitRecordError (ResumeVerificationError), ResumeConflictError or
    RootLockedError; or CheckpointError (with `roles`, or the root's filesystem failing).
    """
    config = to_checkpoint_config(config)
    root = Path(config.root_dir).resolve()
    try:
        return _prepare_start(config, root, purpose, roles, participants)
    except CheckpointError:
        raise  # already one line naming what failed (a CommitTimeoutError is an OSError too)
    except OSError as exc:
        # The filesystem failed under a step of the start (a full disk, a name too long, an
        # I/O error): each step is crash-safe, so what it left is what a crash there leaves,
        # and the next start takes it up. One line naming the file, not a traceback.
        where = exc.filename or root
        raise CheckpointError(
            f"checkpoint start-up under {root} failed: {where}: {exc.strerror or exc}"
        ) from None


def _prepare_start(
    config: CheckpointConfig,
    root: Path,
    purpose: str | None,
    roles: Mapping[str, int] | None,
    participants: Mapping[str, int] | None = None,
) -> StartPlan:
    check_root_dir(root)
    check_export_config(config)  # an unknown Hugging Face mapping name, before Ray starts
    check_deadline_env(config.preemption)
    # The keys first: every record read below is checked with them (module docstring).
    keyring = load_keyring(config.signing)
    # The remote tier (store/fsspec_store.py: fsspec is imported only where a URL is used)
    # is read by the same store functions as the root; its own checks in startup/remote.py.
    remote = check_remote_start(config, keyring) if config.remote.url is not None else None
    before = read_root_state(root, keyring)
    # Read-only, before the lock: a step the roles cannot load is refused with nothing
    # written. Checked again below on the step settled under the lock.
    check_resume_before_lock(config, before, _loadable_resume_dir(roles, participants))
    if remote is not None:
        check_remote_against_root(config, remote, before)
    lock = RootLock.acquire(root, purpose or this_job())
    try:
        state = recover_root(root, keyring)
        if remote is not None and _fetched(config, remote, state):
            state = read_root_state(root, keyring)  # the tracker names the downloaded step
        copies = RemoteCopiesForResume(config, remote, root) if remote is not None else None
        fits = None
        if roles is not None or participants is not None:

            def fits(path: Path) -> None:
                check_resume_fits(path, roles or {}, config.load_contents, participants)

        resume = settle_resume_step(config, state, choose_resume_dir, copies, fits)
        if resume is not None and state.tracker != step_of_dir(resume):
            state = read_root_state(root, keyring)  # the fallback moved steps and the tracker
        # Again on the step settled: recovery, a download or a fallback may have changed it.
        if resume is not None and (roles is not None or participants is not None):
            check_resume_fits(resume, roles or {}, config.load_contents, participants)
    except BaseException:
        lock.release()
        raise
    return StartPlan(config, root, resume, state, lock)


def check_root_dir(root: Path, key: str = "checkpoint.root_dir") -> None:
    """Fail, naming the key and path, unless `root` can hold checkpoints (read-only check)."""
    name_max = _name_max(root)
    for part in root.parts:
        if len(os.fsencode(part)) > name_max:
            raise CheckpointConfigError(
                f"{key}={str(root)!r} is invalid: path component {part[:40]!r}... is "
                f"{len(os.fsencode(part))} bytes, longer than this filesystem's {name_max}"
            )
    if step_of_dir(root) is not None:
        raise CheckpointConfigError(
            f"{key}={str(root)!r} is a step directory; give the root that holds it "
            f"({root.parent}), or use it as checkpoint.resume_from_path"
        )
    existing = _nearest_existing(root)
    if not existing.is_dir():
        what = (
            "exists and is not a directory" if existing == root else f"is under {existing}, a file"
        )
        raise CheckpointConfigError(f"{key}={str(root)!r} {what}")
    if not os.access(existing, os.W_OK | os.X_OK):
        where = "" if existing == root else f" ({existing} is where it would be created)"
        raise CheckpointConfigError(f"{key}={str(root)!r} is not writable{where}")


def choose_resume_dir(config: CheckpointConfig, state: RootState) -> Path | None:
    """The committed step to resume from per `resume_mode`, against the root's state.

    auto: the tracker's step after roll-forward, i.e. the newest committed step; nothing
    committed is a fresh start (uncommitted leftovers are logged: the run re-saves over
    them). resume_path: a committed step directory, from this root or another. disable: a
    fresh start, allowed only in a root without committed steps. A resume step older than a
    committed step of this root is refused: the run's saves would collide with them.
    """
    if config.resume_mode == "resume_path":
        path = _checked_resume_path(config.resume_from_path, state.keyring)
        step = step_of_dir(path)
        _refuse_newer_steps(state, step, f"checkpoint.resume_from_path resumes from step {step}")
        return path
    if config.resume_mode == "disable":
        _refuse_newer_steps(state, None, "checkpoint.resume_mode=disable starts from step 0")
        return None
    step = state.effective_tracker
    if step is None:
        if state.uncommitted:
            logger.warning(
                "%s holds no committed step, only uncommitted leftovers %s: starting fresh",
                state.root,
                list(state.uncommitted),
            )
        return None
    path = step_dir(state.root, step)
    if not path.is_dir():
        raise TrackerError(
            f"{tracker_path(state.root)} names step {step}, but {path} does not exist"
        )
    try:
        read_commit_record(path, keyring=state.keyring)
    except CommitRecordError as exc:
        raise TrackerError(
            f"{tracker_path(state.root)} names step {step}, which is unusable: {exc}"
        ) from None
    return path


# ---- helpers -------------------------------------------------------------------------------


def _loadable_resume_dir(
    roles: Mapping[str, int] | None, participants: Mapping[str, int] | None = None
):
    """choose_resume_dir, refusing (given the roles, the declared participants) a step
    they cannot load."""
    if roles is None and participants is None:
        return choose_resume_dir

    def choose(config: CheckpointConfig, state: RootState) -> Path | None:
        resume = choose_resume_dir(config, state)
        if resume is not None:
            check_resume_fits(resume, roles or {}, config.load_contents, participants)
        return resume

    return choose


def _fetched(config: CheckpointConfig, remote: RemoteStart, state: RootState) -> bool:
    """Whether a newer step of the remote tier was downloaded into the root."""
    return fetch_newer_remote_step(config, remote, state) is not None


def _checked_resume_path(value: str | None, keyring: Keyring | None) -> Path:
    key = "checkpoint.resume_from_path"
    path = Path(value).resolve()
    if not path.exists():
        raise CheckpointConfigError(f"{key}={value!r} does not exist")
    if step_of_dir(path) is None or not path.is_dir():
        raise CheckpointConfigError(f"{key}={value!r} is not a global_step_<N> directory")
    try:
        read_commit_record(path, keyring=keyring)
    except CommitRecordError as exc:
        # Its own class (a SignatureError stays one), the key in front.
        raise type(exc)(f"{key}: {exc}") from None
    return path


def _refuse_newer_steps(state: RootState, step: int | None, what: str) -> None:
    """Fail when the root holds committed steps newer than `step` (None: a fresh start), or
    a tracker naming a newer step that is not committed: the run's commits could not move
    it (it never moves backwards), and it would name an uncommitted step all along (I1)."""
    newer = [s for s in state.committed_after_recovery if step is None or s > step]
    stale = state.effective_tracker
    if not newer and stale is not None and stale not in state.committed_after_recovery:
        if step is None or stale > step:
            raise ResumeConflictError(
                f"{what}, but {tracker_path(state.root)} names step {stale}, which is not a "
                "committed step of this root (no readable commit record): this run's commits "
                "could never move the tracker past it. Use a new checkpoint.root_dir, or "
                f"remove the tracker if step {stale} is not wanted"
            )
    if not newer:
        return
    if step is None:
        way_out = "or checkpoint.resume_mode=auto to continue from the newest"
    else:
        way_out = f"or move them out of the way first: verl-ckpt rollback {state.root} --to {step}"
    raise ResumeConflictError(
        f"{what}, but checkpoint.root_dir {state.root} holds newer committed steps {newer}: "
        f"this run's saves would collide with them. Use a new checkpoint.root_dir, {way_out}"
    )


def _nearest_existing(path: Path) -> Path:
    """`path` or its nearest ancestor that exists (stat errors count as missing)."""
    while path != path.parent:
        try:
            path.stat()
            return path
        except OSError:
            path = path.parent
    return path


def _name_max(path: Path) -> int:
    try:
        return os.pathconf(_nearest_existing(path), "PC_NAME_MAX")
    except (OSError, ValueError):
        return 255
