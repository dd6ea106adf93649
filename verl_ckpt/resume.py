"""Which committed step a run resumes from (`checkpoint.resume_mode`)."""

from __future__ import annotations

import logging
from pathlib import Path

from verl_ckpt.commit_record import read_commit_record
from verl_ckpt.config import CheckpointConfig
from verl_ckpt.errors import CommitRecordError, TrackerError
from verl_ckpt.layout import list_step_dirs, step_dir, step_of_dir
from verl_ckpt.tracker import read_tracker, tracker_path

__all__ = ["resolve_resume_dir"]

logger = logging.getLogger(__name__)


def resolve_resume_dir(config: CheckpointConfig) -> Path | None:
    """The committed step directory to resume from, or None for a fresh start.

    auto: the tracker's step; a fresh start only when the root holds no checkpoint at all.
    A tracker naming a missing or uncommitted step, or step directories without a tracker,
    are errors naming the path, never a silent fresh start.
    """
    if config.resume_mode == "disable":
        return None
    if config.resume_mode == "resume_path":
        path = Path(config.resume_from_path)
        if step_of_dir(path) is None:
            raise CommitRecordError(
                f"checkpoint.resume_from_path={str(path)!r} is not a global_step_<N> directory"
            )
        read_commit_record(path)
        return path
    root = Path(config.root_dir)
    if root.exists() and not root.is_dir():
        raise TrackerError(f"checkpoint.root_dir {root} exists but is not a directory")
    step = read_tracker(root)
    if step is None:
        leftovers = sorted(list_step_dirs(root))
        if leftovers:
            raise TrackerError(
                f"{tracker_path(root)} is missing but {root} holds step directories "
                f"{leftovers}; set checkpoint.resume_mode=resume_path with "
                "checkpoint.resume_from_path to pick one, or resume_mode=disable"
            )
        logger.info("no checkpoint under %s: starting fresh", root)
        return None
    path = step_dir(root, step)
    if not path.is_dir():
        raise TrackerError(f"{tracker_path(root)} names step {step}, but {path} does not exist")
    try:
        read_commit_record(path)
    except CommitRecordError as exc:
        raise TrackerError(
            f"{tracker_path(root)} names step {step}, which is unusable: {exc}"
        ) from None
    return path
