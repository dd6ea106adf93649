"""Durable file primitives: fsync of files and directories, atomic replace, checksums, and
files that cannot be redirected.

The commit protocol is only as good as these: a rename is durable only once the directory
holding it has been fsynced, and a file is durable only once its own bytes were fsynced.

A root may be a filesystem others can write (docs/security.md): every file the project
creates is created new (O_CREAT|O_EXCL|O_NOFOLLOW) under a random temporary name, with
FILE_MODE, then renamed; a file opened in place is opened O_NOFOLLOW; a file read from a root
is read only if it is a regular file (never a FIFO or a device), and records are read only
up to a bound.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import os
import queue
import secrets
import stat
import sys
import threading
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Protocol

import xxhash

from verl_ckpt.protocol.config import DEFAULT_EARLY_WRITEBACK_MB
from verl_ckpt.protocol.threads import leave_idle_class, made_progress

__all__ = [
    "CHECKSUM_ALGORITHM",
    "DEFAULT_WRITES",
    "DIR_MODE",
    "FILE_MODE",
    "MAX_PAUSE_S",
    "SUPPORTED_CHECKSUMS",
    "ChecksummingWriter",
    "EarlyWriteback",
    "FileTooLarge",
    "Gate",
    "NotARegularFile",
    "RenameNotDurable",
    "WRITEBACK_EVERY",
    "WriteOptions",
    "atomic_write_bytes",
    "create_new_file",
    "create_replacing",
    "open_for_rewrite",
    "file_checksum",
    "fsync_dir",
    "make_dir",
    "new_hasher",
    "open_dir_beneath",
    "open_no_follow",
    "open_regular",
    "read_regular",
    "remove_stale_temporaries",
    "start_writeback",
    "temporary_name",
    "unlink_beneath",
    "write_in_place",
]

# Owner and group, never world-writable (nor world-readable: a checkpoint is a model). The
# umask can only take more away.
FILE_MODE = 0o640
DIR_MODE = 0o750

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


class NotARegularFile(OSError):
    """A read found something other than a regular file (a FIFO, a device, a symbolic link)
    where a file is expected: never read, since a FIFO would wait for a writer forever and
    a device never end."""


class FileTooLarge(OSError):
    """A record is larger than its kind's bound: never read whole (a huge file planted in a
    root must not cost minutes and the memory of every start)."""


def temporary_name(path: str | os.PathLike, tag: str | None = None) -> Path:
    """A fresh temporary name beside `path`: `.<name>.tmp.[<tag>.]<random>`. Random, so that
    nobody can plant a file or a link there in advance; `remove_stale_temporaries` knows it."""
    path = Path(path)
    middle = f"{tag}." if tag else ""
    return path.with_name(f".{path.name}.tmp.{middle}{secrets.token_hex(8)}")


def open_no_follow(path: str | os.PathLike, flags: int, mode: int = FILE_MODE) -> int:
    """os.open with O_NOFOLLOW and O_CLOEXEC: a symbolic link planted at `path` is refused
    (ELOOP) rather than followed to the file it names. For files opened in place (the root
    lock); a created file gets `mode`."""
    return os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC, mode)


def create_new_file(path: str | os.PathLike, mode: int = FILE_MODE) -> int:
    """A descriptor, open for writing, of a file created new at `path` (FileExistsError when
    anything, a link included, is there already)."""
    return open_no_follow(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)


def _create_replacing_in(directory: int, name: str, mode: int = FILE_MODE) -> int:
    """create_replacing of `name` in the directory open as `directory`."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        return os.open(name, flags, mode, dir_fd=directory)
    except FileExistsError:
        os.unlink(name, dir_fd=directory)
        return os.open(name, flags, mode, dir_fd=directory)


def create_replacing(path: str | os.PathLike, mode: int = FILE_MODE) -> int:
    """A descriptor, open for writing, of a file created new at `path`, whatever was there
    unlinked first. Never opened in place: neither a symbolic link nor a hard link planted
    at the name (O_NOFOLLOW stops only the first) can make the bytes land in another file;
    unlinking a name leaves a link's target untouched."""
    try:
        return create_new_file(path, mode)
    except FileExistsError:
        os.unlink(path)
        return create_new_file(path, mode)


def open_for_rewrite(
    path: str | os.PathLike, mode: int = FILE_MODE, beneath: str | os.PathLike | None = None
) -> int:
    """A descriptor, open for writing, of `path` emptied: created if absent, opened without
    following a symbolic link (ELOOP), and refused when it is a regular file with another
    name (a hard link planted at the name: truncating it would empty that other file). Not
    a regular file (a FIFO) is opened as it is, as rank files always were. With `beneath`
    (the store's root, above `path`), the directory of `path` is reached below it without
    following a link (open_dir_beneath)."""
    flags = os.O_WRONLY | os.O_CREAT
    parent = _below(Path(path).parent, beneath)
    if parent is None:
        fd = open_no_follow(path, flags, mode)
    else:
        directory = open_dir_beneath(beneath, parent)
        try:
            with _naming_in(Path(path).parent):
                fd = os.open(
                    Path(path).name, flags | os.O_NOFOLLOW | os.O_CLOEXEC, mode, dir_fd=directory
                )
        finally:
            os.close(directory)
    try:
        status = os.fstat(fd)
        if stat.S_ISREG(status.st_mode):
            if status.st_nlink > 1:
                raise OSError(
                    errno.EMLINK, "a file with another name (a hard link), not written", str(path)
                )
            os.ftruncate(fd, 0)
    except BaseException:
        os.close(fd)
        raise
    return fd


def write_in_place(
    path: str | os.PathLike,
    data: bytes,
    fsync: bool = False,
    beneath: str | os.PathLike | None = None,
) -> None:
    """Write `data` as the whole file `path`, created new under its own name (not a temp
    and a rename: for small files whose readers tolerate a partial one, markers and
    metadata.json); fsynced with `fsync`. With `beneath` (the store's root, above `path`),
    its directory is reached below it without following a link (open_dir_beneath)."""
    parent = _below(Path(path).parent, beneath)
    if parent is None:
        fd = create_replacing(path)
    else:
        directory = open_dir_beneath(beneath, parent)
        try:
            with _naming_in(Path(path).parent):
                fd = _create_replacing_in(directory, Path(path).name)
        finally:
            os.close(directory)
    with open(fd, "wb") as f:
        f.write(data)
        if fsync:
            f.flush()
            os.fsync(f.fileno())


def make_dir(path: str | os.PathLike, parents: bool = False, exist_ok: bool = False) -> None:
    """Create the directory `path` with DIR_MODE, and its missing parents too with `parents`
    (Path.mkdir would give those the default mode, as `mkdir -p` does)."""
    path = Path(path)
    if parents and not path.parent.is_dir() and path.parent != path:
        make_dir(path.parent, parents=True, exist_ok=True)
    try:
        path.mkdir(mode=DIR_MODE)
    except FileExistsError:
        if not (exist_ok and path.is_dir()):
            raise


_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC


def _below(directory: Path, beneath: str | os.PathLike | None) -> str | None:
    """`directory` relative to `beneath` ("" for `beneath` itself); None without `beneath`
    or where `directory` is not below it (then it is opened by its path, as it was before
    `beneath` existed: a caller's path outside its root is its own)."""
    if beneath is None:
        return None
    rel = os.path.relpath(directory, beneath)
    if rel == ".." or rel.startswith("../") or os.path.isabs(rel):
        return None
    return "" if rel == "." else rel


@contextlib.contextmanager
def _naming_in(directory: str | os.PathLike) -> Iterator[None]:
    """An OSError of a call made by name in a directory held by descriptor names the file
    by its path in `directory`, as the same call made by path does (errors name the file)."""
    try:
        yield
    except OSError as exc:
        if isinstance(exc.filename, str) and not os.path.isabs(exc.filename):
            exc.filename = os.path.join(directory, exc.filename)
        raise


def open_dir_beneath(root: str | os.PathLike, rel: str, create: bool = False) -> int:
    """A descriptor of the directory `rel` below `root`, reached one name at a time without
    following a link: a link (or anything but a directory) at any name of `rel` is refused
    with NotARegularFile, never followed. A writer of the root could otherwise swap one of
    its directories for a link to anywhere (a home directory) between two calls, and the
    next file written or removed by name would be there. `root` itself is opened as given
    (a root configured as a link to a larger disk is the user's own). With `create`, missing
    directories are made, `root` included (DIR_MODE). The caller closes the descriptor."""
    names = [name for name in rel.split("/") if name not in ("", ".")]
    if ".." in names:
        raise OSError(errno.EINVAL, "a name that leaves the root", os.path.join(root, rel))
    if create:
        make_dir(root, parents=True, exist_ok=True)
    fd = os.open(root, _DIR_FLAGS)
    try:
        for name in names:
            if create:
                try:
                    os.mkdir(name, DIR_MODE, dir_fd=fd)
                except FileExistsError:
                    pass  # a link there is refused just below
            try:
                child = os.open(name, _DIR_FLAGS | os.O_NOFOLLOW, dir_fd=fd)
            except OSError as exc:
                if exc.errno not in (errno.ELOOP, errno.ENOTDIR):
                    raise
                where = os.path.join(os.fspath(root), *names[: names.index(name) + 1])
                raise NotARegularFile(
                    exc.errno, "a symbolic link or no directory, not followed", where
                ) from None
            os.close(fd)
            fd = child
    except BaseException:
        os.close(fd)
        raise
    return fd


def unlink_beneath(root: str | os.PathLike, rel: str) -> None:
    """Remove the file `rel` below `root` (nothing when it or its directory is absent), its
    directory reached without following a link (open_dir_beneath). Not made durable: the
    caller syncs the directory when it must."""
    parent, _, name = rel.rpartition("/")
    try:
        directory = open_dir_beneath(root, parent)
    except FileNotFoundError:
        return
    try:
        os.unlink(name, dir_fd=directory)
    except FileNotFoundError:
        pass
    finally:
        os.close(directory)


def open_regular(path: str | os.PathLike) -> int:
    """A read-only descriptor of the regular file at `path`, never of anything else.

    Opened O_NOFOLLOW|O_NONBLOCK and checked with fstat before any read: opening a FIFO
    without O_NONBLOCK would wait for a writer forever, and a link could lead anywhere (a
    device, a file outside the root). FileNotFoundError when absent, IsADirectoryError for a
    directory, NotARegularFile for anything else.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise NotARegularFile(exc.errno, "a symbolic link, not followed", str(path)) from None
        raise
    try:
        mode = os.fstat(fd).st_mode
        if stat.S_ISDIR(mode):
            raise IsADirectoryError(errno.EISDIR, "Is a directory", str(path))
        if not stat.S_ISREG(mode):
            raise NotARegularFile(0, "not a regular file", str(path))
        # A regular file: reads block as usual again (some network filesystems honour it).
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_regular(path: str | os.PathLike, max_bytes: int | None = None) -> bytes | None:
    """The bytes of the regular file at `path` (open_regular), None when it does not exist;
    FileTooLarge naming it when it holds more than `max_bytes`."""
    try:
        fd = open_regular(path)
    except (FileNotFoundError, NotADirectoryError):
        return None
    try:
        return read_bounded(fd, max_bytes, str(path))
    finally:
        os.close(fd)


def read_bounded(fd: int, max_bytes: int | None, name: str) -> bytes:
    """Read `fd` to its end, or raise FileTooLarge naming `name` past `max_bytes`."""
    chunks, total = [], 0
    while chunk := os.read(fd, 1 << 20 if max_bytes is None else min(1 << 20, max_bytes + 1)):
        chunks.append(chunk)
        total += len(chunk)
        if max_bytes is not None and total > max_bytes:
            raise FileTooLarge(errno.EFBIG, f"larger than {max_bytes} bytes", name)
    return b"".join(chunks)


class RenameNotDurable(OSError):
    """The new content replaced the old (readers see it now), but the directory fsync after
    the rename failed, so a power loss might bring the old content back. Distinct from a
    failure before the rename, after which readers still see the old content."""


def atomic_write_bytes(
    path: str | os.PathLike,
    data: bytes,
    before_replace: Callable[[], None] | None = None,
    tmp_tag: str | None = None,
    beneath: str | os.PathLike | None = None,
) -> None:
    """Replace `path` with `data` so that a reader sees the old or the new content, never less.

    Order matters: the temporary file is fsynced before the rename (else a crash could leave
    the new name pointing at an empty file), and the directory is fsynced after the rename
    (else the rename itself may be lost and the old content come back). The temporary file
    is created new under a random name (temporary_name, with `tmp_tag` in it), so that a
    link planted in advance is never followed; one left by a crash is cleared by
    `remove_stale_temporaries`. With `beneath` (a directory above `path`: a store's root),
    the directory of `path` is reached below it without following a link (open_dir_beneath),
    and the temporary file and the rename happen in that directory, held by descriptor. An
    error after the rename is raised as RenameNotDurable: callers whose protocol hinges on
    the rename (the tracker: nothing un-commits a step after it) tell the two apart.
    """
    path = Path(path)
    parent = _below(path.parent, beneath)
    if parent is None:
        directory = os.open(path.parent, _DIR_FLAGS)
    else:
        directory = open_dir_beneath(beneath, parent)
    try:
        tmp = temporary_name(path, tmp_tag).name
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        with _naming_in(path.parent):
            fd = os.open(tmp, flags, FILE_MODE, dir_fd=directory)
        try:
            with open(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            if before_replace is not None:
                before_replace()
            with _naming_in(path.parent):
                os.replace(tmp, path.name, src_dir_fd=directory, dst_dir_fd=directory)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp, dir_fd=directory)
            raise
    finally:
        os.close(directory)
    try:
        fsync_dir(path.parent)  # by name: what it syncs is only durability
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
# A slice of a write around the page cache (ChecksummingWriter._write_direct): its requests go
# to the device back to back, not one hand-off between threads per _WRITE_SLICE, which left
# the device idle between them.
_DIRECT_SLICE = 64 << 20


@dataclass(frozen=True)
class WriteOptions:
    """How a writer puts a file's bytes on disk (checkpoint.writer keys): `direct_io` around
    the page cache where the filesystem allows it (store/direct_io.py), else through it with
    an early writeback every `writeback_every` bytes (EarlyWriteback; 0: none)."""

    writeback_every: int = WRITEBACK_EVERY
    direct_io: bool = False
    # The store's root above every file written: each file's directory is reached below it
    # without following a link (open_dir_beneath). None: the path is opened as it is.
    beneath: str | None = None
    # The storages (by data_ptr) that a live snapshot writes from the trainer's memory: each
    # large one is laid out at its own offset within a page, so that direct_io takes its
    # pages from the tensor itself (format/torch_format.py). Only storages that start on a
    # page (staging buffers) are page-aligned in the file otherwise.
    live_storages: frozenset[int] = frozenset()


# Small files (records, common.pt, a driver's state): through the page cache.
DEFAULT_WRITES = WriteOptions()


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
        # Started by a writer thread that may be in the idle class: the hints are awaited by
        # its fsync, and take next to no CPU.
        leave_idle_class()
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
        # A stream whose write takes `beside` and `between` (a DirectFile): _write_direct.
        self._write_beside = stream.write if getattr(stream, "writes_beside", False) else None
        self.size = 0
        # torch.save's C++ writer turns an OSError of `write` into a RuntimeError that no
        # longer says why ("unexpected pos ..."); the first one is kept here so that the
        # caller can raise the real cause (ENOSPC, EFBIG, EIO) naming the file.
        self.error: OSError | None = None

    def write(self, data: bytes | memoryview) -> int:
        view = memoryview(data).cast("B")
        if self._write_beside is not None:
            return self._write_direct(view)
        for start in range(0, view.nbytes, _WRITE_SLICE):
            # Held back while the trainer changes its state (CheckpointManager.quiet): one
            # check per slice, so that a pause takes hold within one slice even in the middle
            # of a large tensor (a tensor's bytes come in one call). The bytes are the
            # writer's own (staged, or drained by quiet() before it pauses), so a pause
            # anywhere leaves the file whole.
            self._hold_while_paused()
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
            # A writer thread in the idle class that waited too long for a core leaves it.
            made_progress()
        return view.nbytes

    def write_held(self, data: bytes | memoryview) -> int:
        """`write`, for bytes the caller keeps unchanged until the file is finished (a
        staged or live tensor's storage, held by its write bucket): around the page cache
        they are queued for the device rather than waited for (DirectFile.write)."""
        if self._write_beside is None:
            return self.write(data)
        return self._write_direct(memoryview(data).cast("B"), held=True)

    def _write_direct(self, view: memoryview, held: bool = False) -> int:
        """Write `view` to a stream around the page cache (store/direct_io.py) in slices of
        _DIRECT_SLICE: the file's helper writes a slice in requests of _WRITE_SLICE back to
        back, checking for a pause before each (so a pause still takes hold within one
        request), while this thread hashes the slice."""
        assert self._write_beside is not None
        for start in range(0, view.nbytes, _DIRECT_SLICE):
            self._hold_while_paused()
            piece = view[start : start + _DIRECT_SLICE]
            try:
                self._write_beside(
                    piece,
                    functools.partial(self._hash_slices, piece),
                    self._between_slices,
                    held,
                )
            except OSError as exc:
                if self.error is None:
                    self.error = exc
                raise
            self.size += piece.nbytes
        return view.nbytes

    def _hash_slices(self, piece: memoryview) -> None:
        """Hash `piece` a _WRITE_SLICE at a time, each after the checks a slice gets: this
        work too stops within one slice for a pause, and an idle-class writer that waits for
        a core is seen to."""
        for start in range(0, piece.nbytes, _WRITE_SLICE):
            if start:
                self._between_slices()
            self._hasher.update(piece[start : start + _WRITE_SLICE])
        made_progress()

    def _between_slices(self) -> None:
        """Between two slices of a write, on whichever thread writes or hashes them."""
        self._hold_while_paused()
        # A writer thread in the idle class that waited too long for a core leaves it (on
        # the file's helper, which is not in that class, it does nothing).
        made_progress()

    def _hold_while_paused(self) -> None:
        """Wait while the gate is closed (CheckpointManager.quiet). A pause whose resume
        never came (an optimizer step that raised) ends here, for good."""
        if self._gate is not None and not self._gate.wait(MAX_PAUSE_S):
            self._gate.set()

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
    # A regular file only: a FIFO or a device named by a record must not hang the check.
    with open(open_regular(path), "rb") as f:
        while chunk := f.read(_READ_CHUNK):
            hasher.update(chunk)
            size += len(chunk)
    return size, hasher.hexdigest()


def remove_stale_temporaries(directory: str | os.PathLike, name: str) -> list[Path]:
    """Remove the temporary files that a crash inside `atomic_write_bytes(name)` left: the
    random names of temporary_name and the `.<name>.tmp.<pid>` of older versions alike."""
    removed = []
    for tmp in Path(directory).glob(f".{name}.tmp.*"):
        tmp.unlink(missing_ok=True)
        removed.append(tmp)
    return removed
