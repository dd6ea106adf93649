"""The CUDA staging path: pinned host buffers and asynchronous device-to-host copies.

These run only where torch sees a GPU (they are skipped, by marker, on CPU-only machines and
in CI). On a GPU they check the snapshot semantics of invariant I4 for device tensors and
print the device-to-host throughput next to the pinned-copy limit measured the same way.
"""

from __future__ import annotations

import time

import pytest
import torch

from verl_ckpt.staging import StagingPool, copy_into

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def device_tensors(total_mib: int = 256, parts: int = 16) -> list[torch.Tensor]:
    numel = total_mib * (1 << 20) // 4 // parts
    return [torch.randn(numel, device="cuda") for _ in range(parts)]


def test_I4_pinned_buffers_hold_the_snapshot_of_device_tensors():
    tensors = device_tensors(64)
    pool = StagingPool(slots=1, pin_memory=True)
    slot, _ = pool.acquire("structure", tensors)
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
    first, _ = pool.acquire("structure", tensors)
    pool.release(first)
    second, dropped = pool.acquire("structure", tensors)
    assert second is first and dropped == []
    pool.release(second)
    third, dropped = pool.acquire("changed", tensors[:-1])
    assert third is not first and dropped == [first]


def test_device_to_host_throughput_against_the_pinned_copy_limit(capsys):
    tensors = device_tensors(512)
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    pool = StagingPool(slots=1, pin_memory=True)
    slot, _ = pool.acquire("structure", tensors)
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
