"""Exceptions raised by verl_ckpt.

Every error a user can cause names the path, key, role or rank involved, so that the
message alone says what to fix.
"""

from __future__ import annotations

__all__ = [
    "CheckpointError",
    "CheckpointConfigError",
    "CheckpointWriteError",
    "CommitRecordError",
    "CommitTimeoutError",
    "PreemptionError",
    "ResumeConflictError",
    "ResumeVerificationError",
    "RootLockedError",
    "SignatureError",
    "StepNotCommittedError",
    "TrackerError",
    "UnsafeCheckpointError",
]


class CheckpointError(RuntimeError):
    """Base class of every error raised by verl_ckpt."""


class CheckpointConfigError(CheckpointError, ValueError):
    """A configuration value is invalid; the message names the key."""


class TrackerError(CheckpointError):
    """`latest_checkpointed_iteration.txt` is unreadable or names an unusable step."""


class CommitRecordError(CheckpointError):
    """A step's commit record is missing, corrupt or of an unknown format version."""


class CheckpointWriteError(CheckpointError):
    """A background write of this rank failed; raised once, on the next save() or wait()."""


class CommitTimeoutError(CheckpointError, TimeoutError):
    """A deadline passed before a step committed; the message names who is missing."""


class StepNotCommittedError(CheckpointError):
    """A step will never commit (a participant failed, or its reports were lost)."""


class RootLockedError(CheckpointError):
    """Another job (or `verl-ckpt` command) holds the checkpoint root; names the holder."""


class ResumeConflictError(CheckpointError):
    """The resume step is older than a committed step of the same root: the run's saves would
    collide with committed steps. The message names them and the two ways out."""


class ResumeVerificationError(CommitRecordError):
    """The resume step fails start-up verification (`checkpoint.resume_verify`): a file is
    missing, truncated or fails its checksum, or the record is unusable. Names the file."""


class PreemptionError(CheckpointError):
    """An out-of-schedule save on preemption did not commit within
    `checkpoint.preemption.grace_s`; names who is missing. The previous committed step stays."""


class UnsafeCheckpointError(CheckpointError):
    """A checkpoint file would run code, or build objects that verl_ckpt never saves, if it
    were unpickled: it is refused unread. Names the file and what it asked for. Whoever can
    write a root or a bucket can plant such a file; nothing from a checkpoint is trusted."""


class SignatureError(CommitRecordError):
    """With `checkpoint.signing` configured, a step's commit record is unsigned or signed
    with a key not accepted: the step is refused before any other file of it is read. Names
    the step and the record, never a key or a MAC (store/signing.py)."""

    # In a few words: "unsigned", "signed with another key (...)" (`verl-ckpt ls` shows it).
    reason: str = ""
