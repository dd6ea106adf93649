"""Writing a rank's files while save() still copies (copy_progress.py): invariant I4, each
tensor is written only once its copy into the staging buffer ended, and a failed copy
writes nothing it did not fill. Real files, real writer threads, real torch.load."""

from __future__ import annotations

import io
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.filesystem import _StorageWriterTransforms

from tests.test_torch_format import whole_tensor_item
from verl_ckpt.rank import staging
from verl_ckpt.rank.copy_progress import CopyFailed, CopyProgress, write_order
from verl_ckpt.rank.staging import StagingSlot, copy_into
from verl_ckpt.rank.writers import ThreadWriter

SHARD = "__0_0.distcp"


def _slot(count: int, numel: int = 4096) -> StagingSlot:
    return StagingSlot("test", [torch.zeros(numel) for _ in range(count)])


def _bucket(path: Path, tensors: list[torch.Tensor]) -> tuple:
    items = [(whole_tensor_item(f"t{i}", t), t) for i, t in enumerate(tensors)]
    return (str(path), SHARD, ([], items))


def _read_back(path: Path, results: list) -> list[torch.Tensor]:
    """Each tensor as DCP's reader finds it: its blob at the offset the write reported."""
    data = path.read_bytes()
    found = []
    for result in results:
        info = result.storage_data
        blob = data[info.offset : info.offset + info.length]
        found.append(torch.load(io.BytesIO(blob), weights_only=True))
    return found


def _write_in_background(writer: ThreadWriter, bucket: tuple, slot, progress) -> tuple:
    pool = ThreadPoolExecutor(1)
    deadline = time.monotonic() + 60
    future = pool.submit(
        writer.write, [bucket], _StorageWriterTransforms(), slot, deadline, ("test", 0), progress
    )
    pool.shutdown(wait=False)
    return future


def test_I4_a_write_started_before_the_copy_writes_each_tensor_once_it_is_copied(tmp_path):
    """The writer starts on the unfilled (zero) buffers; it must wait, tensor by tensor,
    for the copy, and the file must hold the copied values, never the zeros."""
    slot = _slot(4)
    sources = [torch.full((4096,), float(i + 1)) for i in range(4)]
    progress = CopyProgress(slot.buffers)
    writer = ThreadWriter(2, "test_copy_progress")
    path = tmp_path / SHARD
    try:
        future = _write_in_background(writer, _bucket(path, slot.buffers), slot, progress)
        time.sleep(0.3)
        assert not future.done()  # waiting for the first tensor's copy
        copy_into(slot, sources, None, progress)
        [(results, written)] = future.result(timeout=60)
    finally:
        writer.close(10)
    assert written.size == path.stat().st_size
    for got, expected in zip(_read_back(path, results), sources, strict=True):
        assert torch.equal(got, expected)


def test_I4_a_failed_copy_fails_the_waiting_write_and_writes_nothing_unfilled(tmp_path):
    slot = _slot(3)
    progress = CopyProgress(slot.buffers)
    writer = ThreadWriter(1, "test_copy_progress")
    path = tmp_path / SHARD
    try:
        future = _write_in_background(writer, _bucket(path, slot.buffers), slot, progress)
        slot.buffers[0].fill_(7.0)
        progress.copied([0])
        progress.failed(MemoryError("host memory ran out"))
        with pytest.raises(CopyFailed, match="host memory ran out"):
            future.result(timeout=60)
    finally:
        writer.close(10)
    # Only the first tensor (copied) may be in the file: the second was never written.
    assert path.stat().st_size < 2 * 4096 * 4


def test_a_wait_for_a_copy_that_never_comes_ends_at_its_deadline():
    slot = _slot(1)
    progress = CopyProgress(slot.buffers)
    with pytest.raises(Exception, match="did not reach a tensor to write in time"):
        progress.wait_for(slot.buffers[0], time.monotonic() + 0.2)
    assert not progress.wait_settled(time.monotonic() + 0.1)
    progress.finished()
    assert progress.wait_settled(time.monotonic())


def test_I4_the_copy_fills_every_buffer_whatever_the_order_hint_says(monkeypatch):
    """The hint (the last plan's write order) orders the copy; it never selects: indices
    repeated, missing or out of range change nothing copied."""
    monkeypatch.setattr(staging, "COPY_GROUP_BYTES", 1)  # one tensor per group
    slot = _slot(5, numel=16)
    slot.write_order = [3, 3, 99, 0]
    sources = [torch.full((16,), float(i + 1)) for i in range(5)]
    progress = CopyProgress(slot.buffers)
    marked: list[list[int]] = []
    original = progress.copied
    monkeypatch.setattr(
        progress, "copied", lambda group: (marked.append(list(group)), original(group))
    )
    copy_into(slot, sources, None, progress)
    assert marked == [[3], [0], [1], [2], [4]]
    assert all(torch.equal(b, s) for b, s in zip(slot.buffers, sources, strict=True))
    assert progress.wait_settled(time.monotonic())


def test_I4_only_a_plan_that_writes_buffers_or_live_tensors_may_start_before_the_copy():
    """A clone made by the plan (of a view) would hold whatever the buffer held when it was
    made: such a plan must wait for the copy and be made again."""
    slot = _slot(2, numel=64)
    live = torch.ones(8)
    progress = CopyProgress(slot.buffers)

    def buckets(*tensors: torch.Tensor) -> list:
        return [("f", SHARD, ([], [(None, t) for t in tensors]))]

    assert progress.covers(buckets(slot.buffers[0].detach(), live.detach()), [live])
    assert progress.covers(buckets(slot.buffers[1][32:]), [])  # a view into a buffer
    assert not progress.covers(buckets(slot.buffers[1][32:].clone()), [])
    assert not progress.covers(buckets(live.detach()), [])  # not one of this save's


def test_the_write_order_follows_each_file_from_its_start():
    """Two files written at once: their tensors are needed by their offset in their file."""
    sizes = [8, 2, 4, 4, 1]
    buffers = [torch.zeros(n) for n in sizes]
    first = ("a", SHARD, ([], [(None, buffers[0]), (None, buffers[4])]))
    second = ("b", SHARD, ([], [(None, buffers[2]), (None, buffers[3]), (None, buffers[1])]))
    # Offsets: 0 -> 0, 4 -> 32; 2 -> 0, 3 -> 16, 1 -> 32 (bytes).
    assert write_order([first, second], buffers) == [0, 2, 3, 1, 4]
    assert write_order([], buffers) == [0, 1, 2, 3, 4]


def test_threads_waiting_for_one_tensor_all_wake_when_it_is_copied():
    slot = _slot(2, numel=8)
    progress = CopyProgress(slot.buffers)
    woke = []

    def wait() -> None:
        progress.wait_for(slot.buffers[1], time.monotonic() + 30)
        woke.append(True)

    threads = [threading.Thread(target=wait) for _ in range(3)]
    for thread in threads:
        thread.start()
    progress.copied([0])
    time.sleep(0.1)
    assert not woke
    progress.copied([1])
    for thread in threads:
        thread.join(30)
    assert len(woke) == 3
