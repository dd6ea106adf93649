"""Writing one rank's files: DCP write buckets and common.pt, fsynced and checksummed.

Depends on torch only (not megatron-core), so that a spawned writer process starts fast.

Protocol step 3 (write), verl_ckpt/protocol/__init__.py.
"""

from __future__ import annotations

import contextlib
import io
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from verl_ckpt.format.torch_format import write_item
from verl_ckpt.store.direct_io import open_direct
from verl_ckpt.store.fsio import (
    DEFAULT_WRITES,
    ChecksummingWriter,
    Gate,
    WriteOptions,
    open_for_rewrite,
)

__all__ = [
    "COMMON_FILENAME",
    "WrittenFile",
    "serialize_common",
    "write_bucket",
    "write_checksummed",
    "write_common",
]

COMMON_FILENAME = "common.pt"


@dataclass(frozen=True)
class WrittenFile:
    name: str
    size: int
    checksum: str
    # Seconds of the final fsync (the part a fast disk makes small and a page cache cannot).
    fsync_s: float = 0.0


def write_checksummed(
    path: str | Path,
    write: Callable[[ChecksummingWriter], Any],
    gate: Gate | None = None,
    options: WriteOptions = DEFAULT_WRITES,
) -> WrittenFile:
    """Create `path`, let `write` fill it through a checksumming stream, fsync it.

    The file is durable when this returns: a report of it to the finalizer must mean the
    bytes are on disk. The checksum covers exactly the bytes written. A failure raises the
    OSError the file gave (ENOSPC, EFBIG, EIO), naming the path, even where torch's C++
    writer hid it behind a RuntimeError.
    """
    # Opened in place without following a link, with the project's file mode; a regular
    # file with another name (a hard link planted there) is refused before it is truncated:
    # either would redirect a rank's bytes into another file (fsio.open_for_rewrite).
    fd = open_for_rewrite(path)
    direct = open_direct(fd) if options.direct_io else None
    with direct if direct is not None else open(fd, "wb") as raw:
        # Around the page cache there are no dirty pages to hand to the disk early.
        stream = ChecksummingWriter(raw, gate, 0 if direct is not None else options.writeback_every)
        try:
            try:
                write(stream)
            finally:
                stream.done_writing()
            if direct is not None:
                direct.finish()
            raw.flush()
            synced = time.perf_counter()
            os.fsync(raw.fileno())
            fsync_s = time.perf_counter() - synced
        except Exception as exc:
            # Close here, quietly: the implicit close would flush the buffer to the same full
            # disk and raise a second error without the path, in place of this one.
            with contextlib.suppress(OSError):
                raw.close()
            cause = stream.error if stream.error is not None else exc
            if isinstance(cause, OSError):
                raise OSError(cause.errno, cause.strerror or str(cause), str(path)) from exc
            raise
    return WrittenFile(os.path.basename(path), stream.size, stream.checksum, fsync_s)


def write_bucket(
    bucket: tuple,
    transforms: Any,
    gate: Gate | None = None,
    options: WriteOptions = DEFAULT_WRITES,
    before_tensor: Callable[[torch.Tensor], None] | None = None,
) -> tuple[list, WrittenFile]:
    """Write one DCP bucket (path, storage key, (bytes items, tensor items)) to its file.
    `before_tensor` is called with each tensor right before it is written (a write that
    starts while the snapshot's copy runs waits there for that tensor's copy)."""
    path, storage_key, (bytes_data, tensor_data) = bucket
    results: list = []

    def write_items(stream: ChecksummingWriter) -> None:
        for item, data in bytes_data:
            results.append(write_item(transforms, stream, data, item, storage_key))
        for item, tensor in tensor_data:
            if before_tensor is not None:
                before_tensor(tensor)
            results.append(write_item(transforms, stream, tensor, item, storage_key))

    return results, write_checksummed(path, write_items, gate, options)


def serialize_common(common_state_dict: dict) -> bytes:
    """common.pt's bytes, from the copy of the non-sharded state save() took (I4)."""
    buffer = io.BytesIO()
    torch.save(common_state_dict, buffer)
    return buffer.getvalue()


def write_common(data: bytes, checkpoint_dir: Path) -> WrittenFile:
    """Write common.pt (the non-sharded part, as megatron-core's torch common strategy lays
    it out), fsynced, with its checksum."""
    return write_checksummed(checkpoint_dir / COMMON_FILENAME, lambda stream: stream.write(data))
