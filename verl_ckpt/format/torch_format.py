"""One DCP write item into a stream, in the format DCP's FileSystemReader reads (for a tensor:
a `torch.save` blob), without torch.save's per-record zip CRC32.

Why the CRC is left out: torch.save computes a CRC32 of every zip record, the tensor's bytes
included, on one core: a large share on top of writing the same bytes into the page cache
(benchmarks/README.md). torch.load does not check it (torch documents this at
`torch.serialization.set_crc32_options`), and what guards a checkpoint's bytes is verl_ckpt's
own checksum of every whole file, in the commit record, which resume, `load()` and `verl-ckpt
verify` check. torch's switch for it is process-global, so flipping it here would also strip
the CRC from the trainer's own torch.save calls on other threads; instead the zip writer of
each blob is built with the flag off for that blob alone.

The torch internals this relies on (`torch._C.PyTorchFileWriter(stream, compute_crc32,
alignment)` and `torch.serialization._save`, as `torch.save` itself calls them) are probed
once at import. Where they differ (another torch release), every item goes through DCP's own
`_write_item`, CRC included, so the files are the same either way apart from the CRC fields.
tests/test_torch_format.py pins the blob, byte for byte, to torch.save's with its CRC off.

Blob templates: without the CRC, every byte of a tensor's blob but its storage's depends on
the tensor's geometry alone (dtype, shape, strides, storage offset and size, requires_grad,
the conj/neg bits: all the pickle reads of a plain tensor). torch.save pickles, builds zip
records and makes about forty small writes per tensor, which cost as much CPU as copying
its bytes into the page cache. So the bytes before and after the storage are made once per
geometry (torch.save itself under `torch.serialization.skip_data`, which writes everything
but the storage and seeks over it) and a blob is then three writes: head, the storage's own
bytes, tail. Also probed at import against save_tensor_blob; tensors whose pickle could
hold more (subclasses, Python attributes, other layouts) are always written by torch.save.

Protocol step 3 (write), verl_ckpt/protocol/__init__.py.
"""

from __future__ import annotations

import ctypes
import io
import os
import pickle
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import IO, Any

import torch
import torch.serialization as torch_serialization
from torch.distributed.checkpoint.filesystem import _StorageInfo, _write_item
from torch.distributed.checkpoint.planner import WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult

from verl_ckpt.store.direct_io import BLOCK_BYTES, ZERO_COPY_MIN

try:  # torch >= 2.5 takes the serialization format explicitly
    from torch.distributed.checkpoint.filesystem import SerializationFormat

    _WRITE_ITEM_KWARGS: dict[str, Any] = {"serialization_format": SerializationFormat.TORCH_SAVE}
except ImportError:  # pragma: no cover - older torch
    _WRITE_ITEM_KWARGS = {}

__all__ = [
    "BLOB_TEMPLATES",
    "CRC_FREE_BLOBS",
    "BlobLayout",
    "StorageGeometry",
    "save_tensor_blob",
    "storage_geometry",
    "whole_tensor_blob_layout",
    "write_item",
    "write_tensor_blob",
]


def save_tensor_blob(tensor: torch.Tensor, stream: IO[bytes]) -> None:
    """`torch.save(tensor, stream)`, with the zip records' CRC32 fields left zero."""
    alignment = torch_serialization._get_storage_alignment()
    zip_writer = torch._C.PyTorchFileWriter(stream, False, alignment)
    protocol = torch_serialization.DEFAULT_PROTOCOL
    torch_serialization._save(tensor, zip_writer, pickle, protocol, False)
    zip_writer.write_end_of_file()


def _crc_free_blobs_work() -> bool:
    """Whether this torch's internals take the calls above and torch.load reads the result."""
    probe = torch.arange(4, dtype=torch.float32)
    try:
        stream = io.BytesIO()
        save_tensor_blob(probe, stream)
        stream.seek(0)
        return torch.equal(torch.load(stream, weights_only=True), probe)
    except Exception:  # noqa: BLE001 - any mismatch means: use DCP's own writer
        return False


CRC_FREE_BLOBS = _crc_free_blobs_work()


@dataclass(frozen=True)
class BlobLayout:
    """A tensor's blob around its storage's bytes (see the module's docstring): the blob is
    `head`, the storage's `storage_nbytes` bytes, `tail`."""

    head: bytes
    storage_nbytes: int
    tail: bytes


class _TemplateCapture:
    """The stream a template is captured into: torch.save under skip_data writes the bytes
    before the storage, seeks over the storage (once, forward), and writes the rest."""

    def __init__(self) -> None:
        self.head: bytes | None = None
        self.skipped = 0
        self._bytes = bytearray()

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        self._bytes += view
        return view.nbytes

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        if whence != os.SEEK_CUR or self.head is not None:
            raise io.UnsupportedOperation("a blob template skips one storage, forward")
        self.head, self.skipped, self._bytes = bytes(self._bytes), offset, bytearray()
        return 0

    def flush(self) -> None:
        pass

    def template(self) -> BlobLayout:
        if self.head is None:  # an empty storage: nothing was skipped
            return BlobLayout(bytes(self._bytes), 0, b"")
        return BlobLayout(self.head, self.skipped, bytes(self._bytes))


# Templates of the geometries seen lately. A structure has few distinct geometries and keeps
# them from save to save; the bound only stops a stream of new ones from growing memory.
_TEMPLATES: OrderedDict[tuple, BlobLayout] = OrderedDict()
_TEMPLATES_MAX = 4096
_templates_lock = threading.Lock()


# A tensor's place in its storage: equal for two tensors means the same view of storages of
# equal size (dtype, shape, strides, storage offset, storage bytes).
StorageGeometry = tuple[torch.dtype, tuple[int, ...], tuple[int, ...], int, int]


def storage_geometry(tensor: torch.Tensor) -> StorageGeometry:
    """Where `tensor` lies in its storage, and that storage's size."""
    return (
        tensor.dtype,
        tuple(tensor.shape),
        tensor.stride(),
        tensor.storage_offset(),
        tensor.untyped_storage().nbytes(),
    )


def _template_key(tensor: torch.Tensor, alignment: int | None = None) -> tuple | None:
    """Everything save_tensor_blob's bytes depend on besides the storage's bytes, or None
    for a tensor whose pickle may hold more (it is then written by torch.save itself)."""
    if (
        type(tensor) is not torch.Tensor  # a subclass pickles its type and state
        or tensor.layout != torch.strided
        or tensor.device.type != "cpu"
        or tensor.is_quantized
        or tensor.__dict__  # Python attributes are pickled with the tensor
    ):
        return None
    return (
        *storage_geometry(tensor),
        tensor.requires_grad,
        tuple(sorted(torch._C._get_tensor_metadata(tensor).items())),  # conj, neg bits
        alignment if alignment is not None else torch_serialization._get_storage_alignment(),
    )


def _blob_template(tensor: torch.Tensor, key: tuple) -> BlobLayout:
    with _templates_lock:
        template = _TEMPLATES.get(key)
        if template is not None:
            _TEMPLATES.move_to_end(key)
            return template
    template = _capture_template(tensor)
    with _templates_lock:
        _TEMPLATES[key] = template
        while len(_TEMPLATES) > _TEMPLATES_MAX:
            _TEMPLATES.popitem(last=False)
    return template


def _storage_bytes(tensor: torch.Tensor, nbytes: int) -> memoryview:
    """The bytes of the tensor's whole storage, as torch.save writes them, without a copy
    (valid while `tensor` lives)."""
    storage = tensor.untyped_storage()
    if storage.nbytes() != nbytes:  # the key holds the size: a mismatch is a bug here
        raise ValueError(f"storage of {storage.nbytes()} bytes, template for {nbytes}")
    return memoryview((ctypes.c_char * nbytes).from_address(storage.data_ptr())).cast("B")


def write_tensor_blob(tensor: torch.Tensor, stream: IO[bytes]) -> None:
    """save_tensor_blob's bytes, exactly; from the geometry's template where it can be."""
    _write_blob(tensor, _template_of(tensor), stream)


def _template_of(tensor: torch.Tensor, alignment: int | None = None) -> BlobLayout | None:
    """The template of the tensor's geometry, or None where torch.save writes its blob."""
    key = _template_key(tensor, alignment) if BLOB_TEMPLATES else None
    return None if key is None else _blob_template(tensor, key)


def _write_blob(
    tensor: torch.Tensor, template: BlobLayout | None, stream: IO[bytes], held: bool = False
) -> None:
    if template is None:
        save_tensor_blob(tensor, stream)
    else:
        _write_templated(template, tensor, stream, held)


def whole_tensor_blob_layout(shape: tuple[int, ...], dtype: torch.dtype) -> BlobLayout | None:
    """The layout of the blob this module writes for a whole tensor of `shape` and `dtype`
    (contiguous, its own storage, no grad), as verl_ckpt's staged tensors are; None where
    blobs are not made from templates on this torch. The direct reader checks a blob's
    pickle against it (direct_reader.py)."""
    if not BLOB_TEMPLATES:
        return None
    # torch.empty does not touch its memory: the template needs only the geometry.
    probe = torch.empty(shape, dtype=dtype)
    key = _template_key(probe)
    return None if key is None else _blob_template(probe, key)


def _capture_template(tensor: torch.Tensor) -> BlobLayout:
    capture = _TemplateCapture()
    with torch_serialization.skip_data():
        save_tensor_blob(tensor, capture)
    return capture.template()


def _write_templated(
    template: BlobLayout, tensor: torch.Tensor, stream: IO[bytes], held: bool = False
) -> None:
    """`held`: the caller keeps the tensor unchanged until the stream's file is finished,
    so that a checksumming stream may queue its bytes for the device instead of waiting for
    them (fsio.ChecksummingWriter.write_held)."""
    stream.write(template.head)
    if template.storage_nbytes:
        write = getattr(stream, "write_held", stream.write) if held else stream.write
        write(_storage_bytes(tensor, template.storage_nbytes))
    stream.write(template.tail)


def _blob_templates_work() -> bool:
    """Whether a template and the storage's bytes make save_tensor_blob's bytes exactly, on
    this torch (skip_data, the one seek, every pickled field in the key)."""
    if not CRC_FREE_BLOBS or not hasattr(torch_serialization, "skip_data"):
        return False
    base = torch.arange(24, dtype=torch.float32)
    probes = [
        base,
        base[5:17].view(3, 4).t(),
        torch.ones(3, dtype=torch.bfloat16, requires_grad=True),
        torch.empty(0),
    ]
    try:
        for probe in probes:
            expected, ours = io.BytesIO(), io.BytesIO()
            save_tensor_blob(probe, expected)
            _write_templated(_capture_template(probe), probe, ours)
            if ours.getvalue() != expected.getvalue():
                return False
    except Exception:  # noqa: BLE001 - any difference means: torch.save for every blob
        return False
    return True


BLOB_TEMPLATES = _blob_templates_work()


# A storage this large starts on a page of the file where it starts on a page of memory, or
# (written live) lies at its own offset within a page (_pad_before_blob): at most PAGE_BYTES
# of padding against a megabyte or more of tensor. The page is the block that a file written
# around the page cache aligns its offsets and memory to.
PAGE_ALIGNED_MIN = ZERO_COPY_MIN
PAGE_BYTES = BLOCK_BYTES


def _pad_before_blob(
    stream: IO[bytes],
    tensor: torch.Tensor,
    template: BlobLayout | None,
    alignment: int,
    live_storages: frozenset[int] = frozenset(),
) -> None:
    """Zero bytes before a tensor's blob, so that its storage lies at an aligned file offset.
    DCP's readers read every item at its recorded offset, so the padding is never read.

    Why: the kernel's copies between the page cache and a tensor (itself aligned) run slower
    when the file offset is not aligned alike, so every blob starts at a multiple of torch's
    storage alignment (64), where torch aligns the storage within the blob. A large storage
    that starts on a page (a staging buffer: rank/staging.py) starts on a page of the file as
    well, which lets a file written around the page cache take its whole pages from the
    tensor's own memory (store/direct_io.py, zero copy). Otherwise the layout never depends
    on where a tensor lies: a tensor written in place by offload-aware staging moves between
    saves (torch's allocator reuses freed memory at any 64-byte offset), and the write
    results, which the finalizer's forecast of `.metadata` compares whole, must not change
    with it.

    `live_storages` (a live snapshot's, by data_ptr): each large one lies at its own offset
    within a page of memory (torch's large host allocations start a few cache lines into
    one), so that the trainer's tensors are written with zero copy too. They keep that
    offset while the trainer keeps its storage (parameters, optimizer state updated in
    place); one that moves changes the write results, and the commit then makes `.metadata`
    itself (slower, never wrong)."""
    position = stream.tell()
    gap = -position % alignment
    if (
        template is not None
        and template.storage_nbytes >= PAGE_ALIGNED_MIN
        and PAGE_BYTES % alignment == 0  # a page start is then a multiple of the alignment
    ):
        # Read only here: a tensor without a template may have no storage (sparse, some
        # subclasses), and torch.save writes it as it is.
        storage = tensor.untyped_storage().data_ptr()
        in_page = storage % PAGE_BYTES
        if in_page == 0 or (storage in live_storages and in_page % alignment == 0):
            gap = (in_page - position - len(template.head)) % PAGE_BYTES
    if gap:
        stream.write(bytes(gap))


def _transforms_bytes(transforms: Any) -> bool:
    """Whether DCP's stream transforms (compression, encryption: its extensions) change what
    is written. Without extensions, its transform_save_stream only wraps the stream in a
    pass-through writer, of a class it defines anew on every call: for a file of small
    tensors, a large share of the writer thread's CPU (benchmarks/README.md). A transforms
    object without an `extensions` attribute (another torch) is always asked."""
    return transforms is not None and bool(getattr(transforms, "extensions", True))


def write_item(
    transforms: Any,
    stream: IO[bytes],
    data: Any,
    item: WriteItem,
    storage_key: str,
    live_storages: frozenset[int] = frozenset(),
) -> WriteResult:
    """Write one item of a DCP write bucket at the stream's position; return DCP's result
    for it (where it lies in which file), as DCP's own `_write_item` does.
    `live_storages`: see _pad_before_blob."""
    transform_args = (transforms,) if transforms is not None else ()
    if item.type == WriteItemType.BYTE_IO or not CRC_FREE_BLOBS:
        return _write_item(*transform_args, stream, data, item, storage_key, **_WRITE_ITEM_KWARGS)
    if data.device.type != "cpu":
        raise ValueError(f"{item.index.fqn}: only host tensors are written, got {data.device}")
    # Looked up once per item: torch's config lookup costs as much as the rest of the key.
    alignment = torch_serialization._get_storage_alignment()
    template = _template_of(data, alignment)
    _pad_before_blob(stream, data, template, alignment, live_storages)
    offset = stream.tell()
    target, descriptors = (
        transforms.transform_save_stream(item, stream)
        if _transforms_bytes(transforms)
        else (stream, [])
    )
    # A write bucket holds its tensors, unchanged, until its file is finished (a staged
    # copy, a tensor written in place behind quiet(), or a live one behind the fence).
    _write_blob(data, template, target, held=True)
    if target is not stream:
        target.close()  # a transform's wrapper: closing it flushes, never closes `stream`
    length = stream.tell() - offset
    # Older torch has no transform descriptors; DCP leaves the field out when there are none.
    where = (
        _StorageInfo(storage_key, offset, length, transform_descriptors=descriptors)
        if descriptors
        else _StorageInfo(storage_key, offset, length)
    )
    return WriteResult(index=item.index, size_in_bytes=length, storage_data=where)
