"""A file written around the page cache (Linux O_DIRECT), through aligned bounce buffers.

Why: a buffered write copies every byte into the page cache, and the kernel then allocates,
dirties, writes back and later reclaims those pages. On a small host that work competes with
the training thread for the cores and the memory bandwidth: the trainer's next update ran
about twice as slow while a buffered save's write ran beside it (benchmarks/README.md).
Written O_DIRECT, the bytes are copied once into a buffer the device reads itself, and the
page cache is never touched.

O_DIRECT needs the file offset, the length and the memory address aligned to the device's
block; the stream of a rank's file (torch.save blobs of any length) is not. So the bytes go
through page-aligned buffers that are written whole, at aligned offsets, and only the last
partial block of the file is written through the page cache (O_DIRECT cleared on the
descriptor for it), before the usual fsync. Where the filesystem refuses O_DIRECT (tmpfs,
some network and FUSE filesystems), the file is written through the page cache as before.

Zero copy: a large write whose bytes lie at an address congruent to the file position
(modulo the block) skips the buffers for all but its first and last partial blocks: the
device reads the caller's memory itself. The rank's writer lays its files out so that a large
tensor's storage lands that way (format/torch_format.py pads before its blob, and staging
buffers are page-aligned), which leaves the write one copy fewer: the snapshot's.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import mmap
import os
import stat
import sys
import threading
from collections.abc import Callable

import numpy as np

from verl_ckpt.store.device_queue import DeviceQueue, hung_error

__all__ = ["BLOCK_BYTES", "ZERO_COPY_MIN", "DirectFile", "open_direct", "page_aligned_buffer"]

# The device block that O_DIRECT offsets and lengths are aligned to: 4096 covers the 512-byte
# and the 4096-byte logical blocks of every common device.
BLOCK_BYTES = 4096
# The bounce buffer, written in one call each time it is full: large enough that a file is
# a few large requests, small enough to stay a cheap allocation per file.
_BUFFER_BYTES = 8 << 20
_O_DIRECT = getattr(os, "O_DIRECT", 0)
# Private anonymous memory: not shared memory, and neighbouring mappings merge into one.
_PRIVATE = (mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS) if hasattr(mmap, "MAP_ANONYMOUS") else 0
# What a write from the caller's memory may be refused with where a copy is taken: EINVAL (a
# device that wants more alignment), EFAULT (memory the kernel cannot pin for the device,
# such as some accelerators' host allocations), EOPNOTSUPP.
_IN_PLACE_REFUSED = (errno.EINVAL, errno.EFAULT, errno.EOPNOTSUPP)
# A write at least this large goes from the caller's memory where its address allows (see
# DirectFile.write); below it, a copy into the buffer costs less than a request of its own.
ZERO_COPY_MIN = 1 << 20
# Buffers kept for the next file once one is closed: two files' worth (a rank's two writer
# threads). A fresh mapping pays a page fault (and the kernel's zeroing) per page on its first
# fill and an unmap at the end, which cost a rank's small files more than their bytes.
_BUFFERS_KEPT = 4
# The most pieces one vectored request may have (the kernel's UIO_MAXIOV).
_IOV_MAX = 1024
# Gathered jobs queued ahead of the device at most: enough that it never waits for the
# writer, few enough that an error (ENOSPC, EIO) is raised within a job or two, and that a
# failed file leaves little to cancel.
_JOBS_AHEAD = 2


def _split(
    segments: list[np.ndarray], nbytes: int, pieces: int | None = None
) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """The first `nbytes` of `segments` (at most `pieces` of them) and the rest."""
    first: list[np.ndarray] = []
    rest = list(segments)
    while rest and nbytes and (pieces is None or len(first) < pieces):
        piece = rest.pop(0)
        if piece.size > nbytes:
            rest.insert(0, piece[nbytes:])
            piece = piece[:nbytes]
        first.append(piece)
        nbytes -= piece.size
    return first, rest


def page_aligned_buffer(nbytes: int) -> mmap.mmap:
    """`nbytes` of zeroed memory starting on a page: a mapping of its own, private where the
    platform says how (not shared memory, and neighbouring mappings merge into one)."""
    return mmap.mmap(-1, nbytes, flags=_PRIVATE) if _PRIVATE else mmap.mmap(-1, nbytes)


class _BufferPool:
    """Page-aligned buffers of _BUFFER_BYTES, handed out to files and taken back."""

    def __init__(self, keep: int) -> None:
        self._keep = keep
        self._free: list[mmap.mmap] = []
        self._lock = threading.Lock()

    def take(self) -> mmap.mmap:
        with self._lock:
            if self._free:
                return self._free.pop()
        return page_aligned_buffer(_BUFFER_BYTES)

    def give_back(self, buffer: mmap.mmap) -> None:
        with self._lock:
            if len(self._free) < self._keep:
                self._free.append(buffer)
                return
        # A view still alive elsewhere (a caller's traceback) keeps the buffer mapped until
        # it is collected: never an error of the file.
        with contextlib.suppress(BufferError):
            buffer.close()


_buffers = _BufferPool(_BUFFERS_KEPT)


def open_direct(fd: int) -> DirectFile | None:
    """A DirectFile over the open, empty regular file `fd` (which it then owns and closes),
    or None where O_DIRECT cannot be set on it: the caller writes through the page cache."""
    if not _O_DIRECT or not sys.platform.startswith("linux"):
        return None
    try:
        # A regular file only: on a pipe the flag means something else (packet mode).
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        flags = fcntl.fcntl(fd, fcntl.F_GETFL)
        fcntl.fcntl(fd, fcntl.F_SETFL, flags | _O_DIRECT)
    except OSError:  # EINVAL: the filesystem does not do O_DIRECT
        return None
    try:
        return DirectFile(fd)
    except (OSError, ValueError, MemoryError):
        # No memory for the buffers: the caller writes (and closes) the file as before.
        fcntl.fcntl(fd, fcntl.F_SETFL, flags)
        return None


class DirectFile:
    """A write-only binary stream over `fd` (O_DIRECT set, empty): `write` and `tell` for
    torch.save and DCP's item writer; `finish` writes what the buffer holds; `close`.

    Two buffers: while a helper thread (DeviceQueue) writes a full one to the device, the
    writer fills the other, so that the device never waits for the copy (the writer waits
    only when both are full).

    A write of ZERO_COPY_MIN bytes or more whose address is congruent to the file position
    modulo the block is written from the caller's memory (by the helper, bounded as a
    buffer's write), before write() returns (so the caller may reuse its memory afterwards,
    as with any stream): `zero_copy_bytes` counts those bytes.

    A `held` write (memory the caller keeps unchanged until finish() returns: a staged or
    live tensor's storage) is not waited for: its whole blocks join the buffer's before them
    in a gathered request (pwritev) of _BUFFER_BYTES or more, queued for the helper while
    the writer goes on. Why: a rank's file is many tensors of a few MiB with a header
    between each; written one synchronous request per tensor and one per header, the device
    drained its queue between them (benchmarks/results_issue44.md).
    """

    # write() takes `beside` and `between` (fsio.ChecksummingWriter hashes a slice while the
    # device writes it, and holds the rest back during a pause).
    writes_beside = True

    def __init__(self, fd: int) -> None:
        self._fd = fd
        self._buffers = [_buffers.take()]
        try:
            self._buffers.append(_buffers.take())
        except (OSError, ValueError, MemoryError):
            _buffers.give_back(self._buffers[0])
            raise
        self._arrays = [np.frombuffer(b, dtype=np.uint8) for b in self._buffers]
        self._current = 0  # the buffer being filled
        self._filled = 0  # bytes in it
        self._written = 0  # bytes handed to the device (a multiple of BLOCK_BYTES until finish)
        self._direct = True
        self._queue = DeviceQueue()
        # Held writes and the buffer's blocks before each, not yet queued (they lie in the
        # file from self._written on); the current buffer's bytes before _start are in them
        # or in a queued job.
        self._gathered: list[np.ndarray] = []
        self._gathered_bytes = 0
        self._start = 0
        self._between: Callable[[], None] | None = None
        self._zero_copy = True  # until a write from the caller's memory is refused
        self.zero_copy_bytes = 0

    def write(
        self,
        data: bytes | memoryview,
        beside: Callable[[], None] | None = None,
        between: Callable[[], None] | None = None,
        held: bool = False,
    ) -> int:
        """Write `data`. `beside`, if given, is called once on this thread while the device
        writes the bytes (it may read `data`, never change it): a checksum of them then
        costs the write no time of its own. `between`, if given, is called before each
        further request of _BUFFER_BYTES (on the helper, or on this thread): a pause there
        holds the rest of a large write back. `held`: the caller keeps `data` unchanged
        until finish() returns, so its write need not end before this returns."""
        source = np.frombuffer(data, dtype=np.uint8)
        if self._zero_copy and self._direct and source.size >= ZERO_COPY_MIN:
            return self._write_in_place(source, beside, between, held)
        return self._copy_in(source, between, beside)

    def _write_in_place(
        self,
        source: np.ndarray,
        beside: Callable[[], None] | None,
        between: Callable[[], None] | None,
        held: bool = False,
    ) -> int:
        """Write `source` with its whole aligned blocks taken from where it lies, if its
        address and the file position agree modulo the block; else copy it in."""
        lead = -source.ctypes.data % BLOCK_BYTES  # bytes before its first aligned address
        if (self.tell() + lead) % BLOCK_BYTES or source.size - lead < BLOCK_BYTES:
            return self._copy_in(source, between, beside)
        self._copy_in(source[:lead])
        if held:
            middle = (source.size - lead) - (source.size - lead) % BLOCK_BYTES
            self._gather(source[lead : lead + middle], between)
            self.zero_copy_bytes += middle
            self._copy_in(source[lead + middle :], between)
            if beside is not None:
                beside()  # the device writes meanwhile what was queued before
            return source.size
        # The position is aligned now, so the buffer holds whole blocks: it goes first (to
        # the helper), then the aligned middle goes from the caller's memory to the offsets
        # after it (the two writes touch different offsets, so they may overlap).
        self._hand_over(self._filled)
        middle = (source.size - lead) - (source.size - lead) % BLOCK_BYTES
        done = self._in_place(source[lead : lead + middle], self._written, beside, between)
        self._written += done
        self.zero_copy_bytes += done
        self._copy_in(source[lead + done :], between)
        return source.size

    def _in_place(
        self,
        view: np.ndarray,
        offset: int,
        beside: Callable[[], None] | None = None,
        between: Callable[[], None] | None = None,
    ) -> int:
        """_pwrite_in_place on the helper (after the buffer handed over before it), waited
        for while its requests go on ending: a device on which none ended for a while
        (DeviceQueue.ended_in_time) is named as hung, not waited on for good. `beside` runs
        on this thread meanwhile."""
        ended = self._queue.requests_ended
        writing = self._queue.run(self._pwrite_in_place, view, offset, between)
        if beside is not None:
            try:
                beside()
            except BaseException:
                # The device may still read the caller's memory: never return before it ends.
                self._queue.ended_in_time(writing, ended)
                raise
        if not self._queue.ended_in_time(writing, ended):
            raise hung_error()
        return writing.result()

    def _pwrite_in_place(
        self, view: np.ndarray, offset: int, between: Callable[[], None] | None = None
    ) -> int:
        """Write `view` (aligned) at `offset` from its own memory, in requests of
        _BUFFER_BYTES back to back (the helper issues the next as soon as one ends: no
        hand-off between threads leaves the device idle); return the bytes written, fewer
        only where the device refused such a write (_IN_PLACE_REFUSED): the rest is then
        copied in, for this file's remaining writes too."""
        done = 0
        while done < view.size:
            if done and between is not None:
                between()
            try:
                wrote = os.pwrite(self._fd, view[done : done + _BUFFER_BYTES], offset + done)
            except OSError as exc:
                if exc.errno not in _IN_PLACE_REFUSED:
                    raise
                self._zero_copy = False
                return done
            if wrote == 0:  # a device that takes nothing: never spin on it
                raise OSError(errno.ENOSPC, "No space left on device")
            # A short write off the block makes the next one EINVAL, which ends this above;
            # the buffers' own writes then fall back to the page cache (_write_buffer).
            done += wrote
            self._queue.request_ended()
        return done

    def _copy_in(
        self,
        source: np.ndarray,
        between: Callable[[], None] | None = None,
        beside: Callable[[], None] | None = None,
    ) -> int:
        """Copy `source` into the buffers, each full one handed to the helper (`between`
        before each further one); then `beside`, while the helper writes the last."""
        done = 0
        while done < source.size:
            take = min(source.size - done, _BUFFER_BYTES - self._filled)
            # numpy's copy runs without the GIL: the training thread is not held up by it,
            # as it would be by a memoryview slice assignment.
            end = self._filled + take
            self._arrays[self._current][self._filled : end] = source[done : done + take]
            self._filled = end
            done += take
            if self._filled == _BUFFER_BYTES:
                self._hand_over()
                if done < source.size and between is not None:
                    between()
        if beside is not None:
            beside()
        return done

    def _gather(self, middle: np.ndarray, between: Callable[[], None] | None) -> None:
        """Queue the buffer's blocks not yet queued, then `middle` (held, whole blocks, at
        the aligned position after them), once _BUFFER_BYTES or more are gathered."""
        self._between = between
        blocks = self._arrays[self._current][self._start : self._filled]
        self._gathered += [blocks, middle] if blocks.size else [middle]
        self._gathered_bytes += blocks.size + middle.size
        # The buffer goes on filling after them: its bytes before _start are never changed
        # until the helper's jobs that read them ended (_hand_over waits for them).
        self._start = self._filled
        if self._gathered_bytes >= _BUFFER_BYTES:
            # Whole requests only: the rest waits for the next write, so that no request is
            # a short remainder of one job.
            whole = self._gathered_bytes - self._gathered_bytes % _BUFFER_BYTES
            request, self._gathered = _split(self._gathered, whole)
            self._gathered_bytes -= whole
            self._submit_segments(request, whole)
            if len(self._queue.unchecked) >= _JOBS_AHEAD:
                self._queue.wait_for_oldest()

    def _submit_gathered(self, upto: int) -> None:
        """Queue everything gathered, then the buffer's bytes from _start to `upto` (whole
        blocks)."""
        segments = self._gathered
        if upto > self._start:
            segments.append(self._arrays[self._current][self._start : upto])
        self._gathered, self._gathered_bytes = [], 0
        self._submit_segments(segments, sum(segment.size for segment in segments))

    def _submit_segments(self, segments: list[np.ndarray], nbytes: int) -> None:
        """Queue `segments` (`nbytes` in all) to be written from the position _written."""
        self._queue.submit(self._pwrite_gathered, segments, self._written)
        self._written += nbytes

    def _pwrite_gathered(self, segments: list[np.ndarray], offset: int) -> None:
        """On the helper: write `segments` (whole blocks, in file order) at `offset` in
        vectored requests of _BUFFER_BYTES, back to back, `between` before each. Where the
        device refuses a request from the caller's memory (_IN_PLACE_REFUSED), it and the
        rest are copied through a buffer (and later writes copied in)."""
        while segments:
            # Before every request, the first too: the writer checked for a pause when it
            # queued them, which may be long before the helper gets to them.
            if self._between is not None:
                self._between()
            request, segments = _split(segments, _BUFFER_BYTES, _IOV_MAX)
            nbytes = sum(piece.size for piece in request)
            if self._zero_copy and self._direct:
                try:
                    wrote = os.pwritev(self._fd, request, offset)
                except OSError as exc:
                    if exc.errno not in _IN_PLACE_REFUSED:
                        raise
                    self._zero_copy = False
                    wrote = 0
                if wrote == 0 and self._zero_copy:  # a device that takes nothing: never spin
                    raise OSError(errno.ENOSPC, "No space left on device")
                if wrote < nbytes:  # short (or refused): the rest through a buffer
                    self._write_copied(request, wrote, offset)
            else:
                self._write_copied(request, 0, offset)
            offset += nbytes
            self._queue.request_ended()

    def _write_copied(self, request: list[np.ndarray], skip: int, offset: int) -> None:
        """Write `request`'s bytes after the first `skip` at `offset + skip`, copied into a
        page-aligned buffer (through the page cache where the file refuses O_DIRECT)."""
        if self._fd < 0:
            # Closed under this job (its writer gave up: a hung device, a failed save): the
            # caller no longer holds the memory, which a copy here would read in this
            # process (the kernel's own reads of it are safe, pinned for the request).
            raise OSError(errno.EBADF, "the file was closed while its write went on")
        bounce = _buffers.take()
        try:
            array = np.frombuffer(bounce, dtype=np.uint8)
            filled = 0
            for piece in _split(request, skip)[1]:
                array[filled : filled + piece.size] = piece
                filled += piece.size
            self._pwrite_view(memoryview(bounce)[:filled], offset + skip)
            del array
        finally:
            _buffers.give_back(bounce)

    def tell(self) -> int:
        return self._written + self._gathered_bytes + self._filled - self._start

    def flush(self) -> None:
        """Nothing: a partial buffer is written once, by finish(), so that every write before
        the last stays aligned."""

    def finish(self) -> None:
        """Write what the buffers hold and what was gathered: whole blocks O_DIRECT, the
        rest (under one block) through the page cache; the caller's fsync makes both
        durable."""
        whole = self._filled - self._filled % BLOCK_BYTES
        if self._gathered or self._start:
            self._submit_gathered(whole)
            self._queue.wait_for_all()
        else:
            self._queue.wait_for_all()
            if whole:
                self._write_buffer(self._current, 0, whole, self._written)
            self._written += whole
        if self._filled > whole:
            self._set_direct(False)
            self._write_buffer(self._current, whole, self._filled - whole, self._written)
        self._written += self._filled - whole
        self._filled = self._start = 0

    def fileno(self) -> int:
        return self._fd

    def writable(self) -> bool:
        return True

    def close(self) -> None:
        if self._fd < 0:
            return
        fd, self._fd = self._fd, -1
        still_running: list[str] = []
        try:
            # Jobs not started are cancelled (the writer failed: what they would write is
            # discarded); the one running is waited for, bounded, so that neither its buffer
            # nor the descriptor goes away under it.
            still_running = self._queue.close()
        finally:
            self._arrays.clear()
            # A job still running (a hung write) writes through the descriptor and may read
            # a buffer: closed, the descriptor's number could be reused by another file,
            # which the job would then write into, and a buffer handed out again could be
            # refilled under it. Both are left to it. Once no job runs, every one the helper
            # was given has ended or was cancelled.
            if not still_running:
                os.close(fd)
                for buffer in self._buffers:
                    _buffers.give_back(buffer)

    def __enter__(self) -> DirectFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _hand_over(self, nbytes: int = _BUFFER_BYTES) -> None:
        """The current buffer's first `nbytes` (whole blocks: all of it when it is full),
        after what was gathered, go to the helper to write; the writer goes on in the other
        buffer, once the helper's last job (which may read that one) ended."""
        if not nbytes and not self._gathered:
            return
        self._queue.wait_for_all()
        if self._gathered or self._start:
            self._submit_gathered(nbytes)
        else:
            self._queue.submit(self._write_buffer, self._current, 0, nbytes, self._written)
            self._written += nbytes
        self._current = 1 - self._current
        self._filled = self._start = 0

    def _write_buffer(self, index: int, start: int, nbytes: int, offset: int) -> None:
        """Write `nbytes` of buffer `index` from `start` at file offset `offset`."""
        self._pwrite_view(memoryview(self._buffers[index])[start : start + nbytes], offset)
        self._queue.request_ended()

    def _pwrite_view(self, view: memoryview, offset: int) -> None:
        """Write `view` (page-aligned memory) at `offset`."""
        try:
            self._pwrite(view, offset)
        except OSError as exc:
            # Some filesystems accept the flag and refuse the write (EINVAL): the rest of the
            # file goes through the page cache, from the same offset.
            if exc.errno != errno.EINVAL or not self._direct:
                raise
            self._set_direct(False)
            self._pwrite(view, offset)

    def _pwrite(self, view: memoryview, offset: int) -> None:
        view = view[:]
        try:
            while view:
                done = os.pwrite(self._fd, view, offset)
                if done == 0:  # a device that takes nothing: never spin on it
                    raise OSError(errno.ENOSPC, "No space left on device")
                offset += done
                view = view[done:]
        finally:
            view.release()

    def _set_direct(self, on: bool) -> None:
        if self._direct == on:
            return
        flags = fcntl.fcntl(self._fd, fcntl.F_GETFL)
        fcntl.fcntl(self._fd, fcntl.F_SETFL, (flags | _O_DIRECT) if on else (flags & ~_O_DIRECT))
        self._direct = on
