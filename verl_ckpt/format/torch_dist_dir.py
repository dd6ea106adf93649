"""The two files that make a role's torch_dist directory whole: DCP's `.metadata` and
megatron-core's `metadata.json`. The finalizer writes them when it commits a step.

Only torch's DCP is imported here, never megatron-core: the finalizer is a Ray actor started
by every job (and again after each restart), and megatron-core's import costs it seconds
of CPU for two files it does not need it to write. `megatron_compat` imports this module and
checks at import that megatron-core still writes the same `metadata.json`, so a release that
changes the format fails there, loudly, in the ranks.

Protocol step 5 (commit record), verl_ckpt/protocol/__init__.py.
"""

from __future__ import annotations

import contextlib
import copy
import io
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint.filesystem import FileSystem, FileSystemWriter

from verl_ckpt.store.fsio import atomic_write_bytes, fsync_dir, write_in_place

__all__ = [
    "BACKEND",
    "CHECKPOINTING_CONFIG",
    "METADATA_FILENAMES",
    "complete_role_dir",
    "metadata_file_bytes",
]

# (sharded_backend, sharded_backend_version) of megatron-core's CheckpointingConfig.
BACKEND = ("torch_dist", 1)
METADATA_FILENAMES = (".metadata", "metadata.json")
# What megatron-core 0.16's save_config(CheckpointingConfig(*BACKEND)) writes to
# metadata.json, key order included (it dumps the dataclass with json.dump). 0.19 dropped the
# two common_backend fields, writes the first two and ignores unknown ones when it reads
# (megatron_compat checks this at import; tests/test_megatron_compat.py loads it).
CHECKPOINTING_CONFIG = {
    "sharded_backend": BACKEND[0],
    "sharded_backend_version": BACKEND[1],
    "common_backend": "torch",
    "common_backend_version": 1,
}


def metadata_file_bytes(checkpoint_dir: Path, global_metadata: Any, write_results: list) -> bytes:
    """The `.metadata` that DCP's own finish (megatron-core's writer calls the same one for
    local files) writes into `checkpoint_dir`, as bytes: finish itself runs, merging every
    rank's write results into the metadata, against a filesystem that keeps what it would
    write. Nothing is written; the caller makes it durable (complete_role_dir)."""
    writer = FileSystemWriter(checkpoint_dir, sync_files=False)
    capture = _CapturingFileSystem()
    writer.fs = capture
    # finish sets fields of the metadata it is given: a copy, since the finalizer shares one
    # object between the steps of a plan (reports.GlobalMetadataCache).
    writer.finish(copy.copy(global_metadata), write_results)
    if len(capture.streams) != 1:
        raise RuntimeError(
            f"DCP's finish wrote {len(capture.streams)} files for {checkpoint_dir}, expected "
            "one .metadata (an unknown torch release?)"
        )
    return capture.streams[0]


def complete_role_dir(
    checkpoint_dir: Path, metadata_file: bytes, beneath: Path | None = None
) -> None:
    """Write `.metadata` (made by metadata_file_bytes) and `metadata.json`, the files that
    make a torch_dist directory whole; with `beneath` (the root), into a directory reached
    below it without following a link (fsio.open_dir_beneath).

    `metadata.json` goes last: megatron-core refuses a directory without it, so until it is
    durable the directory is not loadable even by code that ignores our commit record.
    """
    # Temporary file, fsync, rename, directory fsync: as DCP's finish writes it, and durable.
    atomic_write_bytes(checkpoint_dir / ".metadata", metadata_file, beneath=beneath)
    config = json.dumps(CHECKPOINTING_CONFIG).encode()
    write_in_place(checkpoint_dir / "metadata.json", config, fsync=True, beneath=beneath)
    fsync_dir(checkpoint_dir)


class _CapturingFileSystem(FileSystem):
    """DCP's local filesystem, except that files it creates are kept in memory, and the
    existence checks, removals and renames of its finish do nothing."""

    def __init__(self) -> None:
        super().__init__()
        self.streams: list[bytes] = []

    @contextlib.contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Iterator[io.BytesIO]:
        stream = io.BytesIO()
        yield stream
        self.streams.append(stream.getvalue())

    def exists(self, path: str | os.PathLike) -> bool:
        return False

    def rm_file(self, path: str | os.PathLike) -> None:
        pass

    def rename(self, path: str | os.PathLike, new_path: str | os.PathLike) -> None:
        pass
