"""Writing one rank's files: DCP write buckets and common.pt (each a
store.checksummed_file.write_checksummed: fsynced and checksummed).

Depends on torch only (not megatron-core), so that a spawned writer process starts fast.

Protocol step 3 (write), verl_ckpt/protocol/__init__.py.
"""

from __future__ import annotations

import io
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from verl_ckpt.format.torch_format import write_item
from verl_ckpt.store.checksummed_file import WrittenFile, write_checksummed
from verl_ckpt.store.fsio import DEFAULT_WRITES, ChecksummingWriter, Gate, WriteOptions

__all__ = ["COMMON_FILENAME", "serialize_common", "write_bucket", "write_common"]

COMMON_FILENAME = "common.pt"


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
            results.append(
                write_item(transforms, stream, tensor, item, storage_key, options.live_storages)
            )

    return results, write_checksummed(path, write_items, gate, options)


def serialize_common(common_state_dict: dict) -> bytes:
    """common.pt's bytes, from the copy of the non-sharded state save() took (I4)."""
    buffer = io.BytesIO()
    torch.save(common_state_dict, buffer)
    return buffer.getvalue()


def write_common(
    data: bytes, checkpoint_dir: Path, options: WriteOptions = DEFAULT_WRITES
) -> WrittenFile:
    """Write common.pt (the non-sharded part, as megatron-core's torch common strategy lays
    it out), fsynced, with its checksum (`options.beneath`: the root it is written below)."""
    return write_checksummed(
        checkpoint_dir / COMMON_FILENAME, lambda stream: stream.write(data), options=options
    )
