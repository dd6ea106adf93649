"""The CUDA staging path: pinned host buffers and asynchronous device-to-host copies.

These run only where torch sees a GPU (they are skipped, by marker, on CPU-only machines and
in CI). On a GPU they check the snapshot semantics of invariant I4 for device tensors, print
the device-to-host throughput next to the pinned-copy limit measured the same way, and run a
real Megatron rank on the GPU in a Ray actor, with the NCCL process group a GPU trainer has:
a saved step (copied now, and deferred onto a side stream) loads back bit-exact.
"""

from __future__ import annotations

import time

import pytest
import ray
import torch

from tests.helpers import close_all, open_all, save_changed_before_the_fence, save_everyone
from verl_ckpt import (
    CheckpointCoordinator,
    read_tracker,
)
from verl_ckpt.rank.staging import StagingPool, copy_into

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def device_tensors(total_mib: int = 256, parts: int = 16) -> list[torch.Tensor]:
    numel = total_mib * (1 << 20) // 4 // parts
    return [torch.randn(numel, device="cuda") for _ in range(parts)]


def keys(tensors: list[torch.Tensor]) -> list[str]:
    return [f"tensor.{i}" for i in range(len(tensors))]


def test_I4_pinned_buffers_hold_the_snapshot_of_device_tensors():
    tensors = device_tensors(64)
    pool = StagingPool(slots=1, pin_memory=True)
    slot, _ = pool.acquire(keys(tensors), tensors)
    assert all(b.is_pinned() for b in slot.buffers)
    expected = [t.cpu() for t in tensors]
    copy_into(slot, tensors)
    # The trainer goes on at once, on the same stream and on another one.
    for t in tensors:
        t.add_(1.0)
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        for t in tensors:
            t.mul_(2.0)
    torch.cuda.synchronize()
    assert all(torch.equal(b, e) for b, e in zip(slot.buffers, expected, strict=True))


def test_staging_buffers_are_reused_across_saves():
    tensors = device_tensors(16)
    pool = StagingPool(slots=1, pin_memory=True)
    first, _ = pool.acquire(keys(tensors), tensors)
    pool.release(first)
    second, dropped = pool.acquire(keys(tensors), tensors)
    assert second is first and dropped == []
    pool.release(second)
    third, dropped = pool.acquire(keys(tensors[:-1]), tensors[:-1])
    assert third is not first and dropped == [first]


def test_device_to_host_throughput_against_the_pinned_copy_limit(capsys):
    tensors = device_tensors(512)
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    pool = StagingPool(slots=1, pin_memory=True)
    slot, _ = pool.acquire(keys(tensors), tensors)
    copy_into(slot, tensors)  # warm up
    flat_pinned = torch.empty(nbytes // 4, dtype=torch.float32, pin_memory=True)
    flat_device = torch.cat(tensors)
    timings = {"verl_ckpt copy_into": [], "one pinned copy": []}
    for _ in range(5):
        torch.cuda.synchronize()
        start = time.perf_counter()
        copy_into(slot, tensors)
        timings["verl_ckpt copy_into"].append(time.perf_counter() - start)
        torch.cuda.synchronize()
        start = time.perf_counter()
        flat_pinned.copy_(flat_device, non_blocking=True)
        torch.cuda.current_stream().synchronize()
        timings["one pinned copy"].append(time.perf_counter() - start)
    with capsys.disabled():
        for name, values in timings.items():
            best = min(values)
            print(f"\n{name}: {nbytes / best / 1e9:.1f} GB/s ({nbytes >> 20} MiB in {best:.4f} s)")
    assert all(torch.equal(b, t.cpu()) for b, t in zip(slot.buffers, tensors, strict=True))


@pytest.fixture(scope="module")
def gpu_rank(ray_local):
    """One Megatron rank on the GPU (num_gpus=1: Ray hides the GPUs from other actors), its
    process group NCCL, as megatron_cpu.init_distributed makes it when CUDA is present."""
    from tests.rank_worker import start_world

    (worker,) = start_world("actor", 1, tp=1, options=lambda rank: {"num_gpus": 1})
    ray.get(worker.train.remote(1))
    yield {"actor": [worker]}
    ray.kill(worker)


def gpu_config(tmp_path, **overrides):
    return {"root_dir": str(tmp_path / "ckpt"), "timeout_s": 120.0, **overrides}


def test_I4_device_destinations_are_read_through_host_memory_once(tmp_path):
    """A load into GPU tensors takes the direct reader's reads (into host memory of each
    tensor's size, then one copy to the device), on verl_ckpt's blobs and DCP's own."""
    import torch.distributed.checkpoint as dcp

    from tests.test_direct_reader import many_tensors, saved_as_verl_ckpt_writes
    from verl_ckpt.format.direct_reader import DirectFileSystemReader

    state = many_tensors(12)
    for writer, directory in (("verl_ckpt", tmp_path / "ours"), ("dcp", tmp_path / "dcp")):
        directory.mkdir()
        if writer == "verl_ckpt":
            saved_as_verl_ckpt_writes(directory, state)
        else:
            dcp.save(state, checkpoint_id=str(directory), no_dist=True)
        target = {k: torch.zeros_like(v, device="cuda") for k, v in state.items()}
        pointers = {k: t.data_ptr() for k, t in target.items()}
        reader = DirectFileSystemReader(directory)
        dcp.load(target, storage_reader=reader, no_dist=True)
        for key, value in state.items():
            assert target[key].data_ptr() == pointers[key], (writer, key)
            assert torch.equal(target[key].cpu(), value), (writer, key)
        assert reader.direct_reads == len(state), writer


@pytest.mark.parametrize("snapshot", ["deferred", "live"])
def test_I4_deferred_snapshot_of_device_state_on_nccl_loads_back_bit_exact(
    gpu_rank, tmp_path, snapshot
):
    """A live snapshot writes only host tensors uncopied: device tensors take the deferred
    copy onto a side stream, as with snapshot=deferred."""
    placement = ray.get(gpu_rank["actor"][0].placement.remote())
    assert placement == {"backend": "nccl", "parameters": "cuda:0", "optimizer": "cuda:0"}
    cfg = gpu_config(tmp_path, snapshot=snapshot)
    coordinator = CheckpointCoordinator(cfg, {"actor": 1})
    open_all(gpu_rank, cfg)
    first = save_everyone(gpu_rank, coordinator, 1)
    assert {s["snapshot"] for s in first} == {"now"}  # the first save plans: copied at once
    coordinator.wait_for_commit(1)
    before = ray.get(gpu_rank["actor"][0].state_copy.remote())
    # The copy of step 2 runs on a side stream after save() returns; the trainer fences,
    # then changes every parameter and optimizer tensor in place on the GPU.
    second = save_everyone(gpu_rank, coordinator, 2, after="fence, inplace")
    assert {s["snapshot"] for s in second} == {snapshot}
    coordinator.wait_for_commit(2)
    (done,) = [s for s in ray.get(gpu_rank["actor"][0].wait.remote()) if s["step"] == 2]
    assert done["bytes_staged"] > done["bytes_zero_copy"]  # the device state was copied
    assert read_tracker(cfg["root_dir"]) == 2
    ray.get(gpu_rank["actor"][0].load.remote(2))
    after = ray.get(gpu_rank["actor"][0].state_copy.remote())
    assert before.keys() == after.keys()
    assert all(torch.equal(before[key], after[key]) for key in before)
    # I7: megatron-core alone reads the step written from device tensors.
    plain = ray.get(
        gpu_rank["actor"][0].plain_megatron_load.remote(f"{cfg['root_dir']}/global_step_2/actor")
    )
    assert all(torch.equal(plain[k].cpu(), before[k]) for k in plain if k in before)
    close_all(gpu_rank, coordinator)


@pytest.mark.parametrize("snapshot", ["deferred", "live"])
def test_I4_a_device_change_before_the_fence_fails_the_deferred_save(gpu_rank, tmp_path, snapshot):
    cfg = gpu_config(tmp_path, snapshot=snapshot)
    coordinator = CheckpointCoordinator(cfg, {"actor": 1})
    open_all(gpu_rank, cfg)
    save_everyone(gpu_rank, coordinator, 1)
    coordinator.wait_for_commit(1)
    # No fence: the trainer's in-place update is queued on the GPU before the copy.
    save_changed_before_the_fence(gpu_rank, coordinator, gpu_rank["actor"][0], "actor")
    assert read_tracker(cfg["root_dir"]) == 1
    close_all(gpu_rank, coordinator)
