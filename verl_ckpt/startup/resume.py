"""Which committed step a run resumes from (`checkpoint.resume_mode`), read-only."""

from __future__ import annotations

from pathlib import Path

from verl_ckpt.protocol.config import CheckpointConfig
from verl_ckpt.startup.prepare import check_root_dir, choose_resume_dir
from verl_ckpt.store.recovery import read_root_state
from verl_ckpt.store.signing import load_keyring

__all__ = ["resolve_resume_dir"]


def resolve_resume_dir(config: CheckpointConfig) -> Path | None:
    """The committed step directory a start would resume from, or None for a fresh start,
    decided exactly as `prepare_start` decides it but without locking or writing anything
    (a committed step newer than the tracker counts as the tracker's target: start-up rolls
    the tracker forward to it). Errors name the key or path (startup.choose_resume_dir).
    With checkpoint.signing, only a step whose record is signed by an accepted key counts."""
    root = Path(config.root_dir).resolve()
    check_root_dir(root)
    keyring = load_keyring(config.signing)
    return choose_resume_dir(config, read_root_state(root, keyring))
