"""DCP's FileSystemReader with nothing from the checkpoint unpickled unsafely (issue 45):
`.metadata` through safe_load's restricted unpickler, byte items (a rank's extra state,
megatron-core's objects) through `torch.load(weights_only=True)`. Tensors DCP already
reads with `weights_only=True`. Every reader of a torch_dist directory in verl_ckpt is this
one or the direct reader built on it; megatron-core's and DCP's own loaders, which our
directories stay readable by (I7), still trust the directory they read.
"""

from __future__ import annotations

import io
import os
from collections.abc import Generator
from contextlib import contextmanager
from typing import Any

from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

from verl_ckpt.format.safe_load import load_dcp_metadata, load_state_bytes
from verl_ckpt.protocol.errors import CheckpointError
from verl_ckpt.store.fsio import open_regular

__all__ = ["SafeFileSystemReader", "checkpoint_error_in"]


class _RegularFilesOnly(FileSystem):
    """DCP's local FileSystem, except that a stream read from the checkpoint is opened as a
    regular file only (fsio.open_regular): DCP's own opens follow a planted link and wait
    forever on a FIFO planted at `.metadata` or a data file's name."""

    @contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Generator[io.IOBase, None, None]:
        if "r" not in mode or "+" in mode:
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        with os.fdopen(open_regular(path), "rb") as stream:
            yield stream


class SafeFileSystemReader(FileSystemReader):
    """FileSystemReader whose `.metadata` and byte items never run code of the checkpoint,
    and whose every file is opened as a regular file only."""

    def __init__(self, path: str | os.PathLike, *args: Any, **kwargs: Any) -> None:
        super().__init__(path, *args, **kwargs)
        self.fs = _RegularFilesOnly()  # the path stays as DCP made it

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        rank = kwargs.get("rank")
        name = ".metadata" if rank is None else f"__{rank}.metadata"
        path = self.fs.concat_path(self.path, name)
        with self.fs.create_stream(path, "rb") as stream:
            metadata = load_dcp_metadata(stream, str(path))
        # As DCP's own read_metadata does.
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        return super().read_data(plan, _SafeBytesPlanner(planner, self))


class _SafeBytesPlanner:
    """`planner` as DCP's read_data sees it, except that a byte item reaches its load_bytes
    (which unpickles with `weights_only=False` in DCP's and megatron-core's planners) as a
    pickle made here, from what `torch.load(weights_only=True)` made of the item. Every
    other attribute is the planner's own."""

    def __init__(self, planner: LoadPlanner, reader: SafeFileSystemReader) -> None:
        self._planner = planner
        self._reader = reader

    def __getattr__(self, name: str) -> Any:
        return getattr(self._planner, name)

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        import torch

        info = self._reader.storage_data.get(read_item.storage_index)
        where = os.path.join(str(self._reader.path), info.relative_path) if info else "?"
        loaded = load_state_bytes(value.read(), f"{where} (item {read_item.storage_index.fqn})")
        # Re-pickled from objects a weights-only load built: its pickle names nothing else.
        clean = io.BytesIO()
        torch.save(loaded, clean)
        clean.seek(0)
        self._planner.load_bytes(read_item, clean)


def checkpoint_error_in(exc: BaseException) -> CheckpointError | None:
    """The CheckpointError (an UnsafeCheckpointError, a damaged file) that DCP's load
    wrapped into its CheckpointException, so that it reaches the user as its own one line;
    None if there is none."""
    failures = getattr(exc, "failures", None) or {}
    for failure in failures.values():
        # DCP keeps each rank's failure as (exception, traceback summary).
        cause = failure[0] if isinstance(failure, tuple) else failure
        if isinstance(cause, CheckpointError):
            return cause
    return None
