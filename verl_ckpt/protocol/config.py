"""The `checkpoint` config group: validated dataclasses that are also Hydra structured configs.

A bad value fails when the config is turned into these objects (`to_checkpoint_config`), at
start-up, with a sentence naming the key, rather than deep inside a worker.
"""

from __future__ import annotations

import math
import os
import signal
from dataclasses import dataclass, field
from typing import Any

from verl_ckpt.protocol.config_keys import build_config
from verl_ckpt.protocol.errors import CheckpointConfigError
from verl_ckpt.protocol.redaction import has_password, password_url_key

__all__ = [
    "CONTENTS",
    "DEFAULT_EARLY_WRITEBACK_MB",
    "CheckpointConfig",
    "HF_MODEL",
    "HFExportConfig",
    "PreemptionConfig",
    "RESUME_FALLBACKS",
    "RESUME_MODES",
    "RESUME_VERIFY_MODES",
    "SAVE_CONTENTS",
    "REPORT_BATCHING",
    "SNAPSHOT_MODES",
    "RemoteConfig",
    "SigningConfig",
    "StagingConfig",
    "WRITER_MODES",
    "WriterConfig",
    "check_deadline_env",
    "register_configs",
    "to_checkpoint_config",
]

CONTENTS = ("model", "optimizer", "extra")
# Not written by the ranks: the Hugging Face weights of a role, exported from its committed
# model after the step commits (verl_ckpt/hf/). Allowed in save_contents only.
HF_MODEL = "hf_model"
SAVE_CONTENTS = (*CONTENTS, HF_MODEL)
RESUME_MODES = ("auto", "disable", "resume_path")
SNAPSHOT_MODES = ("now", "deferred", "live")
REPORT_BATCHING = ("auto", "node", "off")
WRITER_MODES = ("thread", "process", "inline")
RESUME_VERIFY_MODES = ("record", "checksums")
RESUME_FALLBACKS = ("error", "previous")
# Signals that cannot be caught, or that stop the process before any handler runs.
_UNCATCHABLE_SIGNALS = ("SIGKILL", "SIGSTOP")
# Signals that are no request to stop: sent in normal running (a child's exit, a terminal
# resized, a closed pipe, a profiler's timer, a stopped job continued), each of which would
# then save and exit, or raised by a fault of the faulting thread itself, whose handler
# (which only sets a flag) would return to the faulting instruction.
_NOT_A_STOP_REQUEST = {
    **dict.fromkeys(
        ("SIGCHLD", "SIGCLD", "SIGWINCH", "SIGURG", "SIGPIPE", "SIGCONT", "SIGIO", "SIGPOLL"),
        "is sent in normal running",
    ),
    **dict.fromkeys(("SIGPROF", "SIGVTALRM"), "is a profiler's timer"),
    **dict.fromkeys(
        ("SIGSEGV", "SIGBUS", "SIGFPE", "SIGILL", "SIGTRAP", "SIGSYS", "SIGABRT"),
        "reports a fault of the process itself",
    ),
}
_NOT_A_STOP_REQUEST_BY_NUMBER = {
    signal.Signals[name]: why
    for name, why in _NOT_A_STOP_REQUEST.items()
    if name in signal.Signals.__members__
}


def _fail(key: str, value: Any, why: str) -> None:
    raise CheckpointConfigError(f"checkpoint.{key}={value!r} is invalid: {why}")


# The writers' early-writeback interval (WriterConfig.early_writeback_mb; fsio.WRITEBACK_EVERY):
# the disk starts sooner and the final fsync finds less left (benchmarks/README.md).
DEFAULT_EARLY_WRITEBACK_MB = 4


@dataclass
class WriterConfig:
    """How the files of a save are written."""

    # thread: a background thread pool in the rank writes; process: one persistent writer
    # process per rank (spawned, never forked) reads the snapshot from shared memory;
    # inline: the rank writes itself, inside save() (what async_save=false gives as well).
    mode: str = "thread"
    # Files written in parallel per rank (megatron-core splits a rank's shards into this many).
    threads: int = 2
    # CPU niceness of the writer threads (per thread, on Linux) and of the writer process,
    # 0 to 19: the background write yields the cores to the training thread. Their I/O is
    # lowered to the best-effort class's lowest level as well when this is above 0.
    nice: int = 10
    # A file being written hands its new bytes to the disk every this many MiB (Linux
    # sync_file_range, made on a helper thread: the writer never waits for the disk's queue):
    # the disk writes while later tensors are serialised, and the fsync at the end finds
    # little left. 0 leaves it all to the final fsync.
    early_writeback_mb: int = DEFAULT_EARLY_WRITEBACK_MB
    # true: a save whose plan is reused starts writing its files while save() still copies
    # the state, each tensor as soon as its own copy ended, so the disk works during the
    # copy: durable sooner, but the writes compete with the copy for the cores and memory
    # bandwidth, and save() blocks longer (benchmarks/results.md). false: the write starts
    # once the whole copy ended. The writer process always waits for the whole copy.
    write_while_copying: bool = False
    # true: the files of a save are written around the page cache (Linux O_DIRECT, through an
    # aligned buffer) where the filesystem allows it, else through it as with false: the
    # trainer's next steps then do not compete with the kernel's copying, writeback and
    # reclaim of the save's pages (benchmarks/README.md). false: through the page cache,
    # with early_writeback_mb (for a filesystem where O_DIRECT is slow, a network one).
    direct_io: bool = True
    # true: the writer threads (and the writer process's) run in Linux's SCHED_IDLE class,
    # on cores nothing else wants, so that the trainer's steps beside a save's write keep
    # their cores; a thread that waited 0.5 s in all for a core while writing a file goes on
    # at `nice` (a save is never starved). Where the process may not leave that class again (no
    # CAP_SYS_NICE and RLIMIT_NICE of 0), the threads just run at `nice`. false: at `nice`.
    idle_class: bool = True

    def __post_init__(self) -> None:
        if self.mode not in WRITER_MODES:
            _fail("writer.mode", self.mode, f"choose one of {', '.join(WRITER_MODES)}")
        if not isinstance(self.threads, int) or self.threads < 1:
            _fail("writer.threads", self.threads, "must be an integer >= 1")
        if not isinstance(self.nice, int) or not 0 <= self.nice <= 19:
            _fail("writer.nice", self.nice, "must be an integer from 0 (off) to 19")
        if not isinstance(self.early_writeback_mb, int) or self.early_writeback_mb < 0:
            _fail("writer.early_writeback_mb", self.early_writeback_mb, "must be an integer >= 0")
        if not isinstance(self.write_while_copying, bool):
            _fail("writer.write_while_copying", self.write_while_copying, "must be true or false")
        if not isinstance(self.direct_io, bool):
            _fail("writer.direct_io", self.direct_io, "must be true or false")
        if not isinstance(self.idle_class, bool):
            _fail("writer.idle_class", self.idle_class, "must be true or false")

    @property
    def writeback_every(self) -> int:
        """early_writeback_mb in bytes (0: off)."""
        return self.early_writeback_mb << 20


@dataclass
class StagingConfig:
    """How the snapshot of a save is taken."""

    # Page-locked host buffers for device tensors (faster, asynchronous device-to-host copies).
    pin_memory: bool = True
    # Write host-resident optimizer state (an offloaded optimizer's) from the live tensors
    # without a copy; parameters, updated in place at every step, are still copied. Safe
    # when the trainer replaces that state's storage (offload/reload) rather than writing
    # into it; an in-place change before the bytes are written is detected by the tensor's
    # version counter and fails the save loudly. Ignored with writer.mode=process, which
    # can read only shared memory (those tensors are copied).
    offload_aware: bool = False


@dataclass
class HFExportConfig:
    """Hugging Face weights of roles, exported after each commit when save_contents has
    hf_model (verl_ckpt/hf/). `verl-ckpt export` writes them for any committed step."""

    # Role -> the mapping that converts its model (built in: gpt2; more through the
    # `verl_ckpt.hf_mappings` entry point group). A role not listed is skipped, logged once.
    architectures: dict[str, str] = field(default_factory=dict)
    # Largest safetensors file; bigger models are split into shards with an index.
    max_shard_mb: int = 2048

    def __post_init__(self) -> None:
        for role, name in dict(self.architectures).items():
            if not isinstance(name, str) or not name.strip():
                _fail(f"hf_export.architectures.{role}", name, "must name a mapping, e.g. gpt2")
        if not isinstance(self.max_shard_mb, int) or self.max_shard_mb < 1:
            _fail("hf_export.max_shard_mb", self.max_shard_mb, "must be an integer >= 1")


@dataclass
class PreemptionConfig:
    """When the driver takes an out-of-schedule save and exits (verl_ckpt.driver.preemption)."""

    # Signals that ask for a save at the next step boundary and an exit with status 75
    # (EX_TEMPFAIL); the handler only sets a flag. An empty list turns signal handling off.
    signals: list[str] = field(default_factory=lambda: ["SIGTERM", "SIGUSR1"])
    # Seconds from the signal (or the deadline decision) within which the save must commit;
    # past it the run stops with an error naming who is missing.
    grace_s: float = 60.0
    # Name of an environment variable holding the Unix time at which the job will be stopped
    # (a capacity-block expiry, the shape of verl's ESI variables); null: none.
    deadline_env: str | None = None
    # Slack added to the measured step and save durations when judging that deadline.
    margin_s: float = 60.0

    def __post_init__(self) -> None:
        signals = list(self.signals)
        for name in signals:
            if not isinstance(name, str) or name not in signal.Signals.__members__:
                _fail(
                    "preemption.signals",
                    signals,
                    f"{name!r} is not a signal name of this platform (e.g. SIGTERM, SIGUSR1)",
                )
            if name in _UNCATCHABLE_SIGNALS:
                _fail("preemption.signals", signals, f"{name} cannot be caught by any process")
            # By number: an alias (SIGIOT is SIGABRT, SIGCLD SIGCHLD) is the same signal.
            why = _NOT_A_STOP_REQUEST_BY_NUMBER.get(signal.Signals[name])
            if why is not None:
                _fail(
                    "preemption.signals",
                    signals,
                    f"{name} {why}, not a request to stop (schedulers send SIGTERM, or "
                    "SIGUSR1 or SIGUSR2 as asked)",
                )
        self.signals = list(dict.fromkeys(signals))
        if not (isinstance(self.grace_s, (int, float)) and 0 < self.grace_s < math.inf):
            _fail("preemption.grace_s", self.grace_s, "must be a positive number of seconds")
        if self.deadline_env is not None and (
            not isinstance(self.deadline_env, str)
            or not self.deadline_env
            or "=" in self.deadline_env
            or "\0" in self.deadline_env
        ):
            _fail("preemption.deadline_env", self.deadline_env, "must name an environment variable")
        if not (isinstance(self.margin_s, (int, float)) and 0 <= self.margin_s < math.inf):
            _fail("preemption.margin_s", self.margin_s, "must be a number of seconds >= 0")


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
        # Refused, not used: a URL is shown in logs, errors and records, its password with it.
        option = password_url_key(self.storage_options or {})
        key = "remote.url" if isinstance(self.url, str) and has_password(self.url) else None
        key = key or (f"remote.storage_options.{option}" if option is not None else None)
        if key is not None:
            raise CheckpointConfigError(
                f"checkpoint.{key} is invalid: a URL that holds a password (user:password@); "
                "give credentials in checkpoint.remote.storage_options or the environment, "
                "never in a URL"
            )
        if self.keep is not None and (not isinstance(self.keep, int) or self.keep < 1):
            _fail("remote.keep", self.keep, "must be null (keep all) or >= 1")
        for key in ("every", "max_in_flight", "threads"):
            value = getattr(self, key)
            if not isinstance(value, int) or value < 1:
                _fail(f"remote.{key}", value, "must be an integer >= 1")
        self.storage_options = dict(self.storage_options or {})


@dataclass
class SigningConfig:
    """Signed commit records (store/signing.py, docs/signing.md): where the keys are, never
    a key itself. The first key signs every record the finalizer writes; every key listed
    verifies (rotation). With none, records are neither signed nor checked."""

    # A file whose bytes (surrounding whitespace stripped) are the signing key.
    key_file: str | None = None
    # The NAME of an environment variable holding the signing key (instead of key_file).
    key_env: str | None = None
    # More keys accepted when reading (older keys, during a rotation): files, variable names.
    accepted_key_files: list[str] = field(default_factory=list)
    accepted_key_envs: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.key_file is not None and self.key_env is not None:
            _fail("signing.key_env", self.key_env, "give key_file or key_env, not both")
        self.accepted_key_files = list(self.accepted_key_files or [])
        self.accepted_key_envs = list(self.accepted_key_envs or [])
        if not self.enabled and (self.accepted_key_files or self.accepted_key_envs):
            _fail(
                "signing.accepted_key_files",
                self.accepted_key_files or self.accepted_key_envs,
                "accepted keys need the key that signs: set signing.key_file or signing.key_env",
            )
        for key, names in (
            ("key_env", [self.key_env]),
            ("accepted_key_envs", self.accepted_key_envs),
        ):
            for name in names:
                if name is not None and (not isinstance(name, str) or not name.isidentifier()):
                    _fail(f"signing.{key}", name, "must name an environment variable")
        for key, paths in (
            ("key_file", [self.key_file]),
            ("accepted_key_files", self.accepted_key_files),
        ):
            for path in paths:
                if path is not None and (not isinstance(path, str) or not path or "\0" in path):
                    _fail(f"signing.{key}", path, "must be a path")

    @property
    def enabled(self) -> bool:
        return self.key_file is not None or self.key_env is not None


@dataclass
class CheckpointConfig:
    """Everything a trainer sets about checkpoints (Hydra group `checkpoint`)."""

    # Directory holding global_step_<N>/ and latest_checkpointed_iteration.txt.
    root_dir: str = "checkpoints"
    # Save every N training steps; 0 or a negative value disables periodic saves.
    save_freq: int = -1
    # Write in the background; false writes inside save() (same files).
    async_save: bool = True
    # now: save() returns once the state is copied. deferred: save() returns before the copy,
    # which runs in the background; the trainer must call manager.fence() (or register
    # manager.fence_before(optimizer)) before it next changes the state. For the RL idle
    # window: rollout and log-prob passes read the state without changing it. live: as
    # deferred, but host tensors are written from the trainer's memory without a copy, and
    # the fence waits until they are written (device tensors are copied, as deferred).
    snapshot: str = "now"
    # Committed steps kept on disk; null keeps all.
    max_ckpt_to_keep: int | None = None
    # What each rank saves: any of model, optimizer, extra (RNG and other small state); and
    # hf_model: Hugging Face weights of the roles in hf_export.architectures, exported in the
    # background after the step commits.
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
    # What start-up checks of the resume step, before Ray starts: record (its commit record,
    # and every file present with its recorded size) or checksums (every file re-hashed, in
    # parallel on every core).
    resume_verify: str = "record"
    # A resume step (resume_mode=auto) that fails that check: error (one line naming the
    # file) or previous (moved into <root>/quarantine/, never deleted; the run resumes from
    # the newest older committed step that passes, with a warning naming the bad file).
    resume_fallback: str = "error"
    # Reuse the save plan while the structure of the state is unchanged on every rank.
    assume_constant_structure: bool = True
    # Spread the writing of replicated shards over the role's data-parallel ranks instead of
    # having the first replica write them all.
    fully_parallel_save: bool = False
    # How ranks begin and report a step with the finalizer: node (the begins, and the
    # reports, of a node's ranks go as one call each, through a small aggregator actor per
    # node: commit/aggregator.py), off (one call per rank), auto (node for a role of 64 ranks
    # or more).
    report_batching: str = "auto"
    # With report batching, a role of more than this many ranks also batches its nodes'
    # begins and reports per group of this many ranks (a small aggregator actor per group), so that
    # the finalizer takes one call per group; 0: one call per node.
    report_group_size: int = 128
    writer: WriterConfig = field(default_factory=WriterConfig)
    staging: StagingConfig = field(default_factory=StagingConfig)
    hf_export: HFExportConfig = field(default_factory=HFExportConfig)
    preemption: PreemptionConfig = field(default_factory=PreemptionConfig)
    remote: RemoteConfig = field(default_factory=RemoteConfig)
    signing: SigningConfig = field(default_factory=SigningConfig)

    def __post_init__(self) -> None:
        if not isinstance(self.root_dir, str) or not self.root_dir.strip():
            _fail("root_dir", self.root_dir, "must be a non-empty path")
        for key in ("root_dir", "resume_from_path"):
            # No filesystem call takes one: it would fail later as a bare ValueError.
            if "\0" in str(getattr(self, key) or ""):
                _fail(key, getattr(self, key), "is no path: it holds a NUL byte")
            if isinstance(getattr(self, key), str):
                # "~/ckpt" made a directory named "~" in the working directory (signing's
                # key files were already expanded so).
                setattr(self, key, os.path.expanduser(getattr(self, key)))
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
        for key, allowed in (("save_contents", SAVE_CONTENTS), ("load_contents", CONTENTS)):
            contents = list(getattr(self, key))
            unknown = [c for c in contents if c not in allowed]
            if unknown or not contents:
                _fail(key, contents, f"must be a non-empty subset of {list(allowed)}")
            setattr(self, key, contents)
        if self.snapshot not in SNAPSHOT_MODES:
            _fail("snapshot", self.snapshot, f"choose one of {', '.join(SNAPSHOT_MODES)}")
        if HF_MODEL in self.save_contents and "model" not in self.save_contents:
            _fail("save_contents", self.save_contents, "hf_model is exported from the saved model")
        if self.resume_mode not in RESUME_MODES:
            _fail("resume_mode", self.resume_mode, f"choose one of {', '.join(RESUME_MODES)}")
        if self.resume_mode == "resume_path" and not self.resume_from_path:
            _fail(
                "resume_from_path",
                self.resume_from_path,
                "resume_mode=resume_path needs a global_step_<N> directory here",
            )
        if self.resume_from_path and self.resume_mode != "resume_path":
            # Ignored otherwise: the run would start from the tracker's step (or afresh) while
            # its user believes it resumed from this one.
            _fail(
                "resume_from_path",
                self.resume_from_path,
                f"only resume_mode=resume_path reads it, and resume_mode={self.resume_mode} "
                "would ignore it: set checkpoint.resume_mode=resume_path, or leave it null",
            )
        if not isinstance(self.max_in_flight, int) or self.max_in_flight < 1:
            _fail("max_in_flight", self.max_in_flight, "must be an integer >= 1")
        if not (isinstance(self.timeout_s, (int, float)) and 0 < self.timeout_s < math.inf):
            _fail("timeout_s", self.timeout_s, "must be a positive number of seconds")
        if isinstance(self.writer, dict):
            self.writer = WriterConfig(**self.writer)
        if isinstance(self.staging, dict):
            self.staging = StagingConfig(**self.staging)
        if self.writer.write_while_copying and not (
            self.async_save and self.writer.mode == "thread"
        ):
            # Ignored otherwise: the writer process and a synchronous save write once the
            # whole copy ended.
            _fail(
                "writer.write_while_copying",
                True,
                "needs the thread writer (async_save=true and writer.mode=thread)",
            )
        if self.snapshot != "now" and not self.writes_in_background:
            _fail(
                "snapshot",
                self.snapshot,
                "needs a background writer (async_save=true and writer.mode thread or process)",
            )
        if isinstance(self.hf_export, dict):
            self.hf_export = HFExportConfig(**self.hf_export)
        if self.report_batching not in REPORT_BATCHING:
            _fail("report_batching", self.report_batching, "choose auto, node or off")
        if (
            not isinstance(self.report_group_size, int)
            or isinstance(self.report_group_size, bool)
            or self.report_group_size < 0
        ):
            _fail("report_group_size", self.report_group_size, "must be an integer >= 0")
        if self.resume_verify not in RESUME_VERIFY_MODES:
            _fail("resume_verify", self.resume_verify, "choose record or checksums")
        if self.resume_fallback not in RESUME_FALLBACKS:
            _fail("resume_fallback", self.resume_fallback, "choose error or previous")
        if isinstance(self.preemption, dict):
            self.preemption = PreemptionConfig(**self.preemption)
        if isinstance(self.remote, dict):
            self.remote = RemoteConfig(**self.remote)
        if isinstance(self.signing, dict):
            self.signing = SigningConfig(**self.signing)

    @property
    def writes_in_background(self) -> bool:
        return self.async_save and self.writer.mode != "inline"

    @property
    def rank_contents(self) -> list[str]:
        """What the ranks write themselves: save_contents without hf_model."""
        return [content for content in self.save_contents if content in CONTENTS]


def to_checkpoint_config(cfg: Any) -> CheckpointConfig:
    """Build a validated CheckpointConfig from a dataclass, a dict or an OmegaConf node.

    First every key is checked (config_keys.py): an unknown one is one line naming
    `checkpoint.<key>` and the nearest known key; OmegaConf would drop a key Hydra appended
    (`+checkpoint.<key>=...`) without a word. OmegaConf then checks the types (a string where
    an integer belongs fails naming the key); `__post_init__` checks the values.
    """
    if isinstance(cfg, CheckpointConfig):
        return cfg
    return build_config(
        CheckpointConfig, cfg, CheckpointConfigError, "checkpoint.", "checkpoint config"
    )


def register_configs() -> None:
    """Register the schema as `checkpoint/base_checkpoint` in Hydra's ConfigStore.

    The YAML presets in configs/checkpoint/ list it first in their defaults, so Hydra checks
    every override against these types.
    """
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(group="checkpoint", name="base_checkpoint", node=CheckpointConfig)


def check_deadline_env(config: PreemptionConfig) -> float | None:
    """The Unix time in `config.deadline_env`, or None (no variable named, or not set).

    Raises CheckpointConfigError naming the variable and the key when it holds anything but
    a number: start-up calls this before Ray starts.
    """
    name = config.deadline_env
    if name is None:
        return None
    raw = os.environ.get(name, "").strip()
    if not raw:
        return None
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not math.isfinite(value):
        raise CheckpointConfigError(
            f"checkpoint.preemption.deadline_env={name!r}: ${name}={raw[:40]!r} is not a Unix "
            "time in seconds"
        )
    return value
