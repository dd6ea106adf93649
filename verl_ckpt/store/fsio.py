"""Durable file primitives: fsync of files and directories, atomic replace, checksums.

The commit protocol is only as good as these: a rename is durable only once the directory
holding it has been fsynced, and a file is durable only once its own bytes were fsynced.
"""

from __future__ import annotations

import ctypes
import os
import queue
import stat
import sys
import threading
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO, Protocol

import xxhash

from verl_ckpt.protocol.config import DEFAULT_EARLY_WRITEBACK_MB

__all__ = [
    "CHECKSUM_ALGORITHM",
    "MAX_PAUSE_S",
    "SUPPORTED_CHECKSUMS",
    "ChecksummingWriter",
    "EarlyWriteback",
    "Gate",
    "RenameNotDurable",
    "WRITEBACK_EVERY",
    "atomic_write_bytes",
    "file_checksum",
    "fsync_dir",
    "new_hasher",
    "remove_stale_temporaries",
    "start_writeback",
]

# The checksum detects truncation and bit flips; it is no defence against tampering. xxh3_64
# runs at memory speed (several times zlib.crc32) and releases the GIL, so checksumming
# while writing does not cap a fast disk. crc32 stays readable: commit records name their
# algorithm, and those written with crc32 still verify.
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


# How often a file being written hands its new bytes to the disk (see EarlyWriteback), and
# the slices a large write is cut into so that this happens inside one big tensor too.
# Small hand-overs start the disk sooner and leave the final fsync less to do (figures:
# benchmarks/README.md). Inside a large tensor the bytes are handed over per write slice.
WRITEBACK_EVERY = DEFAULT_EARLY_WRITEBACK_MB << 20
_WRITE_SLICE = 8 << 20


def _load_sync_file_range() -> Callable[..., int] | None:
    """Linux's sync_file_range(2) from the C library, or None elsewhere."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        function = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    function.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    function.restype = ctypes.c_int
    return function


_sync_file_range = _load_sync_file_range()
_SYNC_FILE_RANGE_WRITE = 2


def start_writeback(fd: int, offset: int, nbytes: int) -> bool:
    """Have the disk start writing bytes [offset, offset + nbytes) of the open file `fd`,
    without waiting (Linux's sync_file_range with SYNC_FILE_RANGE_WRITE; ctypes releases
    the GIL for the call). False where that is not available or the filesystem refused."""
    if _sync_file_range is None:
        return False
    return _sync_file_range(fd, offset, nbytes, _SYNC_FILE_RANGE_WRITE) == 0


class EarlyWriteback:
    """Start the disk writing a file's new bytes every `every` bytes, without waiting for it
    (start_writeback), from a helper thread of the file.

    Without it the kernel keeps the whole file dirty in the page cache and the final fsync
    writes it all while the writer waits: serialising and the disk take turns. With it the
    disk works while later bytes are still being serialised, and the fsync finds little left.
    The call runs on a helper thread, never on the writer: sync_file_range blocks once the
    disk's request queue is full, and a writer blocked there stops filling the page cache,
    so that the two take turns again (benchmarks/README.md compares the two).

    Only a hint: the fsync at the end is still what makes the file durable and what reports
    an I/O error. The helper holds its own duplicate of the descriptor, so the writer closes
    its file whenever it is done; a hint still running then touches nothing of the writer's.
    Only regular files get hints (a pipe would stay open while the helper holds it); where
    the call is refused (a filesystem without it) none is made again.
    """

    def __init__(self, fd: int | None, every: int) -> None:
        self._fd = fd if _sync_file_range is not None and every > 0 and _is_regular(fd) else None
        self._every = every
        self._handed = 0
        self._pending: queue.SimpleQueue[int | None] | None = None
        self._stopped = False

    def advance(self, end: int) -> None:
        """The file now holds `end` bytes: hand the ones not yet handed over to the disk, once
        there are `every` of them."""
        if self._fd is None or self._stopped or end - self._handed < self._every:
            return
        if self._pending is None and not self._start_helper():
            return
        self._pending.put(end)
        self._handed = end

    def _start_helper(self) -> bool:
        # Out of descriptors or threads: a hint is not worth failing the write for.
        try:
            own_fd = os.dup(self._fd)
        except OSError:
            self._fd = None
            return False
        self._pending = queue.SimpleQueue()
        helper = threading.Thread(
            target=self._hand_over, args=(own_fd,), name="verl_ckpt_writeback", daemon=True
        )
        try:
            helper.start()
        except RuntimeError:
            os.close(own_fd)
            self._fd, self._pending = None, None
            return False
        return True

    def close(self) -> None:
        """No more bytes come: the helper makes the hints already handed, then ends."""
        if self._pending is not None:
            self._pending.put(None)

    def _hand_over(self, fd: int) -> None:
        started = 0
        try:
            while True:
                try:
                    # A writer paused by quiet() hands nothing for up to MAX_PAUSE_S; one
                    # that died without close() never will: then the helper ends.
                    end = self._pending.get(timeout=MAX_PAUSE_S + 30.0)
                except queue.Empty:
                    return
                closing = end is None
                # What piled up while the last call was blocked goes in one call.
                while not closing and not self._pending.empty():
                    later = self._pending.get_nowait()
                    closing = later is None
                    end = end if later is None else later
                if end is not None and end > started:
                    if not start_writeback(fd, started, end - started):
                        return
                    started = end
                if closing:
                    return
        finally:
            self._stopped = True
            os.close(fd)


def _is_regular(fd: int | None) -> bool:
    try:
        return fd is not None and stat.S_ISREG(os.fstat(fd).st_mode)
    except OSError:
        return False


class ChecksummingWriter:
    """A binary stream wrapper that checksums and counts the bytes as they pass, and has the
    disk write them early (EarlyWriteback; `writeback_every=0` turns that off).

    `torch.save` and DCP's item writer need `write`, `tell`, `flush`; `seek` is refused
    because a checksum over a stream that seeks back would not describe the file.
    """

    def __init__(
        self, stream: BinaryIO, gate: Gate | None = None, writeback_every: int = WRITEBACK_EVERY
    ) -> None:
        self._stream = stream
        self._gate = gate
        self._hasher = new_hasher()
        try:
            fd = stream.fileno()
        except (AttributeError, OSError, ValueError):  # not a file (a BytesIO)
            fd = None
        self._writeback = EarlyWriteback(fd, writeback_every)
        self.size = 0
        # torch.save's C++ writer turns an OSError of `write` into a RuntimeError that no
        # longer says why ("unexpected pos ..."); the first one is kept here so that the
        # caller can raise the real cause (ENOSPC, EFBIG, EIO) naming the file.
        self.error: OSError | None = None

    def write(self, data: bytes | memoryview) -> int:
        view = memoryview(data).cast("B")
        for start in range(0, view.nbytes, _WRITE_SLICE):
            # Held back while the trainer changes its state (CheckpointManager.quiet): one
            # check per slice, so that a pause takes hold within one slice even in the middle
            # of a large tensor (a tensor's bytes come in one call). The bytes are the
            # writer's own (staged, or drained by quiet() before it pauses), so a pause
            # anywhere leaves the file whole. A pause whose resume never came (an optimizer
            # step that raised) ends here, for good.
            if self._gate is not None and not self._gate.wait(MAX_PAUSE_S):
                self._gate.set()
            piece = view[start : start + _WRITE_SLICE]
            try:
                self._stream.write(piece)
            except OSError as exc:
                if self.error is None:
                    self.error = exc
                raise
            self._hasher.update(piece)
            self.size += piece.nbytes
            self._writeback.advance(self.size)
        return view.nbytes

    def done_writing(self) -> None:
        """No more bytes come: the early writeback's helper ends once its hints are made."""
        self._writeback.close()

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
