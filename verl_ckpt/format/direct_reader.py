"""Reading a torch_dist (DCP) directory with one copy per tensor.

DCP's FileSystemReader reads each saved tensor with `torch.load` into a new tensor, then
copies it into the tensor that receives it: two copies after the read. A tensor that
verl_ckpt wrote is always a whole, contiguous tensor whose `torch.save` blob holds exactly
one storage record, stored uncompressed. When the destination wants that whole tensor
(same shape and dtype), this reader finds the record in the blob's zip directory, checks
that the blob's pickle is the one verl_ckpt writes for such a tensor (torch_format), and
reads the bytes straight into the destination when it is contiguous host memory, or else
(a GPU tensor, a strided view) into host memory of the tensor's size, then copied into it:
one copy after the read where DCP's path makes two. Anything else (a narrower read when
resharding, another dtype, another pickle: a saved view, a tensor saved with its grad flag)
goes through DCP's own path, unchanged; nothing from the checkpoint is unpickled with the
full unpickler (safe_reader.SafeFileSystemReader, whose `.metadata` and byte items this
reader reads). Depends on torch, torch_format and safe_reader only.

How the bytes are read: a file's blobs are read in file order, and a run of consecutive
blobs that have exactly the length of verl_ckpt's blob for their tensor (torch_format's
template) is read with one call of up to 32 MiB: each head and tail, and the padding that
aligns each blob (torch_format), into scratch memory, each storage straight into its
destination. A blob whose head or tail then differs from
the template (another writer: torch.save with its CRCs, another pickle) is read again
through its zip directory, found at the blob's end, and its pickle checked. From a cold
page cache one sequential stream per file is what the kernel reads ahead best, and a
rank's files are read by one thread each (up to four), which is steadier than one thread
(figures: benchmarks/README.md, "Why the defaults are what they are").
"""

from __future__ import annotations

import functools
import os
import struct
import sys
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    Metadata,
    MetadataIndex,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner
from torch.futures import Future

from verl_ckpt.format.safe_reader import SafeFileSystemReader
from verl_ckpt.format.torch_format import PAGE_BYTES, BlobLayout, whole_tensor_blob_layout
from verl_ckpt.protocol.errors import CheckpointError
from verl_ckpt.store.fsio import open_regular
from verl_ckpt.store.layout import checked_relative_path

__all__ = ["DirectFileSystemReader"]

# ZIP structures (APPNOTE.TXT): end of central directory, central directory entry, local
# file header; little-endian.
_EOCD = struct.Struct("<IHHHHIIH")
_EOCD_SIG = 0x06054B50
_CENTRAL = struct.Struct("<IHHHHHHIIIHHHHHII")
_CENTRAL_SIG = 0x02014B50
_LOCAL = struct.Struct("<IHHHHHIIIHH")
_LOCAL_SIG = 0x04034B50
_ZIP64 = 0xFFFFFFFF


class DirectFileSystemReader(SafeFileSystemReader):
    """FileSystemReader that reads whole saved tensors straight into their destination."""

    def __init__(self, path: str | os.PathLike) -> None:
        super().__init__(path)
        self._chunks: dict[tuple[str, tuple[int, ...]], tuple[tuple[int, ...], torch.dtype]] = {}
        self._metadata: Metadata | None = None
        # For tests and benchmarks: how many tensors were read in place, and how many of
        # those on the sequential path (their blob exactly verl_ckpt's template).
        self.direct_reads = 0
        self.templated_reads = 0

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        # Read once: DCP asks for it while planning and megatron-core again after the load.
        if self._metadata is None:
            self._metadata = super().read_metadata(*args, **kwargs)
        return self._metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any) -> None:
        super().set_up_storage_reader(metadata, is_coordinator, *args)
        for fqn, meta in metadata.state_dict_metadata.items():
            if isinstance(meta, TensorStorageMetadata):
                for chunk in meta.chunks:
                    key = (fqn, tuple(chunk.offsets))
                    self._chunks[key] = (tuple(chunk.sizes), meta.properties.dtype)

    def read_whole_chunks(
        self, metadata: Metadata, targets: dict[MetadataIndex, torch.Tensor]
    ) -> set[MetadataIndex]:
        """Read saved chunks, each whole into a tensor of its shape and dtype, with no DCP
        load plan (a caller that knows its destinations need not pay for one); returns the
        chunks not read (not saved as such, another dtype or shape, a blob this reader does
        not know), for DCP's path."""
        self.set_up_storage_reader(metadata, False)
        _, left = self._read_where_possible(
            (index, self._whole_chunk_read(index, target.detach(), item=index))
            for index, target in targets.items()
        )
        return set(left)

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        # Destinations are resolved (and committed, below) on this thread, in the plan's
        # order: a planner may keep state between an item's resolve and its commit.
        done, elsewhere = self._read_where_possible(
            (item, self._direct_read(item, planner)) for item in plan.items
        )
        for read in done:
            planner.commit_tensor(read.item, read.target)
        if elsewhere:
            return super().read_data(replace(plan, items=elsewhere), planner)
        future: Future = Future()
        future.set_result(None)
        return future

    def _read(self, reads: list[_DirectRead]) -> list[_DirectRead]:
        """Do the reads, file by file; every device copy has finished when this returns."""
        by_file: dict[str, list[_DirectRead]] = {}
        for read in reads:
            by_file.setdefault(read.info.relative_path, []).append(read)
        # One thread per file (up to _READ_THREADS): from a cold page cache, several
        # sequential streams keep the disk busier than one.
        workers = min(len(by_file), _READ_THREADS)
        if workers > 1:
            with ThreadPoolExecutor(workers, thread_name_prefix="verl_ckpt_read") as pool:
                done = [
                    read
                    for file_reads in pool.map(self._read_file, by_file.items())
                    for read in file_reads
                ]
        else:
            done = [read for entry in by_file.items() for read in self._read_file(entry)]
        if any(read.done and not read.in_place for read in done):
            _synchronize_devices([read.target for read in done])
        return done

    def _read_where_possible(
        self, candidates: Iterable[tuple[Any, _DirectRead | None]]
    ) -> tuple[list[_DirectRead], list[Any]]:
        """Do the direct reads among `candidates` ((what asked, its read or None), taken in
        order); returns the reads done and, in order, what is left for DCP's path (no direct
        read, or a blob this reader does not know)."""
        reads, left = [], []
        for asked, read in candidates:
            if read is None:
                left.append(asked)
            else:
                reads.append(read)
        done = []
        for read in self._read(reads):
            if read.done:
                done.append(read)
                self.direct_reads += 1
                self.templated_reads += read.templated
            else:
                left.append(read.item)
        return done, left

    def _direct_read(self, item: Any, planner: LoadPlanner) -> _DirectRead | None:
        """The read of one whole saved tensor into its destination; None: leave it to DCP's
        path (a part of a tensor, another dtype)."""
        if item.type != LoadItemType.TENSOR:
            return None
        chunk = self._chunks.get((item.storage_index.fqn, tuple(item.storage_index.offset)))
        if chunk is None or any(item.storage_offsets) or tuple(item.lengths) != chunk[0]:
            return None  # not a saved chunk, or a part of one (resharding)
        target = planner.resolve_tensor(item).detach()
        if getattr(planner, "_intermediate_read_item_and_target", None) is not None:
            # megatron-core's planner hands a strided FP8 tensor out as a contiguous stand-in
            # that its commit copies back, and checks that the next commit is this item's:
            # DCP's path resolves it again and commits it; the stand-in is forgotten here.
            planner._intermediate_read_item_and_target = None  # type: ignore[attr-defined]
            return None
        return self._whole_chunk_read(item.storage_index, target, item)

    def _whole_chunk_read(
        self, index: MetadataIndex, target: torch.Tensor, item: Any
    ) -> _DirectRead | None:
        """The read of the saved chunk `index`, whole, into `target`; None where the chunk
        is not saved as such, or `target` has another shape or dtype."""
        chunk = self._chunks.get((index.fqn, tuple(index.offset)))
        info = self.storage_data.get(index)
        if chunk is None or info is None or info.transform_descriptors:
            return None
        sizes, dtype = chunk
        if target.dtype != dtype or tuple(target.shape) != sizes:
            return None
        in_place = target.device.type == "cpu" and target.is_contiguous()
        return _DirectRead(item, info, target, _layout(sizes, dtype), in_place)

    def _read_file(self, entry: tuple[str, list[_DirectRead]]) -> list[_DirectRead]:
        relative_path, reads = entry
        # In file order: the plan lists tensors in state-dict order, which the writer's split
        # by size does not keep.
        reads.sort(key=lambda read: read.info.offset)
        # The name comes from `.metadata`, data from the root: it must stay below the role's
        # directory, and only a regular file is read (a FIFO would hang the load).
        checked_relative_path(
            relative_path, f"{self.path}/.metadata: a storage file name", CheckpointError
        )
        path = self.fs.concat_path(self.path, relative_path)
        fd = open_regular(path)
        try:
            for run in _runs_of_templated_blobs(reads):
                _read_run(fd, run)
                if not any(read.done for read in run):
                    # Not one blob as verl_ckpt writes it: another writer's file (torch.save
                    # with its CRCs has the template's lengths). Each blob of a run is read
                    # twice when its check fails: the rest goes straight to the zip
                    # directory path.
                    break
            for read in reads:
                if not read.done:
                    read.done = _read_parsed(fd, read)
        except EOFError as exc:
            raise EOFError(f"{path}: {exc}") from None
        finally:
            os.close(fd)
        return reads


# Threads reading one rank's files at once (one per file).
_READ_THREADS = 4
# One scattered read covers consecutive blobs up to this many bytes (or the system's limit
# of buffers per call): large enough that the kernel sees a long sequential read.
_RUN_BYTES = 32 << 20
_RUN_BUFFERS = min(os.sysconf("SC_IOV_MAX"), 1024) if hasattr(os, "sysconf") else 1024
# Blobs this close are read by one call, the bytes between them into scratch memory: the
# writer pads each blob's start to torch's storage alignment, and up to a page before a large
# storage (torch_format._pad_before_blob).
_MAX_GAP = PAGE_BYTES


@dataclass
class _DirectRead:
    """One whole tensor to read straight into `target`; `layout`: the blob verl_ckpt would
    have written for it (None where blobs are not made from templates on this torch)."""

    item: Any  # DCP's ReadItem, or the chunk's MetadataIndex (read_whole_chunks)
    info: Any
    target: torch.Tensor
    layout: BlobLayout | None
    # The bytes land in `target` itself (contiguous host memory), or else in host memory
    # that is then copied into it (`_landing`, `_deliver`).
    in_place: bool
    done: bool = False
    templated: bool = False  # read on the sequential path


def _landing(read: _DirectRead) -> torch.Tensor:
    """Host memory the tensor's bytes are read into: its destination, or a staging tensor
    of its size, pinned for a GPU destination. Made when its run is read, so that a load into
    GPU tensors holds a few runs on the host, never the whole state."""
    if read.in_place:
        return read.target
    pinned = read.target.device.type == "cuda"
    return torch.empty(read.target.shape, dtype=read.target.dtype, pin_memory=pinned)


def _deliver(read: _DirectRead, landing: torch.Tensor) -> None:
    if landing is read.target:
        return
    # From pinned memory the copy is queued and the thread reads on: the device copies one
    # run while the next is read (from pageable memory it would run in line with the reads,
    # and slower). `landing` can be dropped at once: torch's pinned-memory cache keeps its
    # block from reuse until the copy that reads it has finished (the copy records an event).
    # Every device copy is waited for before any commit (_synchronize_devices).
    read.target.copy_(landing, non_blocking=landing.is_pinned())


def _synchronize_devices(targets: list[torch.Tensor]) -> None:
    # The reading threads copied on their own current stream (the default one): the state
    # must be on the device before the load returns and the trainer's streams use it.
    for device in {t.device for t in targets if t.device.type == "cuda"}:
        torch.cuda.synchronize(device)


def _runs_of_templated_blobs(reads: list[_DirectRead]) -> list[list[_DirectRead]]:
    """Consecutive blobs (in file order) of exactly their template's length, in runs of at
    most _RUN_BYTES, each read with one call. Consecutive: at most the writer's alignment
    padding between them (torch_format pads each blob's start to 64 bytes, or up to a page
    before a large storage)."""
    runs: list[list[_DirectRead]] = []
    run: list[_DirectRead] = []
    end = run_bytes = run_buffers = 0
    for read in reads:
        layout = read.layout
        if layout is None or _layout_length(layout) != read.info.length:
            continue
        gap = read.info.offset - end
        # Head, storage and tail, and the padding before the blob if any (_read_run).
        buffers = 3 + (gap > 0)
        if run and (
            not 0 <= gap < _MAX_GAP
            or run_bytes + read.info.length > _RUN_BYTES
            or run_buffers + buffers > _RUN_BUFFERS
        ):
            runs.append(run)
            run, run_bytes, run_buffers = [], 0, 0
        if not run:
            buffers = 3  # a run starts at its first blob
        run.append(read)
        end = read.info.offset + read.info.length
        run_bytes += read.info.length
        run_buffers += buffers
    if run:
        runs.append(run)
    return runs


def _read_run(fd: int, run: list[_DirectRead]) -> None:
    """Read consecutive templated blobs with one call: each head and tail into scratch
    memory, each storage straight into its destination. A blob whose head or tail differs
    from its template (another writer: torch.save with its CRCs) is left not done; its
    destination then holds bytes that the parsed read or DCP's path overwrites."""
    buffers: list[memoryview] = []
    # Each blob's head and tail, in scratch memory, to compare with its template.
    heads_and_tails: list[tuple[memoryview, memoryview]] = []
    landings = [_landing(read) for read in run]
    end = run[0].info.offset
    for read, landing in zip(run, landings, strict=True):
        layout = read.layout
        assert layout is not None  # runs hold templated blobs only
        if read.info.offset > end:  # the padding before an aligned blob, never looked at
            buffers.append(memoryview(bytearray(read.info.offset - end)))
        head, tail = (
            memoryview(bytearray(len(layout.head))),
            memoryview(bytearray(len(layout.tail))),
        )
        buffers += [head, _writable_bytes(landing), tail]
        heads_and_tails.append((head, tail))
        end = read.info.offset + read.info.length
    _read_exactly_into(fd, buffers, run[0].info.offset)
    for read, landing, (head, tail) in zip(run, landings, heads_and_tails, strict=True):
        layout = read.layout
        assert layout is not None
        read.done = read.templated = head == layout.head and tail == layout.tail
        if read.done:
            _deliver(read, landing)


def _read_parsed(fd: int, read: _DirectRead) -> bool:
    """Read one blob found through its zip directory; False: not a blob this reader knows."""
    sizes, dtype = tuple(read.target.shape), read.target.dtype
    nbytes = read.target.numel() * read.target.element_size()
    record = _storage_record(fd, read.info.offset, read.info.length, sizes, dtype)
    if record is None or record[1] != nbytes:
        return False
    landing = _landing(read)
    _read_exactly(fd, _writable_bytes(landing), record[0])
    _deliver(read, landing)
    return True


# Reads `size` bytes at `offset` of one blob (relative to the blob's start).
_BlobRead = Callable[[int, int], bytes]


def _storage_record(
    fd: int, start: int, length: int, sizes: tuple[int, ...], dtype: torch.dtype
) -> tuple[int, int] | None:
    """(absolute offset, size) of the single storage record of the `torch.save` blob at
    [start, start + length), or None if the blob is not one this reader knows: one storage,
    stored uncompressed, this machine's byte order, no ZIP64, and a pickle that is the one
    verl_ckpt writes for a whole contiguous tensor of `sizes` and `dtype`. The pickle holds
    the saved tensor's strides and storage offset: a transposed tensor saved with a storage
    of exactly its size has a storage record of the same size, in another element order."""
    expected_pickle = _expected_pickle(sizes, dtype)
    if expected_pickle is None:
        return None  # nothing to check the pickle against

    def read(offset: int, size: int) -> bytes:
        return os.pread(fd, size, start + offset)

    records = _zip_records(read, length)
    if records is None:
        return None
    storages = [name for name in records if _is_storage(name)]
    if len(storages) != 1 or "byteorder" not in records or "data.pkl" not in records:
        return None
    local, size, method, stored_size = records[storages[0]]
    if method != 0 or stored_size != size:
        return None
    if _record_bytes(read, records["byteorder"]) != sys.byteorder.encode():
        return None
    if _record_bytes(read, records["data.pkl"]) != expected_pickle:
        return None
    offset = _record_offset(read, local)
    return None if offset is None else (start + offset, size)


@functools.lru_cache(maxsize=1024)
def _layout(sizes: tuple[int, ...], dtype: torch.dtype) -> BlobLayout | None:
    # Kept per geometry: a load asks for each tensor's, and making one (torch's serialization
    # settings read through its config module) costs more than reading a small tensor.
    return whole_tensor_blob_layout(sizes, dtype)


@functools.lru_cache(maxsize=1024)
def _expected_pickle(sizes: tuple[int, ...], dtype: torch.dtype) -> bytes | None:
    """The pickle record of the blob verl_ckpt writes for a whole tensor of this geometry;
    None where it cannot be known (no blob templates on this torch)."""
    layout = _layout(sizes, dtype)
    if layout is None:
        return None
    read = _layout_read(layout)
    records = _zip_records(read, _layout_length(layout))
    pickled = None if records is None else records.get("data.pkl")
    return None if pickled is None else _record_bytes(read, pickled)


def _zip_records(read: _BlobRead, length: int) -> dict[str, tuple[int, int, int, int]] | None:
    """The blob's records by name (the part after the archive's folder, e.g. "data.pkl",
    "data/0"): (local header offset, size, compression method, stored size); None for a
    blob that is not a plain zip (ZIP64, a comment, a bad signature)."""
    if length < _EOCD.size:
        return None
    sig, _, _, _, entries, cd_size, cd_offset, comment = _EOCD.unpack(
        read(length - _EOCD.size, _EOCD.size)
    )
    if sig != _EOCD_SIG or comment or _ZIP64 in (cd_size, cd_offset):
        return None
    directory = read(cd_offset, cd_size)
    records, at = {}, 0
    for _ in range(entries):
        fields = _CENTRAL.unpack_from(directory, at)
        method, size, stored_size = fields[4], fields[9], fields[8]
        name_len, extra_len, comment_len, local = fields[10], fields[11], fields[12], fields[16]
        name = directory[at + _CENTRAL.size : at + _CENTRAL.size + name_len].decode()
        at += _CENTRAL.size + name_len + extra_len + comment_len
        if fields[0] != _CENTRAL_SIG or _ZIP64 in (size, stored_size, local):
            return None
        records[name.partition("/")[2]] = (local, size, method, stored_size)
    return records


def _is_storage(name: str) -> bool:
    folder, _, leaf = name.rpartition("/")
    return folder == "data" and leaf.isdigit()


def _layout_length(layout: BlobLayout) -> int:
    return len(layout.head) + layout.storage_nbytes + len(layout.tail)


def _layout_read(layout: BlobLayout) -> _BlobRead:
    """Reads of a blob layout's head and tail (never of its storage: that is not there)."""
    tail_start = len(layout.head) + layout.storage_nbytes

    def read(offset: int, size: int) -> bytes:
        if offset + size <= len(layout.head):
            return layout.head[offset : offset + size]
        if offset >= tail_start:
            return layout.tail[offset - tail_start : offset - tail_start + size]
        return b""  # spans the storage: matches no record a check compares

    return read


def _record_offset(read: _BlobRead, local: int) -> int | None:
    header = _LOCAL.unpack(read(local, _LOCAL.size))
    if header[0] != _LOCAL_SIG:
        return None
    return local + _LOCAL.size + header[9] + header[10]


def _record_bytes(read: _BlobRead, record: tuple[int, int, int, int]) -> bytes | None:
    local, size, method, stored_size = record
    offset = _record_offset(read, local)
    if offset is None or method != 0 or stored_size != size:
        return None
    return read(offset, size)


def _writable_bytes(tensor: torch.Tensor) -> memoryview:
    # A byte view of the tensor's memory (any dtype, numpy's included or not).
    return memoryview(tensor.reshape(-1).view(torch.uint8).numpy()).cast("B")


def _read_exactly(fd: int, view: memoryview, offset: int) -> None:
    _read_exactly_into(fd, [view], offset)


def _read_exactly_into(fd: int, buffers: list[memoryview], offset: int) -> None:
    """Fill `buffers`, in order, from the file at `offset` (a read may return less than
    asked: Linux caps one call at about 2 GiB)."""
    pending = [view for view in buffers if len(view)]
    while pending:
        got = os.preadv(fd, pending, offset)
        if got == 0:
            missing = sum(len(view) for view in pending)
            raise EOFError(f"checkpoint file ended {missing} bytes early")
        offset += got
        while pending and got >= len(pending[0]):
            got -= len(pending.pop(0))
        if got:
            pending[0] = pending[0][got:]
