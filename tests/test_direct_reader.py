"""The direct reader (verl_ckpt/direct_reader.py): whole saved tensors are read straight
into their destination, with the same result as DCP's own reader; anything it does not
know goes through DCP's path. Real DCP files, no Ray."""

from __future__ import annotations

import torch
import torch.distributed.checkpoint as dcp

from verl_ckpt.direct_reader import DirectFileSystemReader


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
