"""One durable, checksummed file: created without following links, filled through a
checksumming stream, fsynced before its size and checksum are reported.

Every file a writer reports to the finalizer is written here (a rank's buckets and
common.pt, a participant's state, the driver's state), and a Hugging Face export's files.
No torch: a process that writes no tensors (the driver, a participant) does not import
torch's checkpoint package for it, as it would through format.file_writer.

Protocol step 3 (write), verl_ckpt/protocol/__init__.py.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from verl_ckpt.store.direct_io import open_direct
from verl_ckpt.store.fsio import (
    DEFAULT_WRITES,
    ChecksummingWriter,
    Gate,
    WriteOptions,
    open_for_rewrite,
)

__all__ = ["WrittenFile", "write_checksummed"]


@dataclass(frozen=True)
class WrittenFile:
    name: str
    size: int
    checksum: str
    # Seconds of the final fsync (the part a fast disk makes small and a page cache cannot).
    fsync_s: float = 0.0


def write_checksummed(
    path: str | Path,
    write: Callable[[ChecksummingWriter], Any],
    gate: Gate | None = None,
    options: WriteOptions = DEFAULT_WRITES,
) -> WrittenFile:
    """Create `path`, let `write` fill it through a checksumming stream, fsync it.

    The file is durable when this returns: a report of it to the finalizer must mean the
    bytes are on disk. The checksum covers exactly the bytes written. A failure raises the
    OSError the file gave (ENOSPC, EFBIG, EIO), naming the path, even where torch's C++
    writer hid it behind a RuntimeError.
    """
    # Opened in place without following a link, with the project's file mode; a regular
    # file with another name (a hard link planted there) is refused before it is truncated:
    # either would redirect a rank's bytes into another file (fsio.open_for_rewrite).
    fd = open_for_rewrite(path, beneath=options.beneath)
    direct = open_direct(fd) if options.direct_io else None
    with direct if direct is not None else open(fd, "wb") as raw:
        # Around the page cache there are no dirty pages to hand to the disk early.
        stream = ChecksummingWriter(raw, gate, 0 if direct is not None else options.writeback_every)
        try:
            try:
                write(stream)
            finally:
                stream.done_writing()
            if direct is not None:
                direct.finish()
            raw.flush()
            synced = time.perf_counter()
            os.fsync(raw.fileno())
            fsync_s = time.perf_counter() - synced
        except Exception as exc:
            # Close here, quietly: the implicit close would flush the buffer to the same full
            # disk and raise a second error without the path, in place of this one.
            with contextlib.suppress(OSError):
                raw.close()
            cause = stream.error if stream.error is not None else exc
            if isinstance(cause, OSError):
                raise OSError(cause.errno, cause.strerror or str(cause), str(path)) from exc
            raise
    return WrittenFile(os.path.basename(path), stream.size, stream.checksum, fsync_s)
