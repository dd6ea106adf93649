"""verl_ckpt: asynchronous, committed checkpoints for Megatron ranks in Ray actors.

Users import from here only:
- driver: `prepare_start` (before Ray starts: checks the config and root, locks the root,
  recovers it, decides the resume step), `CheckpointCoordinator` (starts the finalizer, saves
  the driver's state, waits for commits);
- each rank: `CheckpointManager` (save / wait / load / close), `describe_gpt_model` (the
  model description saved with each step, for Hugging Face exports);
- Hugging Face weights: `export_role`, `verify_export`, mappings (`HFMapping`, `TensorRule`,
  `register_mapping`);
- config: `CheckpointConfig` and friends (`RemoteConfig`: the remote tier on object storage,
  verl_ckpt/remote/), `register_configs()` for Hydra.
The order of a save, step by step, is on one page: verl_ckpt/protocol.py.
"""

import importlib
from typing import Any

# Where each public name lives. Imported on first use (PEP 562), so that light users such
# as the verl-ckpt CLI do not pay for importing ray, torch and megatron-core.
_EXPORTS = {
    "CommitRecord": "verl_ckpt.commit_record",
    "read_commit_record": "verl_ckpt.commit_record",
    "CheckpointConfig": "verl_ckpt.config",
    "HFExportConfig": "verl_ckpt.config",
    "PreemptionConfig": "verl_ckpt.config",
    "RemoteConfig": "verl_ckpt.config",
    "StagingConfig": "verl_ckpt.config",
    "WriterConfig": "verl_ckpt.config",
    "register_configs": "verl_ckpt.config",
    "to_checkpoint_config": "verl_ckpt.config",
    "CheckpointCoordinator": "verl_ckpt.driver",
    "CheckpointConfigError": "verl_ckpt.errors",
    "CheckpointError": "verl_ckpt.errors",
    "CheckpointWriteError": "verl_ckpt.errors",
    "CommitRecordError": "verl_ckpt.errors",
    "CommitTimeoutError": "verl_ckpt.errors",
    "PreemptionError": "verl_ckpt.errors",
    "ResumeVerificationError": "verl_ckpt.errors",
    "ResumeConflictError": "verl_ckpt.errors",
    "RootLockedError": "verl_ckpt.errors",
    "StepNotCommittedError": "verl_ckpt.errors",
    "TrackerError": "verl_ckpt.errors",
    "ExportSummary": "verl_ckpt.hf.export",
    "export_role": "verl_ckpt.hf.export",
    "HFMapping": "verl_ckpt.hf.mapping",
    "TensorRule": "verl_ckpt.hf.mapping",
    "UnsupportedModelError": "verl_ckpt.hf.mapping",
    "register_mapping": "verl_ckpt.hf.mapping",
    "describe_gpt_model": "verl_ckpt.hf.model_spec",
    "verify_export": "verl_ckpt.hf.record",
    "TRACKER_FILENAME": "verl_ckpt.layout",
    "step_dir": "verl_ckpt.layout",
    "LoadStats": "verl_ckpt.load_stats",
    "CheckpointManager": "verl_ckpt.manager",
    "SaveStats": "verl_ckpt.manager",
    "PREEMPTED_EXIT_STATUS": "verl_ckpt.preemption",
    "PreemptionGuard": "verl_ckpt.preemption",
    "StopRequest": "verl_ckpt.preemption",
    "commit_before_deadline": "verl_ckpt.preemption",
    "preemption_failure": "verl_ckpt.preemption",
    "wait_before_deadline": "verl_ckpt.preemption",
    "resolve_resume_dir": "verl_ckpt.resume",
    "StartPlan": "verl_ckpt.startup",
    "StepVerification": "verl_ckpt.verification",
    "verify_step": "verl_ckpt.verification",
    "prepare_start": "verl_ckpt.startup",
    "read_tracker": "verl_ckpt.tracker",
}

__all__ = [
    "PREEMPTED_EXIT_STATUS",
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
    "ExportSummary",
    "HFExportConfig",
    "HFMapping",
    "LoadStats",
    "PreemptionConfig",
    "PreemptionError",
    "PreemptionGuard",
    "RemoteConfig",
    "ResumeConflictError",
    "ResumeVerificationError",
    "RootLockedError",
    "SaveStats",
    "StagingConfig",
    "StartPlan",
    "StepNotCommittedError",
    "TensorRule",
    "StepVerification",
    "StopRequest",
    "TrackerError",
    "UnsupportedModelError",
    "WriterConfig",
    "describe_gpt_model",
    "export_role",
    "commit_before_deadline",
    "preemption_failure",
    "read_commit_record",
    "prepare_start",
    "read_tracker",
    "register_configs",
    "register_mapping",
    "resolve_resume_dir",
    "step_dir",
    "to_checkpoint_config",
    "verify_export",
    "verify_step",
    "wait_before_deadline",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'verl_ckpt' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
