"""The direct reader (verl_ckpt/format/direct_reader.py): whole saved tensors are read straight
into their destination, with the same result as DCP's own reader; anything it does not
know goes through DCP's path. Real DCP files (by DCP's save, and by verl_ckpt's own blob
writer with the finalizer's `.metadata`), no Ray."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.filesystem import _StorageWriterTransforms, _write_item
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    TensorProperties,
    TensorStorageMetadata,
)

from tests.test_torch_format import whole_tensor_item
from verl_ckpt.format import direct_reader, torch_format
from verl_ckpt.format.direct_reader import DirectFileSystemReader
from verl_ckpt.format.torch_dist_dir import metadata_file_bytes
from verl_ckpt.format.torch_format import _WRITE_ITEM_KWARGS, write_item


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


def saved_as_verl_ckpt_writes(
    directory: Path, state: dict[str, torch.Tensor], by_torch_save: tuple[str, ...] = ()
) -> None:
    """One shard file of verl_ckpt's blobs (torch_format.write_item, as its writer threads
    call it) and the `.metadata` its finalizer makes from the write results. The tensors
    named in `by_torch_save` are written by DCP's own `_write_item` instead (torch.save, its
    CRCs included), as another writer would."""
    name = "__0_0.distcp"
    with open(directory / name, "wb") as stream:
        results = []
        for key, tensor in state.items():
            item = whole_tensor_item(key, tensor)
            if key in by_torch_save:
                results.append(
                    _write_item(
                        _StorageWriterTransforms(), stream, tensor, item, name, **_WRITE_ITEM_KWARGS
                    )
                )
            else:
                results.append(write_item(_StorageWriterTransforms(), stream, tensor, item, name))
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
    assert reader.templated_reads == len(state)


def many_tensors(count: int = 40) -> dict[str, torch.Tensor]:
    shapes = [(33, 17), (5,), (), (8, 4, 2), (129,)]
    dtypes = [torch.float32, torch.bfloat16, torch.int64, torch.float16]
    return {f"t{k}": (torch.randn(shapes[k % 5]) * 100).to(dtypes[k % 4]) for k in range(count)}


def loaded_equal(directory: Path, state: dict[str, torch.Tensor]) -> DirectFileSystemReader:
    """Load `directory` with the direct reader into zeroed tensors like `state`'s; every
    value must come back. Returns the reader (its counters say which path each took)."""
    target = {k: torch.zeros_like(v) for k, v in state.items()}
    reader = DirectFileSystemReader(directory)
    dcp.load(target, storage_reader=reader, no_dist=True)
    for key, value in state.items():
        assert torch.equal(target[key], value), key
    return reader


def test_I4_consecutive_blobs_are_read_in_runs_split_by_size_and_buffer_count(
    tmp_path, monkeypatch
):
    """The sequential path: consecutive blobs read with one call each run, every storage
    straight into its destination. Runs are made short here (a few KiB, a few buffers) so
    that one file needs many of them, splits at both limits included."""
    state = many_tensors()
    saved_as_verl_ckpt_writes(tmp_path, state)
    monkeypatch.setattr(direct_reader, "_RUN_BYTES", 4096)
    monkeypatch.setattr(direct_reader, "_RUN_BUFFERS", 7)
    calls = []
    real_preadv = os.preadv
    monkeypatch.setattr(
        direct_reader.os,
        "preadv",
        lambda fd, bufs, at: calls.append(len(bufs)) or real_preadv(fd, bufs, at),
    )
    reader = loaded_equal(tmp_path, state)
    assert reader.templated_reads == len(state)
    assert max(calls) <= 7 and len(calls) < len(state), calls  # several blobs per call


def test_I4_a_blob_of_another_writer_amid_verl_ckpts_is_found_through_its_zip_directory(tmp_path):
    """A torch.save blob (CRCs in its headers) has the length of verl_ckpt's template but
    other bytes: read in a run, its head does not match, and it is read again through its
    zip directory; its neighbours stay on the sequential path. Values equal either way."""
    state = many_tensors(9)
    others = ("t3", "t4", "t8")
    saved_as_verl_ckpt_writes(tmp_path, state, by_torch_save=others)
    reader = loaded_equal(tmp_path, state)
    assert reader.direct_reads == len(state)
    assert reader.templated_reads == len(state) - len(others)


def test_I4_dcp_blobs_take_the_zip_directory_path_even_where_their_length_fits(tmp_path):
    """DCP's own files: every blob the length of a template (so a run reads it) fails the
    head check, and is then read in place through its zip directory."""
    state = saved(tmp_path)
    reader = loaded_equal(tmp_path, state)
    lengths = {index.fqn: info.length for index, info in reader.storage_data.items()}
    layout = torch_format.whole_tensor_blob_layout(tuple(state["weight"].shape), torch.float32)
    assert layout is not None and lengths["weight"] == direct_reader._layout_length(layout)
    assert reader.templated_reads == 0
    assert reader.direct_reads == len(state) - 1


def test_a_file_of_another_writer_is_read_once_after_its_first_run_fails(tmp_path, monkeypatch):
    """DCP's own file, its blobs the template's length: the first run's check fails for
    every blob, and the rest of the file is read through the zip directories only, not
    read in runs first and then again."""
    state = many_tensors()
    dcp.save(state, checkpoint_id=str(tmp_path), no_dist=True)
    monkeypatch.setattr(direct_reader, "_RUN_BYTES", 4096)
    runs = []
    real_read_run = direct_reader._read_run
    monkeypatch.setattr(
        direct_reader, "_read_run", lambda fd, run: runs.append(run) or real_read_run(fd, run)
    )
    reader = loaded_equal(tmp_path, state)
    assert len(runs) == 1
    assert reader.templated_reads == 0 and reader.direct_reads == len(state)


def test_I4_short_reads_are_continued_where_they_stopped(tmp_path, monkeypatch):
    """A read may return fewer bytes than asked (Linux stops one call at about 2 GiB).
    Fault injected with a fake: reads capped at 100 bytes, which a test cannot get from a
    regular file without a 2 GiB tensor."""
    state = many_tensors(12)
    saved_as_verl_ckpt_writes(tmp_path, state)
    real_preadv = os.preadv

    def short_preadv(fd: int, buffers: list, offset: int) -> int:
        left, capped = 100, []
        for view in buffers:
            if left == 0:
                break
            capped.append(memoryview(view)[:left])
            left -= len(capped[-1])
        return real_preadv(fd, capped, offset)

    monkeypatch.setattr(direct_reader.os, "preadv", short_preadv)
    reader = loaded_equal(tmp_path, state)
    assert reader.templated_reads == len(state)


def test_a_truncated_shard_file_fails_the_load_naming_the_missing_bytes(tmp_path):
    state = many_tensors(6)
    saved_as_verl_ckpt_writes(tmp_path, state)
    shard = tmp_path / "__0_0.distcp"
    os.truncate(shard, shard.stat().st_size - 100)
    target = {k: torch.zeros_like(v) for k, v in state.items()}
    # DCP wraps it in its CheckpointException (a BaseException), the reader's text inside.
    with pytest.raises(BaseException, match="ended 100 bytes early") as raised:
        dcp.load(target, storage_reader=DirectFileSystemReader(tmp_path), no_dist=True)
    assert f"{shard}: checkpoint file ended 100 bytes early" in str(raised.value)


def test_I4_a_transposed_blob_the_length_of_the_contiguous_template_fails_the_head_check(
    tmp_path,
):
    """verl_ckpt's own blob of a transposed tensor (no CRC, from its template): as long as
    the contiguous template, with other strides in its pickle. The sequential path reads it
    (same length), the head check refuses it, and the zip-directory path refuses its
    pickle: DCP's path loads it, transposed back. Without the head check it loaded
    transposed, silently."""
    transposed = torch.arange(24, dtype=torch.float32).view(4, 6).t()
    saved_as_verl_ckpt_writes(tmp_path, {"w": transposed})
    reader = DirectFileSystemReader(tmp_path)
    target = {"w": torch.zeros(6, 4)}
    dcp.load(target, storage_reader=reader, no_dist=True)
    (info,) = reader.storage_data.values()
    layout = torch_format.whole_tensor_blob_layout((6, 4), torch.float32)
    assert layout is not None and info.length == direct_reader._layout_length(layout)
    assert torch.equal(target["w"], transposed)
    assert reader.direct_reads == 0


@pytest.mark.parametrize("writer", ["verl_ckpt", "dcp"])
def test_I4_a_strided_destination_is_filled_through_host_memory_of_its_size(tmp_path, writer):
    """A destination that is not contiguous host memory (here a transposed view; on a GPU,
    a device tensor) takes the same reads into host memory of the tensor's size, then one
    copy into it: on both paths (verl_ckpt's blobs, read in runs; DCP's, through their zip
    directory). Before, such a destination went through DCP's path (direct_reads 0)."""
    state = many_tensors(6)
    if writer == "verl_ckpt":
        saved_as_verl_ckpt_writes(tmp_path, state)
    else:
        dcp.save(state, checkpoint_id=str(tmp_path), no_dist=True)
    # Each destination a transposed view of its own storage: the bytes cannot land in it.
    target = {
        k: torch.zeros(v.shape[::-1], dtype=v.dtype).permute(tuple(reversed(range(v.dim()))))
        for k, v in state.items()
    }
    assert not any(t.is_contiguous() for t in target.values() if t.dim() > 1)
    storages = {k: t.untyped_storage().data_ptr() for k, t in target.items()}
    reader = DirectFileSystemReader(tmp_path)
    dcp.load(target, storage_reader=reader, no_dist=True)
    for key, value in state.items():
        assert torch.equal(target[key], value), key
        assert target[key].untyped_storage().data_ptr() == storages[key], key
    assert reader.direct_reads == len(state)
    assert reader.templated_reads == (len(state) if writer == "verl_ckpt" else 0)
