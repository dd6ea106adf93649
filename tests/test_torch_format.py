"""The tensor blobs of a shard file (torch_format.py): torch.save's format exactly, without
its zip CRC32, for the files that DCP's and megatron-core's loaders read (I7). No Ray."""

from __future__ import annotations

import io
import mmap
from typing import IO, Any

import pytest
import torch
import torch.serialization as torch_serialization
from torch.distributed.checkpoint._extension import StreamTransformExtension
from torch.distributed.checkpoint.filesystem import _StorageWriterTransforms, _write_item
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex
from torch.distributed.checkpoint.planner import (
    TensorProperties,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)

from verl_ckpt.format import torch_format
from verl_ckpt.format.torch_format import (
    _WRITE_ITEM_KWARGS,
    BLOB_TEMPLATES,
    CRC_FREE_BLOBS,
    PAGE_ALIGNED_MIN,
    PAGE_BYTES,
    save_tensor_blob,
    write_item,
    write_tensor_blob,
)
from verl_ckpt.rank.staging import StagingPool

TENSORS = {
    "fp32 matrix": torch.randn(300, 17),
    "bf16": torch.randn(1000).bfloat16(),
    "int64": torch.arange(7),
    "scalar": torch.tensor(3.5),
    "empty": torch.empty(0, 4),
}


def test_this_torch_writes_crc_free_blobs():
    """The probe at import found the internals it needs: saves run without the CRC here (if
    a torch upgrade breaks that, the fallback keeps files correct but this says so)."""
    assert CRC_FREE_BLOBS


def _torch_save_without_crc(tensor: torch.Tensor) -> bytes:
    reference = io.BytesIO()
    torch_serialization.set_crc32_options(False)
    try:
        torch.save(tensor, reference)
    finally:
        torch_serialization.set_crc32_options(True)
    return reference.getvalue()


@pytest.mark.parametrize("name", list(TENSORS))
def test_I7_blob_is_torch_save_byte_for_byte_without_its_crc(name):
    tensor = TENSORS[name]
    ours = io.BytesIO()
    save_tensor_blob(tensor, ours)
    assert torch_serialization.get_crc32_options(), "the process-global switch was touched"
    assert ours.getvalue() == _torch_save_without_crc(tensor)
    ours.seek(0)
    loaded = torch.load(ours, weights_only=True)
    assert loaded.dtype == tensor.dtype and torch.equal(loaded, tensor)


def test_this_torch_writes_blobs_from_templates():
    """The probe at import found torch.save's bytes equal to a template around the storage
    (if a torch upgrade breaks that, every blob goes through torch.save and this says so)."""
    assert BLOB_TEMPLATES


class _Tagged(torch.Tensor):
    """A tensor subclass: its type goes into the pickle."""


def _with_attribute(tensor: torch.Tensor) -> torch.Tensor:
    tensor.tag = "pickled with the tensor"
    return tensor


def _base() -> torch.Tensor:
    return torch.arange(60, dtype=torch.float32)


# Every field of a plain tensor's pickle varied once, and tensors whose pickle holds more;
# built afresh by each test (they change the values).
TEMPLATED = {
    **{name: tensor.clone for name, tensor in TENSORS.items()},
    "view at an offset": lambda: _base()[7:19],
    "transposed view": lambda: _base()[:12].view(3, 4).t(),
    "same shape, other stride": lambda: _base()[:24].view(4, 6)[:, :3],
    "same shape, other offset": lambda: _base()[12:36].view(4, 6)[:, :3],
    "requires_grad": lambda: torch.ones(5, requires_grad=True),
    "conj bit": lambda: torch.randn(4, dtype=torch.complex64).conj(),
    "neg bit": lambda: torch._neg_view(torch.randn(4, dtype=torch.complex64).conj()),
    "fp16 3-d": lambda: torch.randn(2, 3, 5).half(),
    "bool": lambda: torch.tensor([True, False, True]),
    "subclass": lambda: torch.arange(6.0).as_subclass(_Tagged),
    "Python attribute": lambda: _with_attribute(torch.arange(6.0)),
}


@pytest.mark.parametrize("name", list(TEMPLATED))
def test_I7_blob_from_its_template_is_torch_save_byte_for_byte(name):
    """write_tensor_blob writes exactly torch.save's bytes (CRC off), the first time (the
    template is made) and the second (taken from the cache), and after the tensor's values
    changed: the template never carries a tensor's data."""
    tensor = TEMPLATED[name]()
    for _ in range(2):
        ours = io.BytesIO()
        write_tensor_blob(tensor, ours)
        assert ours.getvalue() == _torch_save_without_crc(tensor)
    if tensor.numel() and not tensor.requires_grad:
        before = ours.getvalue()
        tensor.logical_not_() if tensor.dtype == torch.bool else tensor.fill_(7)
        ours = io.BytesIO()
        write_tensor_blob(tensor, ours)
        assert ours.getvalue() == _torch_save_without_crc(tensor) != before
    ours.seek(0)
    loaded = torch.load(ours, weights_only=False)
    assert loaded.dtype == tensor.dtype and torch.equal(loaded.resolve_conj(), tensor)


def test_only_plain_tensors_are_written_from_templates():
    """A subclass or a tensor with Python attributes pickles more than its geometry: those go
    through torch.save every time (the bytes above prove them right, this the route)."""
    torch_format._TEMPLATES.clear()
    write_tensor_blob(TEMPLATED["subclass"](), io.BytesIO())
    write_tensor_blob(TEMPLATED["Python attribute"](), io.BytesIO())
    assert not torch_format._TEMPLATES
    write_tensor_blob(torch.ones(3), io.BytesIO())
    write_tensor_blob(torch.zeros(3), io.BytesIO())
    assert len(torch_format._TEMPLATES) == 1


def whole_tensor_item(key: str, tensor: torch.Tensor) -> WriteItem:
    """A DCP write item of the whole `tensor` under `key` (test_direct_reader uses it too)."""
    offsets = torch.Size([0] * tensor.dim())
    return WriteItem(
        index=MetadataIndex(key, offsets),
        type=WriteItemType.TENSOR,
        tensor_data=TensorWriteData(
            chunk=ChunkStorageMetadata(offsets=offsets, sizes=tensor.size()),
            properties=TensorProperties.create_from_tensor(tensor),
            size=tensor.size(),
        ),
    )


def test_I7_write_item_places_items_as_dcp_does():
    """Item by item into one stream (a shard file): each item's bytes at its recorded offset
    are DCP's own, but for the CRC fields; the same index, length and file as DCP's results.
    Each tensor's blob starts at a multiple of 64 bytes, so its storage lies at an aligned
    file offset (the padding before it is zeros that no reader reads)."""
    items = [(whole_tensor_item(name, t), t) for name, t in TENSORS.items()]
    items.insert(1, (WriteItem(index=MetadataIndex("obj"), type=WriteItemType.BYTE_IO), b"odd"))
    transforms = _StorageWriterTransforms()
    ours = io.BytesIO()
    our_results = [
        write_item(transforms, ours, _fresh(data), item, "__0_0.distcp") for item, data in items
    ]
    torch_serialization.set_crc32_options(False)
    try:
        theirs = []
        for item, data in items:
            stream = io.BytesIO()
            result = _write_item(
                transforms, stream, _fresh(data), item, "__0_0.distcp", **_WRITE_ITEM_KWARGS
            )
            theirs.append((result, stream.getvalue()))
    finally:
        torch_serialization.set_crc32_options(True)
    written = ours.getvalue()
    covered = bytearray(len(written))
    for ours_result, (their_result, their_bytes) in zip(our_results, theirs, strict=True):
        where = ours_result.storage_data
        assert ours_result.index == their_result.index
        assert ours_result.size_in_bytes == their_result.size_in_bytes == len(their_bytes)
        assert where.relative_path == their_result.storage_data.relative_path
        assert written[where.offset : where.offset + where.length] == their_bytes
        covered[where.offset : where.offset + where.length] = b"\x01" * where.length
        if ours_result.index.fqn != "obj":
            assert where.offset % 64 == 0, (ours_result.index.fqn, where.offset)
    # The odd-length object before the tensors makes padding; what no item covers is zeros.
    gaps = bytes(b for b, c in zip(written, covered, strict=True) if not c)
    assert gaps and gaps == bytes(len(gaps))


class _RecordingExtension(StreamTransformExtension):
    """A DCP stream transform that passes the bytes on unchanged and keeps a copy."""

    def __init__(self) -> None:
        self.seen = bytearray()

    @staticmethod
    def registry_name() -> str:
        return "verl_ckpt_test_recording"

    @staticmethod
    def from_descriptor(version: str) -> _RecordingExtension:
        return _RecordingExtension()

    def get_descriptor(self) -> str:
        return "verl_ckpt_test_recording/1"

    def transform_to(self, output: IO[bytes]) -> IO[bytes]:
        seen = self.seen

        class Recording(io.RawIOBase):
            def writable(self) -> bool:
                return True

            def write(self, data: Any) -> int:
                seen.extend(memoryview(data).cast("B"))
                return output.write(data)

        return Recording()

    def transform_from(self, input: IO[bytes]) -> IO[bytes]:
        return input


def test_dcp_stream_transforms_wrap_a_blob_only_where_an_extension_changes_it(monkeypatch):
    """DCP's transforms without extensions pass the bytes through (their wrapper is skipped:
    write_item's bytes and results are DCP's own, test_I7_write_item_places_items_as_dcp_does);
    with an extension, every blob still goes through it and its descriptor is recorded."""
    tensor = torch.arange(32, dtype=torch.float32)
    item = whole_tensor_item("w", tensor)
    plain = _StorageWriterTransforms()

    def refused(*args: Any) -> Any:
        raise AssertionError("a pass-through transform was asked for")

    with monkeypatch.context() as patched:
        patched.setattr(_StorageWriterTransforms, "transform_save_stream", refused)
        result = write_item(plain, io.BytesIO(), tensor, item, "__0_0.distcp")
    assert not getattr(result.storage_data, "transform_descriptors", None)

    recording = _RecordingExtension()
    stream = io.BytesIO()
    result = write_item(_StorageWriterTransforms([recording]), stream, tensor, item, "__0_0.distcp")
    where = result.storage_data
    assert where.transform_descriptors == ["verl_ckpt_test_recording/1"]
    assert bytes(recording.seen) == stream.getvalue()[where.offset :]
    assert len(recording.seen) == where.length > tensor.nbytes


def test_a_large_storage_on_a_page_lies_on_a_page_of_the_file_and_no_other_moves_it():
    """A storage of PAGE_ALIGNED_MIN bytes or more that starts on a page (a staging buffer
    that large is a page-aligned mapping) starts on a page of the file, so that a file
    written around the page cache takes its pages from the tensor itself (store/
    direct_io.py); the padding before it is zeros and the blob loads back. The layout never
    depends on where a tensor lies otherwise: two slots of one structure, and two live
    tensors at different addresses (offload-aware staging writes those in place, and they
    move between saves), give the same write results, which the finalizer's forecast of
    `.metadata` compares whole."""
    torch.manual_seed(0)
    big = torch.rand(PAGE_ALIGNED_MIN // 4 + 3)
    live = [big, big.clone()]  # torch's allocator: 64-byte aligned, pages apart or not
    pools = [StagingPool(slots=2, pin_memory=False) for _ in range(2)]
    staged = []
    for pool in pools:
        slot, _ = pool.acquire(["big", "small"], [big, torch.ones(5)])
        assert slot.buffers[0].data_ptr() % PAGE_BYTES == 0
        slot.buffers[0].copy_(big)
        staged.append(slot.buffers[0])
    assert staged[0].data_ptr() != staged[1].data_ptr()
    layouts = []
    for tensor in (*staged, *live):
        stream = io.BytesIO()
        stream.write(b"odd")  # the blob does not start at a page
        result = write_item(
            _StorageWriterTransforms(), stream, tensor, whole_tensor_item("w", tensor), "f"
        )
        where = result.storage_data
        written = stream.getvalue()
        storage_at = written.index(tensor.numpy().tobytes()[:64], where.offset)
        if tensor.data_ptr() % PAGE_BYTES == 0:
            assert storage_at % PAGE_BYTES == 0
        assert where.offset % 64 == 0
        assert written[3 : where.offset] == bytes(where.offset - 3)
        blob = written[where.offset : where.offset + where.length]
        assert torch.equal(torch.load(io.BytesIO(blob), weights_only=True), big)
        layouts.append((where.offset, where.length, tensor.data_ptr() % PAGE_BYTES == 0))
    assert layouts[0] == layouts[1] and layouts[0][0] > 64  # padded to a page
    if not any(aligned for *_, aligned in layouts[2:]):
        assert layouts[2] == layouts[3] and layouts[2][0] == 64


def test_a_live_snapshot_lays_a_large_storage_out_at_its_own_offset_within_a_page():
    """A live snapshot writes the trainer's own tensors, which torch allocates a few cache
    lines into a page: laid out by memory, each large storage lies at its own offset within
    a page of the file too (a file written around the page cache then takes its whole pages
    from the tensor), after zero padding, and loads back. Without it, only a storage that
    starts on a page is page-aligned in the file."""
    torch.manual_seed(0)
    big = torch.rand(PAGE_ALIGNED_MIN // 4 + 3)
    memory = mmap.mmap(-1, big.numel() * 4 + PAGE_BYTES)  # starts on a page
    for in_page in (0, 64, 1024):
        # A whole storage of its own, `in_page` bytes into a page.
        tensor = torch.frombuffer(memory, dtype=torch.float32, count=big.numel(), offset=in_page)
        tensor.copy_(big)
        assert tensor.untyped_storage().data_ptr() % PAGE_BYTES == in_page
        for by_memory in (True, False):
            stream = io.BytesIO()
            stream.write(b"odd")  # the blob does not start at a page
            result = write_item(
                _StorageWriterTransforms(),
                stream,
                tensor,
                whole_tensor_item("w", tensor),
                "f",
                frozenset({tensor.untyped_storage().data_ptr()}) if by_memory else frozenset(),
            )
            where = result.storage_data
            written = stream.getvalue()
            storage_at = written.index(big.numpy().tobytes()[:64], where.offset)
            assert where.offset % 64 == 0
            assert written[3 : where.offset] == bytes(where.offset - 3)
            if by_memory or in_page == 0:
                assert storage_at % PAGE_BYTES == in_page
            else:
                assert where.offset == 64  # the storage alignment only
            blob = written[where.offset : where.offset + where.length]
            assert torch.equal(torch.load(io.BytesIO(blob), weights_only=True), big)


def test_a_tensor_without_a_storage_is_written_as_torch_save_writes_it():
    """A sparse tensor has no storage to lay out (torch raises when asked for one): it has no
    blob template and goes through torch.save whole, whatever live storages a save names."""
    sparse = torch.sparse_coo_tensor([[0, 1]], [1.0, 2.0], (3,))
    for live in (frozenset(), frozenset({1 << 20})):
        stream = io.BytesIO()
        result = write_item(
            _StorageWriterTransforms(), stream, sparse, whole_tensor_item("s", sparse), "f", live
        )
        where = result.storage_data
        blob = stream.getvalue()[where.offset : where.offset + where.length]
        loaded = torch.load(io.BytesIO(blob), weights_only=True)
        assert torch.equal(loaded.to_dense(), torch.tensor([1.0, 2.0, 0.0]))


def _fresh(data):
    """A BYTE_IO item's data as DCP takes it (a stream, read once), a tensor as it is."""
    return io.BytesIO(data) if isinstance(data, bytes) else data


# Pairs that differ in one field of the template's key only (the same storage size and
# shape unless that is the field): the second must not be written from the first's template.
ONE_FIELD_APART = {
    "stride": (lambda: _base()[:24].view(4, 6)[:, :3], lambda: _base()[:24].view(6, 4).t()[:4, :3]),
    "storage offset": (lambda: _base()[:12], lambda: _base()[12:24]),
    "storage size": (lambda: torch.zeros(12), lambda: torch.zeros(24)[:12]),
    "dtype": (lambda: torch.zeros(4), lambda: torch.zeros(4, dtype=torch.int32)),
    "requires_grad": (lambda: torch.ones(4), lambda: torch.ones(4, requires_grad=True)),
    "conj bit": (
        lambda: torch.ones(4, dtype=torch.complex64),
        lambda: torch.ones(4, dtype=torch.complex64).conj(),
    ),
}


@pytest.mark.parametrize("field", list(ONE_FIELD_APART))
def test_I7_tensors_one_template_field_apart_get_their_own_bytes(field):
    torch_format._TEMPLATES.clear()
    for make in ONE_FIELD_APART[field]:
        tensor = make()
        ours = io.BytesIO()
        write_tensor_blob(tensor, ours)
        assert ours.getvalue() == _torch_save_without_crc(tensor)
