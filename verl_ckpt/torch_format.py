"""One DCP write item into a stream, in the format DCP's FileSystemReader reads (for a tensor:
a `torch.save` blob), without torch.save's per-record zip CRC32.

Why the CRC is left out: torch.save computes a CRC32 of every zip record, the tensor's bytes
included, at about 4 GB/s on one core here: some 40% on top of writing the same bytes into
the page cache. torch.load does not check it (torch documents this at
`torch.serialization.set_crc32_options`), and what guards a checkpoint's bytes is verl_ckpt's
own checksum of every whole file, in the commit record, which resume, `load()` and `verl-ckpt
verify` check. torch's switch for it is process-global, so flipping it here would also strip
the CRC from the trainer's own torch.save calls on other threads; instead the zip writer of
each blob is built with the flag off for that blob alone.

The torch internals this relies on (`torch._C.PyTorchFileWriter(stream, compute_crc32,
alignment)` and `torch.serialization._save`, as `torch.save` itself calls them) are probed
once at import. Where they differ (another torch release), every item goes through DCP's own
`_write_item`, CRC included, so the files are the same either way apart from the CRC fields.
tests/test_units.py pins the blob, byte for byte, to torch.save's with its CRC switched off.
"""

from __future__ import annotations

import io
import pickle
from typing import IO, Any

import torch
import torch.serialization as torch_serialization
from torch.distributed.checkpoint.filesystem import _StorageInfo, _write_item
from torch.distributed.checkpoint.planner import WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult

try:  # torch >= 2.5 takes the serialization format explicitly
    from torch.distributed.checkpoint.filesystem import SerializationFormat

    _WRITE_ITEM_KWARGS: dict[str, Any] = {"serialization_format": SerializationFormat.TORCH_SAVE}
except ImportError:  # pragma: no cover - older torch
    _WRITE_ITEM_KWARGS = {}

__all__ = ["CRC_FREE_BLOBS", "save_tensor_blob", "write_item"]


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


def write_item(
    transforms: Any, stream: IO[bytes], data: Any, item: WriteItem, storage_key: str
) -> WriteResult:
    """Write one item of a DCP write bucket at the stream's position; return DCP's result
    for it (where it lies in which file), as DCP's own `_write_item` does."""
    transform_args = (transforms,) if transforms is not None else ()
    if item.type == WriteItemType.BYTE_IO or not CRC_FREE_BLOBS:
        return _write_item(*transform_args, stream, data, item, storage_key, **_WRITE_ITEM_KWARGS)
    if data.device.type != "cpu":
        raise ValueError(f"{item.index.fqn}: only host tensors are written, got {data.device}")
    offset = stream.tell()
    target, descriptors = (
        transforms.transform_save_stream(item, stream) if transforms else (stream, [])
    )
    save_tensor_blob(data, target)
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
