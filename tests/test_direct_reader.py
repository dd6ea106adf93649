"""The direct reader (verl_ckpt/direct_reader.py): whole saved tensors are read straight
into their destination, with the same result as DCP's own reader; anything it does not
know goes through DCP's path. Real DCP files (by DCP's save, and by verl_ckpt's own blob
writer with the finalizer's `.metadata`), no Ray."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.filesystem import _StorageWriterTransforms
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    TensorProperties,
    TensorStorageMetadata,
)

from tests.test_torch_format import whole_tensor_item
from verl_ckpt.direct_reader import DirectFileSystemReader
from verl_ckpt.torch_dist_dir import metadata_file_bytes
from verl_ckpt.torch_format import write_item


def saved(tmp_path) -> dict[str, torch.Tensor]:
    state = {
        "weight": torch.randn(64, 32),
        "half": torch.randn(17, 3).to(torch.bfloat16),
        "step": torch.tensor(7.0),
        "ids": torch.arange(10, dtype=torch.int64),
        "empty": torch.empty(0, 4),
    }
    dcp.save(state, checkpoint_id=str(tmp_path), no_dist=True)
    return state


def test_I4_whole_tensors_are_read_in_place_and_equal_what_was_saved(tmp_path):
    state = saved(tmp_path)
    target = {k: torch.zeros_like(v) for k, v in state.items()}
    pointers = {k: v.data_ptr() for k, v in target.items()}
    reader = DirectFileSystemReader(tmp_path)
    dcp.load(target, storage_reader=reader, no_dist=True)
    for key, value in state.items():
        assert torch.equal(target[key], value), key
        assert target[key].data_ptr() == pointers[key], f"{key} was replaced, not filled"
    # Every tensor with bytes; the empty one has no storage record to read.
    assert reader.direct_reads == len(state) - 1


def test_I4_a_dtype_change_falls_back_to_dcps_own_reader(tmp_path):
    state = saved(tmp_path)
    target = {
        "weight": torch.zeros(64, 32, dtype=torch.float64),
        "ids": torch.zeros(10, dtype=torch.int64),
    }
    reader = DirectFileSystemReader(tmp_path)
    dcp.load(target, storage_reader=reader, no_dist=True)
    assert torch.equal(target["weight"], state["weight"].double())
    assert torch.equal(target["ids"], state["ids"])
    assert reader.direct_reads == 1  # only "ids": the weight's dtype differs


def test_I4_a_transposed_tensor_saved_with_its_own_storage_is_not_read_as_contiguous(tmp_path):
    """A non-contiguous tensor whose storage is exactly its size (a transpose) is saved by
    DCP as it is: its storage record has the whole tensor's size, in another element order.
    Read straight into a contiguous destination, it loaded transposed, silently."""
    transposed = torch.arange(24, dtype=torch.float32).view(4, 6).t()
    dcp.save({"w": transposed}, checkpoint_id=str(tmp_path), no_dist=True)
    target = {"w": torch.zeros(6, 4)}
    reader = DirectFileSystemReader(tmp_path)
    dcp.load(target, storage_reader=reader, no_dist=True)
    assert torch.equal(target["w"], transposed)
    assert reader.direct_reads == 0  # DCP's own path


def saved_as_verl_ckpt_writes(directory: Path, state: dict[str, torch.Tensor]) -> None:
    """One shard file of verl_ckpt's blobs (torch_format.write_item, as its writer threads
    call it) and the `.metadata` its finalizer makes from the write results."""
    name = "__0_0.distcp"
    with open(directory / name, "wb") as stream:
        results = [
            write_item(
                _StorageWriterTransforms(), stream, tensor, whole_tensor_item(key, tensor), name
            )
            for key, tensor in state.items()
        ]
    metadata = Metadata(
        state_dict_metadata={
            key: TensorStorageMetadata(
                TensorProperties.create_from_tensor(tensor),
                tensor.size(),
                [ChunkStorageMetadata(torch.Size([0] * tensor.dim()), tensor.size())],
            )
            for key, tensor in state.items()
        }
    )
    (directory / ".metadata").write_bytes(metadata_file_bytes(directory, metadata, [results]))


def test_I4_blobs_verl_ckpt_wrote_pass_the_pickle_check_and_are_read_in_place(tmp_path):
    """verl_ckpt's own blobs (no CRC, from templates) have the pickle the reader expects of
    a whole tensor: every tensor is read in place; DCP's own reader agrees on every value."""
    state = {
        "weight": torch.randn(64, 32),
        "half": torch.randn(17, 3).to(torch.bfloat16),
        "step": torch.tensor(7.0),
        "ids": torch.arange(10, dtype=torch.int64),
    }
    saved_as_verl_ckpt_writes(tmp_path, state)
    target = {k: torch.zeros_like(v) for k, v in state.items()}
    reader = DirectFileSystemReader(tmp_path)
    dcp.load(target, storage_reader=reader, no_dist=True)
    theirs = {k: torch.zeros_like(v) for k, v in state.items()}
    dcp.load(theirs, checkpoint_id=str(tmp_path), no_dist=True)
    for key, value in state.items():
        assert torch.equal(target[key], value) and torch.equal(theirs[key], value), key
    assert reader.direct_reads == len(state)
