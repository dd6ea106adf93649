"""Protocol step 0, last part: the resume step is verified before any state is touched, and
a bad one is quarantined with a fallback to an older step (`checkpoint.resume_verify`,
`checkpoint.resume_fallback`). Runs in `startup.prepare_start`, under the root lock, after
recovery and before Ray starts.

resume_verify:   record     the commit record is readable, names this step, and every file
                            it lists is present with its recorded size (a stat per file)
                 checksums  the same, and every byte re-read and re-hashed, on every core
                            (verification.verify_step)
resume_fallback: error      a resume step that fails is one error naming the file; nothing
                            is changed
                 previous   (resume_mode=auto only) the failing step, and every newer
                            committed step that fails as well, leave the step namespace by a
                            rename into <root>/quarantine/ (never deleted); then the tracker
                            is pointed at the newest older committed step that passes, and
                            the run resumes from it with one warning naming the bad file.

With a remote tier (`remote`, built by startup/remote.py), before any fallback: when the
remote tier holds the failing step committed, its copy is downloaded beside the root and
verified against its record (every checksum); only then is the local copy quarantined (as
below) and the download renamed into its place, and the run resumes from the same step with
one warning. When that fails (logged), the fallback goes on as below, except that a
fallback to a step older than the remote tier's newest committed step is refused before
anything moves (the run's uploads would go over the remote tier's newer steps): the error
names `verl-ckpt rollback URL --to N --delete`.

Order of the fallback, and why:
  1. find the step to fall back to FIRST: when none passes, fail having moved nothing.
  2. rename each failing step into the quarantine, fsync. Before the tracker: start-up
     recovery (here and in every finalizer start) rolls the tracker FORWARD to the newest
     committed step, so a failing committed step left in the namespace would be resumed
     from again. A crash after this leaves the tracker naming a missing step, which the
     next start with `previous` falls back from the same way (with `error`, it says so).
  3. write the tracker (atomic), backwards to the fallback step: the one time the tracker
     moves back, and only because the configuration asks for it.
A step named by `resume_from_path` is never replaced by another: it fails with an error.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Protocol

from verl_ckpt.protocol.config import CheckpointConfig
from verl_ckpt.protocol.errors import CommitRecordError, ResumeVerificationError, TrackerError
from verl_ckpt.store.commit_record import read_commit_record
from verl_ckpt.store.fsio import fsync_dir, make_dir
from verl_ckpt.store.layout import step_dir, step_of_dir
from verl_ckpt.store.recovery import RootState
from verl_ckpt.store.signing import Keyring
from verl_ckpt.store.tracker import write_tracker
from verl_ckpt.store.verification import verify_step

__all__ = [
    "QUARANTINE_DIRNAME",
    "RemoteCopies",
    "check_resume_before_lock",
    "quarantine_step",
    "settle_resume_step",
    "step_problem",
]

logger = logging.getLogger(__name__)

# <root>/quarantine/global_step_<N>.<time>: outside the step namespace, so that nothing
# (recovery, retention, resume, `verl-ckpt` prune) takes it for a step.
QUARANTINE_DIRNAME = "quarantine"

ChooseResumeDir = Callable[[CheckpointConfig, RootState], Path | None]


class RemoteCopies(Protocol):
    """What a remote tier offers a failing resume step (startup/remote.py implements it)."""

    def copy_in(self, step: int, make_room: Callable[[], None]) -> str | None:
        """Download the remote tier's committed `step` beside the root, verified; then call
        `make_room()` (which moves the local copy away) and give the download its
        `global_step_<N>` name; return where it came from, for the log. None, having called
        nothing, when the remote tier has no usable copy (logged)."""
        ...

    def refuse_below(self, step: int, what: str) -> None:
        """Raise ResumeConflictError (`what` first) when resuming from `step` would start
        below the remote tier's newest committed step."""
        ...


@dataclass(frozen=True)
class _BadStep:
    step: int
    problem: str  # one line naming the file or the record


def check_resume_before_lock(
    config: CheckpointConfig, state: RootState, choose: ChooseResumeDir
) -> None:
    """The read-only first pass of start-up: `choose` raises for a bad resume decision,
    except for an unusable tracker target that the fallback handles under the lock."""
    try:
        choose(config, state)
    except TrackerError:
        if not _falls_back(config):
            raise


def settle_resume_step(
    config: CheckpointConfig,
    state: RootState,
    choose: ChooseResumeDir,
    remote: RemoteCopies | None = None,
    fits: Callable[[Path], None] | None = None,
) -> Path | None:
    """The verified step to resume from (None: a fresh start), after recovery, under the
    lock. `choose` is startup.choose_resume_dir; `remote` the remote tier, if any; `fits`
    raises for a step the run cannot load (resume_fit.check_resume_fits), called on a
    fallback before anything moves. Raises ResumeVerificationError naming the file when the
    step fails and there is no fallback, ResumeConflictError when the fallback would start
    below the remote tier's newest step (see the module docstring)."""
    try:
        resume = choose(config, state)
    except TrackerError as exc:
        # The tracker names a missing, uncommitted or corrupt step.
        if not _falls_back(config) or state.effective_tracker is None:
            raise
        bad = _BadStep(state.effective_tracker, str(exc))
        return _fall_back(config, state, bad, remote, fits)
    if resume is None:
        return None
    problem = step_problem(resume, config.resume_verify, state.keyring)
    if problem is None:
        return resume
    step = step_of_dir(resume)
    if not _falls_back(config):
        hint = (
            "a step named by checkpoint.resume_from_path is never replaced by another"
            if config.resume_mode == "resume_path"
            else "set checkpoint.resume_fallback=previous to resume from the newest older "
            "step that verifies"
        )
        raise ResumeVerificationError(
            f"checkpoint.resume_verify={config.resume_verify}: resume step {step} fails "
            f"verification: {problem}. Nothing was moved; {hint}"
        )
    return _fall_back(config, state, _BadStep(step, problem), remote, fits)


def step_problem(path: Path, mode: str, keyring: Keyring | None = None) -> str | None:
    """What is wrong with the committed step at `path` under `mode` (record or checksums),
    in one line naming the file; None when it passes. With a keyring, its record's signature
    is checked first (checkpoint.signing), before any other file of the step is read."""
    try:
        record = read_commit_record(path, keyring=keyring)
    except CommitRecordError as exc:
        return str(exc)
    step = step_of_dir(path)
    if record.step != step:
        return f"{path}: its commit record names step {record.step}, not {step}"
    result = verify_step(path, record, checksums=mode == "checksums")
    if mode == "checksums":
        logger.info(
            "verified step %s: %d files, %d bytes re-hashed in %.2f s (%.2f GB/s, %d threads)%s",
            path,
            result.files,
            result.bytes_read,
            result.seconds,
            result.gb_per_s,
            result.threads,
            "" if result.ok else f": {len(result.problems)} problem(s)",
        )
    return None if result.ok else result.summary()


def quarantine_step(root: Path, step: int) -> Path:
    """Move `global_step_<step>` out of the step namespace into <root>/quarantine/ by one
    atomic rename, made durable; return its new path. Nothing is deleted."""
    source = step_dir(root, step)
    quarantine = root / QUARANTINE_DIRNAME
    make_dir(quarantine, exist_ok=True)
    stamp = datetime.now().strftime("%Y%m%dT%H%M%S")
    target = quarantine / f"{source.name}.{stamp}"
    suffix = 1
    while target.exists():
        suffix += 1
        target = quarantine / f"{source.name}.{stamp}.{suffix}"
    os.replace(source, target)
    # Both directories: the entry left the root and arrived in the quarantine.
    fsync_dir(quarantine)
    fsync_dir(root)
    return target


# ---- helpers -------------------------------------------------------------------------------


def _falls_back(config: CheckpointConfig) -> bool:
    return config.resume_fallback == "previous" and config.resume_mode == "auto"


def _fall_back(
    config: CheckpointConfig,
    state: RootState,
    bad: _BadStep,
    remote: RemoteCopies | None,
    fits: Callable[[Path], None] | None = None,
) -> Path:
    if remote is not None:
        replaced = _replace_from_remote(state, bad, remote)
        if replaced is not None:
            return replaced
    root = state.root
    failing = [bad]
    fallback = None
    for step in sorted((s for s in state.committed if s < bad.step), reverse=True):
        problem = step_problem(step_dir(root, step), config.resume_verify, state.keyring)
        if problem is None:
            fallback = step
            break
        failing.append(_BadStep(step, problem))
    if fallback is None:
        raise ResumeVerificationError(
            f"checkpoint.resume_fallback=previous: no committed step of {root} passes "
            f"checkpoint.resume_verify={config.resume_verify}; resume step {bad.step}: "
            f"{bad.problem}. Nothing was moved"
        )
    if fits is not None:
        # Before anything moves: a step the run's ranks cannot load refuses the start with
        # the root as it was (the tracker's step not quarantined, the tracker unchanged).
        fits(step_dir(root, fallback))
    if remote is not None:
        # Before anything moves: the run's saves from `fallback` on would be uploaded over
        # the remote tier's newer committed steps.
        remote.refuse_below(
            fallback,
            f"checkpoint.resume_fallback=previous would resume from step {fallback} (resume "
            f"step {bad.step} fails verification: {bad.problem}; nothing was moved)",
        )
    moved = [
        (failed, quarantine_step(root, failed.step))
        for failed in failing
        if step_dir(root, failed.step).is_dir()
    ]
    # After the renames (see the module docstring): no failing step is left for a
    # roll-forward to bring the tracker back to.
    write_tracker(root, fallback)
    where = "; ".join(f"step {failed.step} moved to {path}" for failed, path in moved)
    also = "".join(f"; step {failed.step} also fails: {failed.problem}" for failed in failing[1:])
    logger.warning(
        "checkpoint.resume_fallback=previous: resume step %d fails verification: %s%s; %s "
        "(kept, never deleted); the tracker now names step %d: resuming from step %d",
        bad.step,
        bad.problem,
        also,
        where or "nothing to move",
        fallback,
        fallback,
    )
    return step_dir(root, fallback)


def _replace_from_remote(state: RootState, bad: _BadStep, remote: RemoteCopies) -> Path | None:
    """The remote tier's verified copy of the failing step, in its place (the local copy
    quarantined); None when the remote tier has none that verifies (nothing moved)."""
    root = state.root
    moved: list[Path] = []

    def make_room() -> None:
        # After the download verified (a failure leaves the local copy where it was),
        # before the rename that needs its name.
        if step_dir(root, bad.step).is_dir():
            moved.append(quarantine_step(root, bad.step))

    source = remote.copy_in(bad.step, make_room)
    if source is None:
        return None
    if state.tracker != bad.step:
        write_tracker(root, bad.step)
    logger.warning(
        "checkpoint.resume_fallback=previous: resume step %d fails verification: %s; %s "
        "(kept, never deleted); replaced by the remote tier's copy %s: resuming from step %d",
        bad.step,
        bad.problem,
        f"step {bad.step} moved to {moved[0]}" if moved else "nothing to move",
        source,
        bad.step,
    )
    return step_dir(root, bad.step)
