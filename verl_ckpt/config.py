"""The `checkpoint` config group: validated dataclasses that are also Hydra structured configs.

A bad value fails when the config is turned into these objects (`to_checkpoint_config`), at
start-up, with a sentence naming the key, rather than deep inside a worker.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from verl_ckpt.errors import CheckpointConfigError

__all__ = [
    "CONTENTS",
    "CheckpointConfig",
    "RESUME_MODES",
    "RemoteConfig",
    "StagingConfig",
    "WRITER_MODES",
    "WriterConfig",
    "register_configs",
    "to_checkpoint_config",
]

CONTENTS = ("model", "optimizer", "extra")
RESUME_MODES = ("auto", "disable", "resume_path")
WRITER_MODES = ("thread", "process", "inline")


def _fail(key: str, value: Any, why: str) -> None:
    raise CheckpointConfigError(f"checkpoint.{key}={value!r} is invalid: {why}")


@dataclass
class WriterConfig:
    """How the files of a save are written."""

    # thread: a background thread pool in the rank writes; process: one persistent writer
    # process per rank (spawned, never forked) reads the snapshot from shared memory;
    # inline: the rank writes itself, inside save() (what async_save=false gives as well).
    mode: str = "thread"
    # Files written in parallel per rank (megatron-core splits a rank's shards into this many).
    threads: int = 2

    def __post_init__(self) -> None:
        if self.mode not in WRITER_MODES:
            _fail("writer.mode", self.mode, f"choose one of {', '.join(WRITER_MODES)}")
        if not isinstance(self.threads, int) or self.threads < 1:
            _fail("writer.threads", self.threads, "must be an integer >= 1")


@dataclass
class StagingConfig:
    """How the snapshot of a save is taken."""

    # Page-locked host buffers for device tensors (faster, asynchronous device-to-host copies).
    pin_memory: bool = True
    # Write host-resident tensors (an offloaded optimizer, CPU parameters) from the live
    # tensors without a copy. Safe when the trainer replaces their storage (offload/reload)
    # rather than writing into them; an in-place change before the bytes are written is
    # detected by the tensor's version counter and fails the save loudly. Ignored with
    # writer.mode=process, which can read only shared memory (those tensors are copied).
    offload_aware: bool = False


@dataclass
class RemoteConfig:
    """The remote tier: committed steps uploaded to object storage (verl_ckpt/remote/)."""

    # An fsspec URL (s3://bucket/prefix, file:///path, ...); null: no remote tier, and
    # nothing of fsspec is imported.
    url: str | None = None
    # Passed to fsspec (s3fs: endpoint_url, key, secret, client_kwargs, config_kwargs, ...);
    # the usual environment variables (AWS_*) work too.
    storage_options: dict[str, Any] = field(default_factory=dict)
    # Committed steps kept in the remote tier, independent of max_ckpt_to_keep; null: all.
    keep: int | None = None
    # Upload every Nth committed step (the last committed step of a run always).
    every: int = 1
    # Uploads per rank that may be pending at once; save() waits beyond that.
    max_in_flight: int = 1
    # Files uploaded (or downloaded) in parallel per rank.
    threads: int = 4

    def __post_init__(self) -> None:
        if self.url is not None and (not isinstance(self.url, str) or "://" not in self.url):
            _fail("remote.url", self.url, "must be an fsspec URL such as s3://bucket/prefix")
        if self.keep is not None and (not isinstance(self.keep, int) or self.keep < 1):
            _fail("remote.keep", self.keep, "must be null (keep all) or >= 1")
        for key in ("every", "max_in_flight", "threads"):
            value = getattr(self, key)
            if not isinstance(value, int) or value < 1:
                _fail(f"remote.{key}", value, "must be an integer >= 1")
        self.storage_options = dict(self.storage_options or {})


@dataclass
class CheckpointConfig:
    """Everything a trainer sets about checkpoints (Hydra group `checkpoint`)."""

    # Directory holding global_step_<N>/ and latest_checkpointed_iteration.txt.
    root_dir: str = "checkpoints"
    # Save every N training steps; 0 or a negative value disables periodic saves.
    save_freq: int = -1
    # Write in the background; false writes inside save() (same files).
    async_save: bool = True
    # Committed steps kept on disk; null keeps all.
    max_ckpt_to_keep: int | None = None
    # What each rank saves: any of model, optimizer, extra (RNG and other small state).
    save_contents: list[str] = field(default_factory=lambda: list(CONTENTS))
    # What load() restores: a subset of what was saved.
    load_contents: list[str] = field(default_factory=lambda: list(CONTENTS))
    # auto: the tracker's step, or a fresh start when there is no checkpoint at all;
    # disable: always start fresh; resume_path: the step directory in resume_from_path.
    resume_mode: str = "auto"
    # A global_step_<N> directory, used with resume_mode=resume_path.
    resume_from_path: str | None = None
    # Saves per rank whose writes may be in flight at once; save() waits beyond that.
    max_in_flight: int = 1
    # Deadline in seconds of every wait (previous write, finalizer, commit).
    timeout_s: float = 600.0
    # Re-read and checksum a step's files before load() touches any state.
    verify_checksums_on_load: bool = False
    # Reuse the save plan while the structure hash of the state is unchanged on every rank.
    assume_constant_structure: bool = True
    # Spread the writing of replicated shards over the role's data-parallel ranks instead of
    # having the first replica write them all.
    fully_parallel_save: bool = False
    writer: WriterConfig = field(default_factory=WriterConfig)
    staging: StagingConfig = field(default_factory=StagingConfig)
    remote: RemoteConfig = field(default_factory=RemoteConfig)

    def __post_init__(self) -> None:
        if not isinstance(self.root_dir, str) or not self.root_dir.strip():
            _fail("root_dir", self.root_dir, "must be a non-empty path")
        if not isinstance(self.save_freq, int):
            _fail("save_freq", self.save_freq, "must be an integer (<= 0 disables saving)")
        if self.max_ckpt_to_keep is not None and (
            not isinstance(self.max_ckpt_to_keep, int) or self.max_ckpt_to_keep < 1
        ):
            _fail(
                "max_ckpt_to_keep",
                self.max_ckpt_to_keep,
                "must be null (keep all) or >= 1; 0 would delete the only committed step",
            )
        for key in ("save_contents", "load_contents"):
            contents = list(getattr(self, key))
            unknown = [c for c in contents if c not in CONTENTS]
            if unknown or not contents:
                _fail(key, contents, f"must be a non-empty subset of {list(CONTENTS)}")
            setattr(self, key, contents)
        if self.resume_mode not in RESUME_MODES:
            _fail("resume_mode", self.resume_mode, f"choose one of {', '.join(RESUME_MODES)}")
        if self.resume_mode == "resume_path" and not self.resume_from_path:
            _fail(
                "resume_from_path",
                self.resume_from_path,
                "resume_mode=resume_path needs a global_step_<N> directory here",
            )
        if not isinstance(self.max_in_flight, int) or self.max_in_flight < 1:
            _fail("max_in_flight", self.max_in_flight, "must be an integer >= 1")
        if not (isinstance(self.timeout_s, (int, float)) and 0 < self.timeout_s < math.inf):
            _fail("timeout_s", self.timeout_s, "must be a positive number of seconds")
        if isinstance(self.writer, dict):
            self.writer = WriterConfig(**self.writer)
        if isinstance(self.staging, dict):
            self.staging = StagingConfig(**self.staging)
        if isinstance(self.remote, dict):
            self.remote = RemoteConfig(**self.remote)

    @property
    def writes_in_background(self) -> bool:
        return self.async_save and self.writer.mode != "inline"


def to_checkpoint_config(cfg: Any) -> CheckpointConfig:
    """Build a validated CheckpointConfig from a dataclass, a dict or an OmegaConf node.

    OmegaConf checks the types (a string where an integer belongs fails naming the key);
    `__post_init__` then checks the values.
    """
    if isinstance(cfg, CheckpointConfig):
        return cfg
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    try:
        merged = OmegaConf.merge(OmegaConf.structured(CheckpointConfig), cfg)
        return OmegaConf.to_object(merged)
    except OmegaConfBaseException as exc:
        # The message of OmegaConf names the full key and the offending value.
        raise CheckpointConfigError(f"invalid checkpoint config: {exc}") from None


def register_configs() -> None:
    """Register the schema as `checkpoint/base_checkpoint` in Hydra's ConfigStore.

    The YAML presets in configs/checkpoint/ list it first in their defaults, so Hydra checks
    every override against these types.
    """
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(group="checkpoint", name="base_checkpoint", node=CheckpointConfig)
