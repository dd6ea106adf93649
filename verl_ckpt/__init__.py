"""verl_ckpt: asynchronous, committed checkpoints for Megatron ranks in Ray actors.

Users import from here only:
- driver: `prepare_start` (before Ray starts: checks the config and root, locks the root,
  recovers it, decides the resume step), `CheckpointCoordinator` (starts the finalizer, saves
  the driver's state, waits for commits);
- any other Ray actor with state of the step (a rollout worker, a replay buffer):
  `StateParticipant` (save / skip / wait / load, from the coordinator's
  `participant_handle`), `load_participant_state`;
- each rank: `CheckpointManager` (save / wait / load / close), `describe_gpt_model` (the
  model description saved with each step, for Hugging Face exports);
- Hugging Face weights: `export_role`, `verify_export`, mappings (`HFMapping`, `TensorRule`,
  `register_mapping`);
- config: `CheckpointConfig` and friends (`RemoteConfig`: the remote tier on object storage,
  verl_ckpt/remote/), `register_configs()` for Hydra.
The order of a save, step by step, is on one page: verl_ckpt/protocol/__init__.py.
"""

import importlib
from typing import Any

# Where each public name lives. Imported on first use (PEP 562), so that light users such
# as the verl-ckpt CLI do not pay for importing ray, torch and megatron-core.
_EXPORTS = {
    "CommitRecord": "verl_ckpt.store.commit_record",
    "read_commit_record": "verl_ckpt.store.commit_record",
    "CheckpointConfig": "verl_ckpt.protocol.config",
    "HFExportConfig": "verl_ckpt.protocol.config",
    "PreemptionConfig": "verl_ckpt.protocol.config",
    "RemoteConfig": "verl_ckpt.protocol.config",
    "StagingConfig": "verl_ckpt.protocol.config",
    "WriterConfig": "verl_ckpt.protocol.config",
    "register_configs": "verl_ckpt.protocol.config",
    "to_checkpoint_config": "verl_ckpt.protocol.config",
    "unknown_keys": "verl_ckpt.protocol.config_keys",
    "CheckpointCoordinator": "verl_ckpt.driver.coordinator",
    "ParticipantHandle": "verl_ckpt.commit.participant_handle",
    "StateParticipant": "verl_ckpt.participants.saver",
    "load_participant_state": "verl_ckpt.participants.loader",
    "CheckpointConfigError": "verl_ckpt.protocol.errors",
    "CheckpointError": "verl_ckpt.protocol.errors",
    "CheckpointWriteError": "verl_ckpt.protocol.errors",
    "CommitRecordError": "verl_ckpt.protocol.errors",
    "CommitTimeoutError": "verl_ckpt.protocol.errors",
    "PreemptionError": "verl_ckpt.protocol.errors",
    "ResumeVerificationError": "verl_ckpt.protocol.errors",
    "ResumeConflictError": "verl_ckpt.protocol.errors",
    "RootLockedError": "verl_ckpt.protocol.errors",
    "StepNotCommittedError": "verl_ckpt.protocol.errors",
    "TrackerError": "verl_ckpt.protocol.errors",
    "ExportSummary": "verl_ckpt.hf.export",
    "export_role": "verl_ckpt.hf.export",
    "HFMapping": "verl_ckpt.hf.mapping",
    "TensorRule": "verl_ckpt.hf.mapping",
    "UnsupportedModelError": "verl_ckpt.hf.mapping",
    "register_mapping": "verl_ckpt.hf.mapping",
    "describe_gpt_model": "verl_ckpt.hf.model_spec",
    "verify_export": "verl_ckpt.hf.record",
    "TRACKER_FILENAME": "verl_ckpt.store.layout",
    "step_dir": "verl_ckpt.store.layout",
    "step_of_dir": "verl_ckpt.store.layout",
    "LoadStats": "verl_ckpt.format.load_stats",
    "CheckpointManager": "verl_ckpt.rank.manager",
    "SaveStats": "verl_ckpt.rank.manager",
    "PREEMPTED_EXIT_STATUS": "verl_ckpt.driver.preemption",
    "PreemptionGuard": "verl_ckpt.driver.preemption",
    "StopRequest": "verl_ckpt.driver.preemption",
    "commit_before_deadline": "verl_ckpt.driver.preemption",
    "preemption_failure": "verl_ckpt.driver.preemption",
    "wait_before_deadline": "verl_ckpt.driver.preemption",
    "resolve_resume_dir": "verl_ckpt.startup.resume",
    "StartPlan": "verl_ckpt.startup.prepare",
    "StepVerification": "verl_ckpt.store.verification",
    "verify_step": "verl_ckpt.store.verification",
    "prepare_start": "verl_ckpt.startup.prepare",
    "read_tracker": "verl_ckpt.store.tracker",
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
    "ParticipantHandle",
    "PreemptionConfig",
    "PreemptionError",
    "PreemptionGuard",
    "RemoteConfig",
    "ResumeConflictError",
    "ResumeVerificationError",
    "RootLockedError",
    "SaveStats",
    "StagingConfig",
    "StateParticipant",
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
    "load_participant_state",
    "commit_before_deadline",
    "preemption_failure",
    "read_commit_record",
    "prepare_start",
    "read_tracker",
    "register_configs",
    "register_mapping",
    "resolve_resume_dir",
    "step_dir",
    "step_of_dir",
    "to_checkpoint_config",
    "unknown_keys",
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
