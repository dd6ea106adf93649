"""The systems under test and the floors, as they run inside one rank.

Each system has the same three calls, made by the rank actor (benchmarks/rank.py):
  save(step, directory)  the part the training thread waits for (timed as "blocking");
  wait()                 until this rank's part of the save is durable (fsynced; for DCP and
                         megatron-core also the collective finalize that writes the metadata);
  close()                stop every helper thread and process the system started.
For verl_ckpt, "durable" is the commit, which the driver waits for (`wait_for_commit`).
"""

from __future__ import annotations

import mmap
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from functools import partial
from pathlib import Path
from typing import Any

import torch

from benchmarks.state import RankState
from verl_ckpt.protocol.config import WriterConfig
from verl_ckpt.store.fsio import CHECKSUM_ALGORITHM, WRITEBACK_EVERY, EarlyWriteback, new_hasher

__all__ = ["FLOOR_BUFFERED", "FLOOR_VARIANTS", "SYSTEMS", "CopyFloor", "WriteFloor", "make_system"]

# name -> (kind, options); the order is the order of the report.
# Every verl_ckpt system calls manager.prepare() when it opens, as the recipe does after
# building its model, unless "prepare": False.
_THREAD = {"mode": "thread", "offload_aware": False}
SYSTEMS: dict[str, tuple[str, dict[str, Any]]] = {
    "verl_ckpt thread": ("verl", _THREAD),
    "verl_ckpt thread without prepare()": ("verl", {**_THREAD, "prepare": False}),
    "verl_ckpt thread nice 0": ("verl", {**_THREAD, "nice": 0}),
    "verl_ckpt thread no early writeback": (
        "verl",
        {**_THREAD, "direct_io": False, "early_writeback_mb": 0},
    ),
    "verl_ckpt thread page cache": ("verl", {**_THREAD, "direct_io": False}),
    "verl_ckpt thread not idle class": ("verl", {**_THREAD, "idle_class": False}),
    "verl_ckpt thread write while copying": ("verl", {**_THREAD, "write_while_copying": True}),
    "verl_ckpt thread write while copying in the normal class": (
        "verl",
        {**_THREAD, "write_while_copying": True, "idle_class": False},
    ),
    "verl_ckpt thread write while copying at nice 0": (
        "verl",
        {**_THREAD, "write_while_copying": True, "idle_class": False, "nice": 0},
    ),
    "verl_ckpt thread deferred": ("verl", {**_THREAD, "snapshot": "deferred"}),
    "verl_ckpt thread live": ("verl", {**_THREAD, "snapshot": "live"}),
    "verl_ckpt thread live one thread": ("verl", {**_THREAD, "snapshot": "live", "threads": 1}),
    "verl_ckpt thread live page cache": (
        "verl",
        {**_THREAD, "snapshot": "live", "direct_io": False},
    ),
    "verl_ckpt process": ("verl", {"mode": "process", "offload_aware": False}),
    "verl_ckpt inline": ("verl", {"mode": "inline", "offload_aware": False}),
    "verl_ckpt thread offload_aware": ("verl", {"mode": "thread", "offload_aware": True}),
    "torch.save": ("torch_save", {}),
    "mcore sync": ("mcore_sync", {}),
    "mcore async (fork)": ("mcore_async", {}),
    "DCP async thread": ("dcp", {"executor": "thread"}),
    "DCP async process": ("dcp", {"executor": "process"}),
}
REFERENCE = "verl_ckpt thread"
DCP_PEER = "DCP async thread"
# The RL idle window's mode: host tensors written from the trainer's memory, no copy.
LIVE_SNAPSHOT = "verl_ckpt thread live"


def verl_config(
    root: str,
    mode: str,
    offload_aware: bool,
    snapshot: str = "now",
    nice: int = 10,
    prepare: bool = True,
    early_writeback_mb: int = WriterConfig.early_writeback_mb,
    write_while_copying: bool = False,
    direct_io: bool = WriterConfig.direct_io,
    threads: int = 2,
    idle_class: bool = WriterConfig.idle_class,
) -> dict[str, Any]:
    """The checkpoint config of a verl_ckpt system (the driver's and the ranks' must match).
    `prepare` is no config key: the system calls manager.prepare() or not."""
    del prepare
    return {
        "root_dir": root,
        "save_contents": ["model", "optimizer"],
        "load_contents": ["model", "optimizer"],
        "timeout_s": 600.0,
        "snapshot": snapshot,
        "writer": {
            "mode": mode,
            "threads": threads,
            "nice": nice,
            "early_writeback_mb": early_writeback_mb,
            "write_while_copying": write_while_copying,
            "direct_io": direct_io,
            "idle_class": idle_class,
        },
        "staging": {"offload_aware": offload_aware},
    }


class VerlSystem:
    """verl_ckpt's CheckpointManager in one writer mode."""

    def __init__(self, state: RankState, root: str, **options: Any) -> None:
        from verl_ckpt import CheckpointManager

        self.state = state
        config = verl_config(root, **options)
        self.manager = CheckpointManager(config, "bench", state.rank, state.spec.world_size)
        if options.get("prepare", True):
            # At set-up, as a trainer does after building its model (every rank at once).
            self.manager.prepare(
                model=state.model_sharded_state_dict(),
                optimizer=state.optimizer_sharded_state_dict(),
            )

    def save(self, step: int, directory: Path) -> dict[str, Any]:
        import time

        start = time.perf_counter()
        model = self.state.model_sharded_state_dict()
        optimizer = self.state.optimizer_sharded_state_dict()
        build_s = time.perf_counter() - start
        stats = self.manager.save(step, model=model, optimizer=optimizer)
        return {**asdict(stats), "build_s": build_s}

    def quiet(self) -> Any:
        """What a trainer's optimizer step runs in with fence_before(): fence, writes paused."""
        return self.manager.quiet()

    def fence(self) -> None:
        """What a trainer without quiet() calls before it changes the state: required after a
        deferred save (its copy may not have run yet), at once done after any other."""
        self.manager.fence()

    def load(self, step_dir: Path, templates: dict[str, Any], verify: bool) -> dict[str, Any]:
        """A resuming trainer's load of a committed step into its live tensors, through
        `templates` ("model" and "optimizer" sharded state dicts of them); where its time
        went (LoadStats, as a dict)."""
        self.manager.config.verify_checksums_on_load = verify
        self.manager.load(step_dir, model=templates["model"], optimizer=templates["optimizer"])
        assert self.manager.last_load is not None
        return asdict(self.manager.last_load)

    def wait(self) -> dict[str, Any]:
        done = self.manager.wait()
        return asdict(done[-1]) if done else {}

    def close(self) -> None:
        self.manager.close()

    def helper_pids(self) -> list[int]:
        pid = self.manager.writer_pid
        return [pid] if pid else []


class TorchSaveSystem:
    """`torch.save` of the rank's tensors into one file, then fsync: fully synchronous."""

    def __init__(self, state: RankState) -> None:
        self.state = state

    def save(self, step: int, directory: Path) -> dict[str, Any]:
        directory.mkdir(parents=True, exist_ok=True)
        with open(directory / f"rank{self.state.rank}.pt", "wb") as f:
            torch.save(self.state.tensors(), f)
            f.flush()
            os.fsync(f.fileno())
        return {}

    def wait(self) -> dict[str, Any]:
        return {}

    def close(self) -> None:
        pass


class McoreSyncSystem:
    """megatron-core `dist_checkpointing.save` (torch_dist), synchronous, CPU workaround."""

    def __init__(self, state: RankState) -> None:
        from benchmarks.mcore_cpu import CpuTorchDistSaveStrategy

        self.state = state
        self.strategy = CpuTorchDistSaveStrategy("torch_dist", 1)

    def save(self, step: int, directory: Path) -> dict[str, Any]:
        from megatron.core import dist_checkpointing

        directory.mkdir(parents=True, exist_ok=True)
        dist_checkpointing.save(
            self.state.sharded_state_dict(), str(directory), sharded_strategy=self.strategy
        )
        return {}

    def wait(self) -> dict[str, Any]:
        return {}

    def close(self) -> None:
        from benchmarks.mcore_cpu import shutdown_manager

        shutdown_manager()


class McoreAsyncSystem:
    """megatron-core's async save as verl drives it: `dist_checkpointing.save(...,
    async_sharded_save=True)`, a fork per save (TemporalAsyncCaller), and the collective
    finalize (`maybe_finalize_async_calls`), here called with blocking=True right away, the
    earliest a trainer polling every step could finalize."""

    def __init__(self, state: RankState) -> None:
        from benchmarks.mcore_cpu import CpuAsyncCallsQueue, CpuTorchDistSaveStrategy

        self.state = state
        self.strategy = CpuTorchDistSaveStrategy("torch_dist", 1)
        self.queue = CpuAsyncCallsQueue()

    def save(self, step: int, directory: Path) -> dict[str, Any]:
        from megatron.core import dist_checkpointing

        directory.mkdir(parents=True, exist_ok=True)
        request = dist_checkpointing.save(
            self.state.sharded_state_dict(),
            str(directory),
            sharded_strategy=self.strategy,
            async_sharded_save=True,
        )
        self.queue.schedule_async_request(request)
        return {}

    def wait(self) -> dict[str, Any]:
        self.queue.maybe_finalize_async_calls(blocking=True)
        return {}

    def close(self) -> None:
        from benchmarks.mcore_cpu import shutdown_manager

        self.queue.maybe_finalize_async_calls(blocking=True)
        shutdown_manager()


class DcpSystem:
    """PyTorch DCP `async_save` of DTensors with a long-lived `DefaultStager` (its staging
    storages are cached and reused from the second save on, as torchtitan keeps one).

    On CPU the stager can use neither pinned memory, nor async staging, nor non-blocking
    copies (each needs an accelerator): StagingOptions(False, shared, False, False), with
    shared memory for the process executor so that the staged tensors reach its process
    without a copy.
    """

    def __init__(self, state: RankState, executor: str) -> None:
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
        from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
        from torch.distributed.device_mesh import init_device_mesh

        self.state = state
        self.process = executor == "process"
        self.kind = AsyncCheckpointerType.PROCESS if self.process else AsyncCheckpointerType.THREAD
        self.mesh = init_device_mesh("cpu", (state.spec.world_size,))
        self.stager = DefaultStager(
            StagingOptions(
                use_pinned_memory=False,
                use_shared_memory=self.process,
                use_async_staging=False,
                use_non_blocking_copy=False,
            )
        )
        self.future = None

    def save(self, step: int, directory: Path) -> dict[str, Any]:
        import torch.distributed.checkpoint as dcp

        response = dcp.async_save(
            self.state.dtensor_state_dict(self.mesh),
            checkpoint_id=str(directory),
            async_checkpointer_type=self.kind,
            async_stager=self.stager,
        )
        self.future = getattr(response, "upload_completion", response)
        return {}

    def wait(self) -> dict[str, Any]:
        if self.future is not None:
            self.future.result()
            self.future = None
        return {}

    def close(self) -> None:
        self.wait()
        self.stager.close()
        if self.process:
            stop_dcp_process()


def stop_dcp_process(timeout_s: float = 30.0) -> None:
    """Stop DCP's checkpoint process (a module global that lives until interpreter exit)."""
    from torch.distributed.checkpoint import _async_process_executor as executor

    proc = executor._CHECKPOINT_PROCESS
    if proc is None:
        return
    executor._CHECKPOINT_PROCESS = None
    try:
        proc._send(executor._CheckpointSaveProcessControlOpts.TERMINATE)
    except (OSError, ValueError):
        pass
    proc._save_process.join(timeout_s)
    if proc._save_process.is_alive():
        proc._save_process.kill()
        proc._save_process.join(10)


def make_system(name: str, state: RankState, root: str) -> Any:
    kind, options = SYSTEMS[name]
    if kind == "verl":
        return VerlSystem(state, root, **options)
    if kind == "torch_save":
        return TorchSaveSystem(state)
    if kind == "mcore_sync":
        return McoreSyncSystem(state)
    if kind == "mcore_async":
        return McoreAsyncSystem(state)
    if kind == "dcp":
        return DcpSystem(state, **options)
    raise ValueError(f"unknown system {name!r}")


# ---- floors --------------------------------------------------------------------------------


class CopyFloor:
    """One copy of the state into host memory allocated and touched beforehand: the least a
    snapshot can cost on this machine."""

    def __init__(self, state: RankState) -> None:
        self.sources = list(state.tensors().values())
        self.buffers = [torch.empty_like(t) for t in self.sources]
        for b in self.buffers:
            b.zero_()

    def run(self) -> None:
        for buffer, source in zip(self.buffers, self.sources, strict=True):
            buffer.copy_(source)


# The ways the write floor puts the bytes on disk; the benchmark's "write floor" is the
# fastest of them in each pairing: the least persistence costs on this machine, however it
# is done. O_DIRECT writes from page-aligned copies made beforehand (as a snapshot's staging
# buffers are), whole, with no page cache; "x2" splits each rank's bytes over two threads.
FLOOR_BUFFERED = "buffered"
FLOOR_EARLY = "early writeback"
FLOOR_DIRECT = "O_DIRECT"
FLOOR_DIRECT_2 = "O_DIRECT x2 threads"
FLOOR_VARIANTS = (FLOOR_BUFFERED, FLOOR_EARLY, FLOOR_DIRECT, FLOOR_DIRECT_2)


class WriteFloor:
    """A raw sequential write of the host `tensors`' bytes into one file, then fsync: the
    least persistence can cost (no serialisation, no checksum, no metadata), in each of
    FLOOR_VARIANTS."""

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        self.sources = tensors
        # The O_DIRECT variants' page-aligned copy of the bytes, made here, outside timings.
        nbytes = sum(t.numel() * t.element_size() for t in tensors)
        self._aligned = mmap.mmap(-1, -(-nbytes // _DIRECT_ALIGN) * _DIRECT_ALIGN)
        offset = 0
        for tensor in tensors:
            view = memoryview(tensor.numpy()).cast("B")
            self._aligned[offset : offset + view.nbytes] = view
            offset += view.nbytes

    def run(self, path: Path, variant: str = FLOOR_BUFFERED) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        if variant == FLOOR_BUFFERED:
            _raw_write(path, self.sources, checksum=None)
        elif variant == FLOOR_EARLY:
            _raw_write(path, self.sources, checksum=None, early_writeback=True)
        elif variant in (FLOOR_DIRECT, FLOOR_DIRECT_2):
            self._direct_write(path, 2 if variant == FLOOR_DIRECT_2 else 1)
        else:
            raise ValueError(variant)

    def _direct_write(self, path: Path, threads: int) -> None:
        buffer = memoryview(self._aligned)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
        try:
            share = -(-len(buffer) // threads // _DIRECT_CHUNK) * _DIRECT_CHUNK

            def part(start: int) -> None:
                end = min(start + share, len(buffer))
                while start < end:
                    step = min(_DIRECT_CHUNK, end - start)
                    start += os.pwrite(fd, buffer[start : start + step], start)

            starts = range(0, len(buffer), share)
            with ThreadPoolExecutor(threads) as pool:
                list(pool.map(part, starts))
            os.fsync(fd)
        finally:
            os.close(fd)
            buffer.release()


_DIRECT_ALIGN = 4096
_DIRECT_CHUNK = 8 << 20


# ---- why time to durable is above the write floor ------------------------------------------


class WritePath:
    """The pieces of verl_ckpt's write path, each timed alone on the same bytes.

    `verl files xN` runs verl_ckpt's own `file_writer.write_bucket` (a torch.save blob per
    tensor without torch's zip CRC32, torch_format.py; the checksumming stream with early
    writeback; fsync) on the rank's tensors split into N files written by N threads, as its
    thread writer does; `, no early writeback` is the same with the stream's writeback off;
    `, DCP items with torch's crc32` writes the blobs with DCP's `_write_item` (torch.save
    with its CRC32, what verl_ckpt did before); `plain files x1` is the CRC-free blobs
    without the checksumming stream or early writeback; `raw + <algorithm>` is the write
    floor plus that checksum over the bytes on the writing thread; `write floor, early
    writeback` is the write floor handing its bytes to the disk every 4 MiB, as verl_ckpt's
    stream does.
    """

    def __init__(self, state: RankState) -> None:
        self.state = state
        self.sources = list(state.tensors().items())

    def run(self, variant: str, directory: Path, copy_floor: CopyFloor) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        tensors = [t for _, t in self.sources]
        if variant.startswith("raw + "):
            _raw_write(directory / "raw.bin", tensors, checksum=variant.removeprefix("raw + "))
        elif variant == EARLY_FLOOR:
            _raw_write(directory / "raw.bin", tensors, checksum=None, early_writeback=True)
        elif variant == "copy, then write floor":
            copy_floor.run()
            _raw_write(directory / "raw.bin", tensors, checksum=None)
        elif variant.startswith(("verl files", "plain files")):
            files = int(variant.split(",")[0].split("x")[-1])
            if variant.startswith("plain"):
                write = partial(_write_bucket_bare, dcp_items=False)
            elif variant.endswith(DCP_CRC):
                write = partial(_write_bucket_bare, dcp_items=True, checksummed=True)
            elif variant.endswith(NO_WRITEBACK):
                write = partial(_write_bucket_bare, dcp_items=False, checksummed=True)
            else:
                from verl_ckpt.format.file_writer import write_bucket as write
            self._files(directory, files, write)
        else:
            raise ValueError(variant)

    def _files(self, directory: Path, files: int, write: Any) -> None:
        from concurrent.futures import ThreadPoolExecutor

        from torch.distributed.checkpoint.filesystem import _StorageWriterTransforms

        buckets = _buckets(self.sources, directory, files)
        transforms = _StorageWriterTransforms()
        with ThreadPoolExecutor(files) as pool:
            list(pool.map(write, buckets, [transforms] * len(buckets)))


DCP_CRC = "DCP items with torch's crc32"
NO_WRITEBACK = "no early writeback"
EARLY_FLOOR = "write floor, early writeback"
RAW_CHECKSUMMED = f"raw + {CHECKSUM_ALGORITHM}"
WRITE_PATH_VARIANTS = (
    EARLY_FLOOR,
    RAW_CHECKSUMMED,
    "raw + crc32",
    "plain files x1",
    "verl files x1",
    "verl files x2",
    f"verl files x2, {NO_WRITEBACK}",
    f"verl files x2, {DCP_CRC}",
    "copy, then write floor",
)


def _raw_write(
    path: Path, tensors: list[torch.Tensor], checksum: str | None, early_writeback: bool = False
) -> None:
    hasher = new_hasher(checksum) if checksum else None
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    # verl_ckpt's own early writeback (its helper thread), or none.
    writeback = EarlyWriteback(fd, WRITEBACK_EVERY if early_writeback else 0)
    written = 0
    try:
        for tensor in tensors:
            view = memoryview(tensor.numpy()).cast("B")
            if hasher is not None:
                hasher.update(view)
            while view:
                done = os.write(fd, view)
                view = view[done:]
                written += done
                writeback.advance(written)
        os.fsync(fd)
    finally:
        writeback.close()
        os.close(fd)


def _buckets(sources: list[tuple[str, torch.Tensor]], directory: Path, files: int) -> list:
    """DCP write buckets over whole tensors, balanced by size (as megatron-core splits)."""
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        MetadataIndex,
        TensorProperties,
    )
    from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

    bins: list[list] = [[] for _ in range(files)]
    sizes = [0] * files
    for key, tensor in sorted(sources, key=lambda kv: -kv[1].numel()):
        i = sizes.index(min(sizes))
        offsets = torch.Size([0] * tensor.dim())
        item = WriteItem(
            index=MetadataIndex(key, offsets),
            type=WriteItemType.TENSOR,
            tensor_data=TensorWriteData(
                chunk=ChunkStorageMetadata(offsets=offsets, sizes=tensor.size()),
                properties=TensorProperties.create_from_tensor(tensor),
                size=tensor.size(),
            ),
        )
        bins[i].append((item, tensor))
        sizes[i] += tensor.numel() * tensor.element_size()
    return [
        (str(directory / f"__0_{i}.distcp"), f"__0_{i}.distcp", ([], items))
        for i, items in enumerate(bins)
        if items
    ]


def _write_bucket_bare(
    bucket: tuple, transforms: Any, dcp_items: bool, checksummed: bool = False
) -> None:
    """One bucket's file like `write_bucket`, with pieces taken out: `dcp_items` writes the
    blobs with DCP's `_write_item` (torch.save with its zip CRC32) instead of verl_ckpt's
    CRC-free blobs; without `checksummed`, no checksumming stream; never early writeback."""
    from torch.distributed.checkpoint.filesystem import SerializationFormat, _write_item

    from verl_ckpt.format.torch_format import write_item
    from verl_ckpt.store.fsio import ChecksummingWriter

    path, storage_key, (_, tensor_data) = bucket
    with open(path, "wb") as raw:
        stream = ChecksummingWriter(raw, writeback_every=0) if checksummed else raw
        for item, data in tensor_data:
            if dcp_items:
                format = SerializationFormat.TORCH_SAVE
                _write_item(
                    transforms, stream, data, item, storage_key, serialization_format=format
                )
            else:
                write_item(transforms, stream, data, item, storage_key)
        raw.flush()
        os.fsync(raw.fileno())
