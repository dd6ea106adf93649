"""Read-only views of a checkpoint root for the `verl-ckpt` tool: no printing, no deleting.

Everything here reads what is on disk now; nothing is cached, so it is safe to call on a
root that a running job is writing (the answer may just be a moment old).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from verl_ckpt.protocol.errors import CommitRecordError
from verl_ckpt.store.commit_record import CommitRecord, read_commit_record
from verl_ckpt.store.layout import COMMIT_RECORD_FILENAME, list_step_dirs

__all__ = ["StepInfo", "TensorEntry", "dir_size", "read_role_entries", "scan_steps"]


@dataclass
class StepInfo:
    """One `global_step_<N>` directory as found on disk."""

    step: int
    path: Path
    # None when the step is committed; "not committed" or "corrupt: <reason>" otherwise.
    problem: str | None
    record: CommitRecord | None
    roles: list[str]
    size: int
    # Seconds since the commit (or, uncommitted, since the directory last changed).
    age_s: float

    @property
    def committed(self) -> bool:
        return self.problem is None


@dataclass
class TensorEntry:
    """One entry of a torch_dist directory's `.metadata`: a tensor or a pickled object."""

    key: str
    kind: str  # "tensor" or "bytes"
    nbytes: int
    dtype: str | None = None
    shape: list[int] = field(default_factory=list)


def dir_size(path: Path) -> int:
    """Total size of the regular files under `path` (files vanishing meanwhile count 0)."""
    total = 0
    for parent, _, names in os.walk(path):
        for name in names:
            try:
                total += os.lstat(os.path.join(parent, name)).st_size
            except FileNotFoundError:
                pass  # deleted while we walked: a retention run of a live job
    return total


def _read_state(path: Path) -> tuple[str | None, CommitRecord | None]:
    # A missing record and an unreadable one mean different things to the user: the first
    # is an unfinished or interrupted save, the second a damaged commit.
    if not (path / COMMIT_RECORD_FILENAME).is_file():
        return "not committed", None
    try:
        return None, read_commit_record(path)
    except CommitRecordError as exc:
        return f"corrupt: {exc}", None


def _step_info(step: int, path: Path, now: float) -> StepInfo:
    problem, record = _read_state(path)
    if record is not None:
        roles = [f"{role}:{size}" for role, size in sorted(record.participants.items())]
        age = now - record.committed_at
    else:
        roles = sorted(p.name for p in path.iterdir() if p.is_dir())
        age = now - path.stat().st_mtime
    return StepInfo(step, path, problem, record, roles, dir_size(path), max(0.0, age))


def scan_steps(root: Path) -> list[StepInfo]:
    """Every step directory under `root`, oldest first."""
    now = time.time()
    found = []
    for step, path in sorted(list_step_dirs(root).items()):
        try:
            found.append(_step_info(step, path, now))
        except FileNotFoundError:
            continue  # deleted by a live job's retention between listing and reading
    return found


def read_role_entries(role_dir: Path, shown: str | None = None) -> list[TensorEntry]:
    """The entries of the torch_dist directory `role_dir`, read from its DCP `.metadata`
    (named `shown` in errors, default its path: a downloaded copy is named by its URL).

    Tensor sizes are logical (numel x element size); pickled objects count the bytes stored.
    Raises OSError when `.metadata` is missing, CheckpointError when it is damaged, and
    UnsafeCheckpointError when it holds more than DCP's metadata (nothing of it is run).
    """
    # Imported here: torch costs seconds to import and only `inspect` needs it.
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from verl_ckpt.format.safe_load import load_dcp_metadata

    metadata = load_dcp_metadata(role_dir / ".metadata", shown)
    stored: dict[str, int] = {}
    for index, info in (metadata.storage_data or {}).items():
        stored[index.fqn] = stored.get(index.fqn, 0) + info.length
    entries = []
    for key, meta in metadata.state_dict_metadata.items():
        if isinstance(meta, TensorStorageMetadata):
            dtype = meta.properties.dtype
            nbytes = meta.size.numel() * dtype.itemsize
            name = str(dtype).removeprefix("torch.")
            entries.append(TensorEntry(key, "tensor", nbytes, name, list(meta.size)))
        else:
            entries.append(TensorEntry(key, "bytes", stored.get(key, 0)))
    return entries
