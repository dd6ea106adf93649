"""Durable file primitives: fsync of files and directories, atomic replace, checksums.

The commit protocol is only as good as these: a rename is durable only once the directory
holding it has been fsynced, and a file is durable only once its own bytes were fsynced.
"""

from __future__ import annotations

import os
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO, Protocol

import xxhash

__all__ = [
    "CHECKSUM_ALGORITHM",
    "MAX_PAUSE_S",
    "SUPPORTED_CHECKSUMS",
    "ChecksummingWriter",
    "Gate",
    "RenameNotDurable",
    "atomic_write_bytes",
    "file_checksum",
    "fsync_dir",
    "new_hasher",
    "remove_stale_temporaries",
]

# The checksum detects truncation and bit flips; it is no defence against tampering. xxh3_64
# runs at memory speed (about 3x zlib.crc32 measured here, see benchmarks/results.md) and
# releases the GIL, so checksumming while writing does not cap a fast disk. crc32 stays
# readable: commit records name their algorithm, and those written with crc32 still verify.
CHECKSUM_ALGORITHM = "xxh3_64"
_READ_CHUNK = 8 << 20


class Hasher(Protocol):
    def update(self, data: bytes | memoryview, /) -> None: ...

    def hexdigest(self) -> str: ...


class _Crc32:
    """zlib.crc32 behind the hashlib-style interface that xxhash has."""

    def __init__(self) -> None:
        self._crc = 0

    def update(self, data: bytes | memoryview, /) -> None:
        self._crc = zlib.crc32(data, self._crc)

    def hexdigest(self) -> str:
        return f"{self._crc:08x}"


_HASHERS: dict[str, Callable[[], Hasher]] = {"xxh3_64": xxhash.xxh3_64, "crc32": _Crc32}
SUPPORTED_CHECKSUMS = tuple(_HASHERS)


def new_hasher(algorithm: str = CHECKSUM_ALGORITHM) -> Hasher:
    """A fresh streaming hasher for `algorithm` (one of SUPPORTED_CHECKSUMS)."""
    try:
        return _HASHERS[algorithm]()
    except KeyError:
        raise ValueError(
            f"unknown checksum algorithm {algorithm!r}; known: {', '.join(SUPPORTED_CHECKSUMS)}"
        ) from None


def fsync_dir(path: str | os.PathLike) -> None:
    """Make the entries of directory `path` (creations, renames, deletions) durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class RenameNotDurable(OSError):
    """The new content replaced the old (readers see it now), but the directory fsync after
    the rename failed, so a power loss might bring the old content back. Distinct from a
    failure before the rename, after which readers still see the old content."""


def atomic_write_bytes(
    path: str | os.PathLike,
    data: bytes,
    before_replace: Callable[[], None] | None = None,
    tmp_tag: str | None = None,
) -> None:
    """Replace `path` with `data` so that a reader sees the old or the new content, never less.

    Order matters: the temporary file is fsynced before the rename (else a crash could leave
    the new name pointing at an empty file), and the directory is fsynced after the rename
    (else the rename itself may be lost and the old content come back). A temporary file
    left by a crash is named `.<name>.tmp.<tmp_tag or pid>`: `remove_stale_temporaries` clears
    them. Writers on several nodes (where two processes can share a pid) pass a unique tag.
    An error after the rename is raised as RenameNotDurable: callers whose protocol hinges
    on the rename (the tracker: nothing un-commits a step after it) tell the two apart.
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp.{tmp_tag or os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        if before_replace is not None:
            before_replace()
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    try:
        fsync_dir(path.parent)
    except OSError as exc:
        raise RenameNotDurable(exc.errno, exc.strerror or str(exc), str(path.parent)) from exc


class Gate(Protocol):
    """What the writers need of a pause switch: threading.Event or multiprocessing.Event."""

    def wait(self, timeout: float | None = None) -> bool: ...

    def set(self) -> None: ...


# A pause never lasts longer than this, whatever happens to the resume: the write's own
# deadline keeps its meaning.
MAX_PAUSE_S = 30.0


class ChecksummingWriter:
    """A binary stream wrapper that checksums and counts the bytes as they pass.

    `torch.save` and DCP's item writer need `write`, `tell`, `flush`; `seek` is refused
    because a checksum over a stream that seeks back would not describe the file.
    """

    def __init__(self, stream: BinaryIO, gate: Gate | None = None) -> None:
        self._stream = stream
        self._gate = gate
        self._hasher = new_hasher()
        self.size = 0
        # torch.save's C++ writer turns an OSError of `write` into a RuntimeError that no
        # longer says why ("unexpected pos ..."); the first one is kept here so that the
        # caller can raise the real cause (ENOSPC, EFBIG, EIO) naming the file.
        self.error: OSError | None = None

    def write(self, data: bytes | memoryview) -> int:
        if self._gate is not None and not self._gate.wait(MAX_PAUSE_S):
            # Held back while the trainer changes its state (CheckpointManager.quiet): one
            # check per write call, i.e. between tensors, never inside one. A pause whose
            # resume never came (an optimizer step that raised) ends here, for good.
            self._gate.set()
        try:
            written = self._stream.write(data)
        except OSError as exc:
            if self.error is None:
                self.error = exc
            raise
        view = memoryview(data).cast("B")
        self._hasher.update(view)
        self.size += view.nbytes
        return written if written is not None else view.nbytes

    def tell(self) -> int:
        return self._stream.tell()

    def flush(self) -> None:
        self._stream.flush()

    def fileno(self) -> int:
        return self._stream.fileno()

    def seekable(self) -> bool:
        return False

    def writable(self) -> bool:
        return True

    @property
    def checksum(self) -> str:
        """The CHECKSUM_ALGORITHM digest of the bytes written so far."""
        return self._hasher.hexdigest()


def file_checksum(path: str | os.PathLike, algorithm: str = CHECKSUM_ALGORITHM) -> tuple[int, str]:
    """Return (size, checksum) of the file at `path`, read back from disk."""
    hasher = new_hasher(algorithm)
    size = 0
    with open(path, "rb") as f:
        while chunk := f.read(_READ_CHUNK):
            hasher.update(chunk)
            size += len(chunk)
    return size, hasher.hexdigest()


def remove_stale_temporaries(directory: str | os.PathLike, name: str) -> list[Path]:
    """Remove the temporary files that a crash inside `atomic_write_bytes(name)` left."""
    removed = []
    for tmp in Path(directory).glob(f".{name}.tmp.*"):
        tmp.unlink(missing_ok=True)
        removed.append(tmp)
    return removed
