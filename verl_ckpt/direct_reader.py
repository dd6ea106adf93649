"""Reading a torch_dist (DCP) directory with one copy per tensor.

DCP's FileSystemReader reads each saved tensor with `torch.load` into a new tensor, then
copies it into the tensor that receives it: two copies after the read. A tensor that
verl_ckpt wrote is always a whole, contiguous tensor whose `torch.save` blob holds exactly
one storage record, stored uncompressed. When the destination wants that whole tensor
(same shape and dtype, contiguous, on the host), this reader finds the record in the blob's
zip directory and reads the bytes straight into the destination. Anything else (a narrower
read when resharding, another dtype, a device tensor, an unexpected blob) goes through
DCP's own path, unchanged. Depends on torch only.
"""

from __future__ import annotations

import os
import struct
import sys
from dataclasses import replace
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner
from torch.futures import Future

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


class DirectFileSystemReader(FileSystemReader):
    """FileSystemReader that reads whole saved tensors straight into their destination."""

    def __init__(self, path: str | os.PathLike) -> None:
        super().__init__(path)
        self._chunks: dict[tuple[str, tuple[int, ...]], tuple[tuple[int, ...], torch.dtype]] = {}
        self._metadata: Metadata | None = None
        self.direct_reads = 0  # for tests and benchmarks: how many tensors took this path

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

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        by_file: dict[str, list] = {}
        for item in plan.items:
            by_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
        elsewhere = []
        for relative_path, items in by_file.items():
            # In file order: the plan lists tensors in state-dict order, which the writer's
            # split by size does not keep; read in that order from a cold page cache, the
            # kernel sees seeks back and forth and reads ahead little.
            items.sort(key=lambda item: self.storage_data[item.storage_index].offset)
            fd = os.open(self.fs.concat_path(self.path, relative_path), os.O_RDONLY)
            try:
                elsewhere += [item for item in items if not self._read_in_place(fd, item, planner)]
            finally:
                os.close(fd)
        if elsewhere:
            return super().read_data(replace(plan, items=elsewhere), planner)
        done: Future = Future()
        done.set_result(None)
        return done

    def _read_in_place(self, fd: int, item: Any, planner: LoadPlanner) -> bool:
        """Read one whole tensor into its destination; False: leave it to DCP's path."""
        if item.type != LoadItemType.TENSOR:
            return False
        info = self.storage_data[item.storage_index]
        chunk = self._chunks.get((item.storage_index.fqn, tuple(item.storage_index.offset)))
        if info.transform_descriptors or chunk is None:
            return False
        sizes, dtype = chunk
        if any(item.storage_offsets) or tuple(item.lengths) != sizes:
            return False  # a part of the saved tensor (resharding)
        target = planner.resolve_tensor(item).detach()
        if (
            target.device.type != "cpu"
            or target.dtype != dtype
            or tuple(target.shape) != sizes
            or not target.is_contiguous()
        ):
            return False
        nbytes = target.numel() * target.element_size()
        record = _storage_record(fd, info.offset, info.length)
        if record is None or record[1] != nbytes:
            return False
        _read_exactly(fd, _writable_bytes(target), record[0])
        planner.commit_tensor(item, target)
        self.direct_reads += 1
        return True


def _storage_record(fd: int, start: int, length: int) -> tuple[int, int] | None:
    """(absolute offset, size) of the single storage record of the `torch.save` blob at
    [start, start + length), or None if the blob is not the plain layout this reader knows
    (one storage, stored uncompressed, this machine's byte order, no ZIP64)."""
    if length < _EOCD.size:
        return None
    sig, _, _, _, entries, cd_size, cd_offset, comment = _EOCD.unpack(
        os.pread(fd, _EOCD.size, start + length - _EOCD.size)
    )
    if sig != _EOCD_SIG or comment or _ZIP64 in (cd_size, cd_offset):
        return None
    directory = os.pread(fd, cd_size, start + cd_offset)
    storages, byteorder, at = [], None, 0
    for _ in range(entries):
        fields = _CENTRAL.unpack_from(directory, at)
        method, size, stored_size = fields[4], fields[9], fields[8]
        name_len, extra_len, comment_len, local = fields[10], fields[11], fields[12], fields[16]
        name = directory[at + _CENTRAL.size : at + _CENTRAL.size + name_len].decode()
        at += _CENTRAL.size + name_len + extra_len + comment_len
        if fields[0] != _CENTRAL_SIG or _ZIP64 in (size, stored_size, local):
            return None
        parent, _, leaf = name.rpartition("/")
        if parent.endswith("/data") and leaf.isdigit():
            storages.append((local, size, method, stored_size))
        elif leaf == "byteorder":
            byteorder = (local, size)
    if len(storages) != 1 or byteorder is None:
        return None
    local, size, method, stored_size = storages[0]
    if method != 0 or stored_size != size:
        return None
    if _record_bytes(fd, start, *byteorder) != sys.byteorder.encode():
        return None
    offset = _record_offset(fd, start, local)
    return None if offset is None else (offset, size)


def _record_offset(fd: int, start: int, local: int) -> int | None:
    header = _LOCAL.unpack(os.pread(fd, _LOCAL.size, start + local))
    if header[0] != _LOCAL_SIG:
        return None
    return start + local + _LOCAL.size + header[9] + header[10]


def _record_bytes(fd: int, start: int, local: int, size: int) -> bytes | None:
    offset = _record_offset(fd, start, local)
    return None if offset is None else os.pread(fd, size, offset)


def _writable_bytes(tensor: torch.Tensor) -> memoryview:
    # A byte view of the tensor's memory (any dtype, numpy's included or not).
    return memoryview(tensor.reshape(-1).view(torch.uint8).numpy()).cast("B")


def _read_exactly(fd: int, view: memoryview, offset: int) -> None:
    done = 0
    while done < len(view):
        got = os.preadv(fd, [view[done:]], offset + done)
        if got == 0:
            raise EOFError(f"checkpoint file ended {len(view) - done} bytes early")
        done += got
