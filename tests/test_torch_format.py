"""The tensor blobs of a shard file (torch_format.py): torch.save's format exactly, without
its zip CRC32, for the files that DCP's and megatron-core's loaders read (I7). No Ray."""

from __future__ import annotations

import io

import pytest
import torch
import torch.serialization as torch_serialization
from torch.distributed.checkpoint.filesystem import _StorageWriterTransforms, _write_item
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex
from torch.distributed.checkpoint.planner import (
    TensorProperties,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)

from verl_ckpt.torch_format import _WRITE_ITEM_KWARGS, CRC_FREE_BLOBS, save_tensor_blob, write_item

TENSORS = {
    "fp32 matrix": torch.randn(300, 17),
    "bf16": torch.randn(1000).bfloat16(),
    "int64": torch.arange(7),
    "scalar": torch.tensor(3.5),
    "empty": torch.empty(0, 4),
}


def test_this_torch_writes_crc_free_blobs():
    """The probe at import found the internals it needs: saves run without the CRC here (if
    a torch upgrade breaks that, the fallback keeps files correct but this says so)."""
    assert CRC_FREE_BLOBS


@pytest.mark.parametrize("name", list(TENSORS))
def test_I7_blob_is_torch_save_byte_for_byte_without_its_crc(name):
    tensor = TENSORS[name]
    ours = io.BytesIO()
    save_tensor_blob(tensor, ours)
    assert torch_serialization.get_crc32_options(), "the process-global switch was touched"
    reference = io.BytesIO()
    torch_serialization.set_crc32_options(False)
    try:
        torch.save(tensor, reference)
    finally:
        torch_serialization.set_crc32_options(True)
    assert ours.getvalue() == reference.getvalue()
    ours.seek(0)
    loaded = torch.load(ours, weights_only=True)
    assert loaded.dtype == tensor.dtype and torch.equal(loaded, tensor)


def _tensor_item(key: str, tensor: torch.Tensor) -> WriteItem:
    offsets = torch.Size([0] * tensor.dim())
    return WriteItem(
        index=MetadataIndex(key, offsets),
        type=WriteItemType.TENSOR,
        tensor_data=TensorWriteData(
            chunk=ChunkStorageMetadata(offsets=offsets, sizes=tensor.size()),
            properties=TensorProperties.create_from_tensor(tensor),
            size=tensor.size(),
        ),
    )


def test_I7_write_item_places_items_as_dcp_does():
    """Item by item into one stream (a shard file): DCP's own results (offsets, lengths,
    file) and bytes that differ from DCP's only in the CRC fields."""
    items = [(_tensor_item(name, t), t) for name, t in TENSORS.items()]
    blob = io.BytesIO(b"not a tensor")
    items.append((WriteItem(index=MetadataIndex("obj"), type=WriteItemType.BYTE_IO), blob))
    transforms = _StorageWriterTransforms()
    ours, theirs = io.BytesIO(), io.BytesIO()
    our_results = [write_item(transforms, ours, data, item, "__0_0.distcp") for item, data in items]
    torch_serialization.set_crc32_options(False)
    try:
        their_results = [
            _write_item(transforms, theirs, data, item, "__0_0.distcp", **_WRITE_ITEM_KWARGS)
            for item, data in items
        ]
    finally:
        torch_serialization.set_crc32_options(True)
    assert our_results == their_results
    assert ours.getvalue() == theirs.getvalue()
