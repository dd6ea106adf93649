"""verl_ckpt: asynchronous, committed checkpoints for Megatron ranks in Ray actors.

Users import from here only:
- driver: `CheckpointCoordinator` (starts the finalizer, saves the driver's state, waits for
  commits, resolves the resume step);
- each rank: `CheckpointManager` (save / wait / load / close);
- config: `CheckpointConfig` and friends, `register_configs()` for Hydra.
"""

from verl_ckpt.commit_record import CommitRecord, read_commit_record
from verl_ckpt.config import (
    CheckpointConfig,
    StagingConfig,
    WriterConfig,
    register_configs,
    to_checkpoint_config,
)
from verl_ckpt.driver import CheckpointCoordinator
from verl_ckpt.errors import (
    CheckpointConfigError,
    CheckpointError,
    CheckpointWriteError,
    CommitRecordError,
    CommitTimeoutError,
    StepNotCommittedError,
    TrackerError,
)
from verl_ckpt.layout import TRACKER_FILENAME, step_dir
from verl_ckpt.manager import CheckpointManager, SaveStats
from verl_ckpt.resume import resolve_resume_dir
from verl_ckpt.tracker import read_tracker

__all__ = [
    "TRACKER_FILENAME",
    "CheckpointConfig",
    "CheckpointConfigError",
    "CheckpointCoordinator",
    "CheckpointError",
    "CheckpointManager",
    "CheckpointWriteError",
    "CommitRecord",
    "CommitRecordError",
    "CommitTimeoutError",
    "SaveStats",
    "StagingConfig",
    "StepNotCommittedError",
    "TrackerError",
    "WriterConfig",
    "read_commit_record",
    "read_tracker",
    "register_configs",
    "resolve_resume_dir",
    "step_dir",
    "to_checkpoint_config",
]
