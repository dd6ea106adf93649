"""Files written around the page cache (writer.direct_io, store/direct_io.py): the bytes and
the checksum are exactly those written, whatever their lengths and alignment; the page cache
holds at most the file's last partial block; a filesystem or file that cannot do O_DIRECT is
written through the page cache as before. Real files on the test's own filesystem; the
refusals of other filesystems are faked (each test says so)."""

from __future__ import annotations

import ctypes
import errno
import fcntl
import mmap
import os
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from verl_ckpt.store import device_queue, direct_io
from verl_ckpt.store.checksummed_file import write_checksummed
from verl_ckpt.store.direct_io import open_direct
from verl_ckpt.store.fsio import WriteOptions, file_checksum

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux O_DIRECT")

DIRECT = WriteOptions(direct_io=True)
MiB = 1 << 20


def _direct_capable(directory: Path) -> bool:
    fd = os.open(directory / ".probe", os.O_WRONLY | os.O_CREAT, 0o600)
    handle = open_direct(fd)
    (directory / ".probe").unlink()
    if handle is None:
        os.close(fd)
        return False
    handle.close()  # the DirectFile owns the descriptor
    return True


@pytest.mark.parametrize(
    "pieces",
    [
        [0],
        [1],
        [4095, 1],
        [4096],
        [8 * MiB],
        [8 * MiB + 5],
        [3, 8 * MiB - 3, 4097],
        [20 * MiB + 123, 77, 5 * MiB],
    ],
)
def test_direct_writes_hold_exactly_the_bytes_and_checksum_written(tmp_path, pieces):
    if not _direct_capable(tmp_path):
        pytest.skip("the test's filesystem does not do O_DIRECT")
    chunks = [os.urandom(n) for n in pieces]
    path = tmp_path / "rank.distcp"

    def write(stream) -> None:
        for chunk in chunks:
            stream.write(memoryview(chunk))
        assert stream.tell() == sum(pieces)

    written = write_checksummed(path, write, options=DIRECT)
    assert path.read_bytes() == b"".join(chunks)
    assert (written.size, written.checksum) == file_checksum(path)


def test_direct_writes_leave_the_page_cache_but_the_last_block(tmp_path):
    """The point of it: the file's pages are not cached (mincore), but for the partial
    block at the end, which goes through the page cache."""
    if not _direct_capable(tmp_path) or _on_tmpfs(tmp_path):
        pytest.skip("the test's filesystem does not do O_DIRECT, or caches it anyway (tmpfs)")
    path = tmp_path / "rank.distcp"
    tensor = torch.rand(6 * MiB // 4)
    written = write_checksummed(
        path,
        lambda s: (s.write(memoryview(tensor.numpy()).cast("B")), s.write(b"tail")),
        options=DIRECT,
    )
    assert written.size == 6 * MiB + 4
    assert _cached_pages(path) <= 1
    buffered = tmp_path / "buffered.distcp"
    write_checksummed(buffered, lambda s: s.write(memoryview(tensor.numpy()).cast("B")))
    assert _cached_pages(buffered) > 1000  # the same bytes through the page cache stay cached


def _aligned_bytes(nbytes: int, lead: int) -> tuple[mmap.mmap, memoryview]:
    """Random bytes starting `lead` bytes after a page boundary (page-aligned for 0)."""
    memory = mmap.mmap(-1, nbytes + lead)
    view = memoryview(memory)[lead:]
    view[:] = os.urandom(nbytes)
    return memory, view


@pytest.mark.parametrize(
    "before, lead, nbytes",
    [
        (0, 0, 4 * MiB),  # page-aligned memory at the file's start
        (0, 0, 4 * MiB + 5),  # a partial block after the aligned middle
        (64, 64, 3 * MiB + 17),  # memory and position one cache line past a page
        (3 * 4096 + 100, 100, 9 * MiB),  # several pages in, more than a buffer's worth
    ],
)
def test_a_large_write_congruent_to_the_position_goes_from_the_callers_memory(
    tmp_path, before, lead, nbytes
):
    """Zero copy: the whole blocks of a large write whose address agrees with the file
    position modulo the block are written from where they lie; the file holds exactly the
    bytes (and the checksum covers them), the partial blocks around them copied."""
    if not _direct_capable(tmp_path):
        pytest.skip("the test's filesystem does not do O_DIRECT")
    head = os.urandom(before)
    memory, view = _aligned_bytes(nbytes, lead)
    expected = head + bytes(view)
    fd = os.open(tmp_path / "f", os.O_WRONLY | os.O_CREAT, 0o600)
    with open_direct(fd) as direct:
        direct.write(head)
        direct.write(view)
        direct.write(b"tail")
        direct.finish()
        in_place = direct.zero_copy_bytes
    del view
    memory.close()
    assert (tmp_path / "f").read_bytes() == expected + b"tail"
    assert in_place >= nbytes - 2 * 4096 and in_place % 4096 == 0


def test_a_rank_file_written_with_zero_copy_has_the_checksum_of_its_bytes(tmp_path, monkeypatch):
    """Through the writers' own path (write_checksummed: the helper writes 8 MiB requests
    while the writer hashes them): a page-aligned tensor of 20 MiB after an odd head goes
    mostly from its own memory, and the file's bytes and checksum are exactly what was
    written."""
    if not _direct_capable(tmp_path):
        pytest.skip("the test's filesystem does not do O_DIRECT")
    real_pwrite = os.pwrite
    in_place = []

    def counting(fd, data, offset):
        wrote = real_pwrite(fd, data, offset)
        if not isinstance(data, memoryview):  # the in-place writes pass the caller's array
            in_place.append(wrote)
        return wrote

    monkeypatch.setattr(os, "pwrite", counting)
    _, view = _aligned_bytes(20 * MiB + 333, 5)  # 5 bytes past a page, as the position
    head = os.urandom(5)
    expected = head + bytes(view)
    path = tmp_path / "rank.distcp"
    written = write_checksummed(path, lambda s: (s.write(head), s.write(view)), options=DIRECT)
    assert path.read_bytes() == expected
    assert (written.size, written.checksum) == file_checksum(path)
    assert sum(in_place) >= 20 * MiB - 4 * 4096  # a partial page copied per 8 MiB slice


def test_a_write_whose_address_disagrees_with_the_position_is_copied(tmp_path):
    if not _direct_capable(tmp_path):
        pytest.skip("the test's filesystem does not do O_DIRECT")
    memory, view = _aligned_bytes(4 * MiB, 0)
    fd = os.open(tmp_path / "f", os.O_WRONLY | os.O_CREAT, 0o600)
    with open_direct(fd) as direct:
        direct.write(b"x" * 100)  # the position is 100 past a block; the address on one
        direct.write(view)
        direct.finish()
        assert direct.zero_copy_bytes == 0
    expected = b"x" * 100 + bytes(view)
    del view
    memory.close()
    assert (tmp_path / "f").read_bytes() == expected


@pytest.mark.parametrize("refusal", [errno.EINVAL, errno.EFAULT])
def test_a_device_that_refuses_writes_from_the_callers_memory_gets_copies(
    tmp_path, monkeypatch, refusal
):
    """Faked, saying so: a device whose DMA needs more alignment than a block (EINVAL), or
    memory the kernel cannot pin for the device (EFAULT: some accelerators' host memory),
    refuses a write from the caller's memory while it takes the buffers' (page-aligned,
    8 MiB) writes. The rest of that write and the later ones are copied in; the file is
    whole."""
    real_pwrite = os.pwrite
    refused = []

    def refusing_in_place(fd, data, offset):
        if not isinstance(data, memoryview):  # the in-place writes pass the caller's array
            refused.append(offset)
            raise OSError(refusal, os.strerror(refusal))
        return real_pwrite(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", refusing_in_place)
    if not _direct_capable(tmp_path):
        pytest.skip("the test's filesystem does not do O_DIRECT")
    memories = [_aligned_bytes(5 * MiB, 0) for _ in range(2)]
    fd = os.open(tmp_path / "f", os.O_WRONLY | os.O_CREAT, 0o600)
    with open_direct(fd) as direct:
        for _, view in memories:
            direct.write(view)
        direct.finish()
        assert direct.zero_copy_bytes == 0
    expected = b"".join(bytes(view) for _, view in memories)
    assert refused == [0]  # tried once, then copies for the rest of the file
    assert (tmp_path / "f").read_bytes() == expected


def test_the_next_file_fills_the_buffers_the_last_one_gave_back(tmp_path):
    """A fresh mapping pays a page fault per page on its first fill: files reuse the
    buffers of files closed before them, and no more than _BUFFERS_KEPT are kept."""
    if not _direct_capable(tmp_path):
        pytest.skip("the test's filesystem does not do O_DIRECT")
    pool = direct_io._buffers
    handles = [
        open_direct(os.open(tmp_path / f"f{i}", os.O_WRONLY | os.O_CREAT, 0o600)) for i in range(3)
    ]  # six buffers in use at once
    try:
        for handle in handles:
            handle.write(os.urandom(5000))
            handle.finish()
        given = {id(b) for handle in handles for b in handle._buffers}
    finally:
        for handle in handles:
            handle.close()
    kept = {id(b) for b in pool._free}
    assert len(kept) == direct_io._BUFFERS_KEPT and kept <= given
    with open_direct(os.open(tmp_path / "next", os.O_WRONLY | os.O_CREAT, 0o600)) as handle:
        assert {id(b) for b in handle._buffers} <= kept
        handle.write(b"next")
        handle.finish()
    assert (tmp_path / "next").read_bytes() == b"next"


def test_a_filesystem_that_refuses_the_flag_is_written_through_the_page_cache(
    tmp_path, monkeypatch
):
    """Faked, saying so: no filesystem at hand refuses O_DIRECT (tmpfs takes it since Linux
    6.6), so fcntl refuses setting it here, as a filesystem without it does (EINVAL)."""
    real_fcntl = fcntl.fcntl

    def refusing(fd, command, arg=0):
        if command == fcntl.F_SETFL and arg & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_fcntl(fd, command, arg)

    monkeypatch.setattr(fcntl, "fcntl", refusing)
    data = os.urandom(9 * MiB + 3)
    written = write_checksummed(tmp_path / "f", lambda s: s.write(data), options=DIRECT)
    assert (tmp_path / "f").read_bytes() == data
    assert (written.size, written.checksum) == file_checksum(tmp_path / "f")
    assert _cached_pages(tmp_path / "f") > 1000  # through the page cache


def test_a_filesystem_that_takes_the_flag_but_refuses_the_write_goes_on_buffered(
    tmp_path, monkeypatch
):
    """Faked, saying so: some network and FUSE filesystems accept O_DIRECT on the descriptor
    and refuse the write itself (EINVAL); os.pwrite does so here while the flag is set. The
    file is whole all the same, every byte from where the refusal came."""
    real_pwrite = os.pwrite

    def refusing(fd, data, offset):
        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_pwrite(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", refusing)
    data = os.urandom(17 * MiB + 5)
    written = write_checksummed(tmp_path / "f", lambda s: s.write(data), options=DIRECT)
    assert (tmp_path / "f").read_bytes() == data
    assert (written.size, written.checksum) == file_checksum(tmp_path / "f")


def test_an_io_error_of_a_direct_write_names_the_file(tmp_path, monkeypatch):
    """Faked, saying so: a device error (EIO) cannot be produced on the test's disk."""

    def failing(fd, data, offset):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(os, "pwrite", failing)
    with pytest.raises(OSError, match="rank.distcp") as caught:
        write_checksummed(
            tmp_path / "rank.distcp", lambda s: s.write(os.urandom(9 * MiB)), options=DIRECT
        )
    assert caught.value.errno == errno.EIO


def test_a_fifo_is_never_switched_to_direct_io(tmp_path):
    """On a pipe O_DIRECT is packet mode: open_direct leaves anything but a regular file."""
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    fd = os.open(fifo, os.O_RDWR | os.O_NONBLOCK)
    try:
        assert open_direct(fd) is None
    finally:
        os.close(fd)


def test_a_failed_last_write_names_the_file_and_leaves_no_descriptor(tmp_path, monkeypatch):
    """Faked, saying so: the disk fills (ENOSPC) at the last partial block, the one write
    through the page cache. The error names the file (not a BufferError of the buffers, which
    a traceback kept alive), and the descriptor is closed."""
    real_pwrite = os.pwrite

    def full_at_the_tail(fd, data, offset):
        if not fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_pwrite(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", full_at_the_tail)
    descriptors = len(os.listdir("/proc/self/fd"))
    with pytest.raises(OSError, match="rank.distcp") as caught:
        write_checksummed(
            tmp_path / "rank.distcp", lambda s: s.write(os.urandom(MiB + 5)), options=DIRECT
        )
    assert caught.value.errno == errno.ENOSPC
    assert len(os.listdir("/proc/self/fd")) == descriptors


def _on_tmpfs(path: Path) -> bool:
    with open("/proc/self/mounts") as mounts:
        best = ("", "")
        for line in mounts:
            _, mount_point, kind = line.split()[:3]
            if str(path).startswith(mount_point) and len(mount_point) > len(best[0]):
                best = (mount_point, kind)
    return best[1] == "tmpfs"


def _cached_pages(path: Path) -> int:
    """How many of the file's pages the page cache holds (mincore(2) over a mapping)."""
    size = path.stat().st_size
    pages = (size + mmap.PAGESIZE - 1) // mmap.PAGESIZE
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [
        ctypes.c_void_p,
        ctypes.c_size_t,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_long,
    ]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    fd = os.open(path, os.O_RDONLY)
    try:
        address = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        assert address not in (None, ctypes.c_void_p(-1).value)
        try:
            vector = ctypes.create_string_buffer(pages)
            assert libc.mincore(ctypes.c_void_p(address), size, vector) == 0
            return sum(byte & 1 for byte in vector.raw)
        finally:
            libc.munmap(ctypes.c_void_p(address), size)
    finally:
        os.close(fd)


def test_a_slice_is_hashed_while_the_device_writes_it(tmp_path):
    """The checksumming stream hashes each slice written from the caller's memory while the
    device writes it (DirectFile.write's `beside`), not after: the device is never idle
    while a writer hashes. `beside` runs once per write, before the write is counted as
    done, and the file's checksum is still exactly that of its bytes."""
    if not _direct_capable(tmp_path):
        pytest.skip("the test's filesystem does not do O_DIRECT")
    memory, view = _aligned_bytes(3 * MiB, 0)
    fd = os.open(tmp_path / "f", os.O_WRONLY | os.O_CREAT, 0o600)
    seen = []
    with open_direct(fd) as direct:
        direct.write(view, beside=lambda: seen.append(direct.zero_copy_bytes))
        direct.write(b"tail", beside=lambda: seen.append("small"))
        direct.finish()
        assert seen == [0, "small"] and direct.zero_copy_bytes == 3 * MiB
    del view
    memory.close()
    _, view = _aligned_bytes(20 * MiB + 7, 0)
    path = tmp_path / "rank.distcp"
    written = write_checksummed(path, lambda s: s.write(view), options=DIRECT)
    assert (written.size, written.checksum) == file_checksum(path)


def _write_paused_in_thread(path: Path, fill, gate) -> tuple:
    """write_checksummed(path, fill) on a thread of its own, given half a second to go as
    far as the pause (started from inside the write) lets it; returns the thread and the
    list its WrittenFile will be appended to."""
    result: list = []

    def write() -> None:
        result.append(write_checksummed(path, fill, gate, DIRECT))

    writer = threading.Thread(target=write)
    writer.start()
    writer.join(0.5)
    return writer, result


def _pause_at_the_first_request(monkeypatch, call: str) -> tuple[threading.Event, list]:
    """A write gate (open), and os.`call` wrapped to shut it from inside the first request
    (the trainer enters quiet() while it is written) and to record each request's offset."""
    gate = threading.Event()
    gate.set()
    real = getattr(os, call)
    requests: list = []

    def pausing(fd, data, offset):
        if not requests:
            gate.clear()
        requests.append(offset)
        return real(fd, data, offset)

    monkeypatch.setattr(os, call, pausing)
    return gate, requests


def test_a_pause_takes_hold_between_the_requests_of_a_large_direct_write(tmp_path, monkeypatch):
    """A large slice written around the page cache goes to the device as back-to-back
    requests of 8 MiB on the file's helper thread: a pause (CheckpointManager.quiet) that
    starts during the first must hold the rest back there, and the file is whole once it
    ends. The pause is started from inside the first request (os.pwrite wrapped): the one
    moment a real quiet() could not be placed at on purpose."""
    if not _direct_capable(tmp_path):
        pytest.skip("the test's filesystem does not do O_DIRECT")
    gate, requests = _pause_at_the_first_request(monkeypatch, "pwrite")
    memory, view = _aligned_bytes(24 * MiB, 0)
    path = tmp_path / "rank.distcp"
    expected = bytes(view)
    writer, result = _write_paused_in_thread(path, lambda s: s.write(view), gate)
    assert requests == [0], "the rest of the slice was written during the pause"
    gate.set()  # quiet() ends: the write goes on where it stopped
    writer.join(10)
    assert not writer.is_alive() and requests == [0, 8 * MiB, 16 * MiB]
    assert path.read_bytes() == expected
    assert (result[0].size, result[0].checksum) == file_checksum(path)
    view.release()
    memory.close()


def test_a_pause_stops_the_hash_beside_a_direct_write_within_one_slice(tmp_path, monkeypatch):
    """The writer thread's hash of a large slice (beside the device's write) is work the
    pause exists for too: a pause that starts during the first 8 MiB hashed holds the rest
    of the hash back until it ends. The pause is started from inside the first update (the
    hasher wrapped to count): the one moment a real quiet() could not be placed at on
    purpose."""
    if not _direct_capable(tmp_path):
        pytest.skip("the test's filesystem does not do O_DIRECT")
    from verl_ckpt.store import fsio

    gate = threading.Event()
    gate.set()
    hashed = []

    class Counting:
        def __init__(self) -> None:
            self._real = fsio.xxhash.xxh3_64()

        def update(self, data) -> None:
            if not hashed:
                gate.clear()  # the trainer enters quiet() while the first slice is hashed
            hashed.append(len(data))
            self._real.update(data)

        def hexdigest(self) -> str:
            return self._real.hexdigest()

    monkeypatch.setitem(fsio._HASHERS, fsio.CHECKSUM_ALGORITHM, Counting)
    memory, view = _aligned_bytes(24 * MiB, 0)
    path = tmp_path / "rank.distcp"
    writer, result = _write_paused_in_thread(path, lambda s: s.write(view), gate)
    assert sum(hashed) == 8 * MiB, "the rest of the slice was hashed during the pause"
    gate.set()
    writer.join(10)
    assert not writer.is_alive() and sum(hashed) == 24 * MiB
    assert (result[0].size, result[0].checksum) == file_checksum(path)
    view.release()
    memory.close()


def test_I5_a_device_that_stops_taking_requests_is_named_as_hung_and_a_slow_one_is_not(
    tmp_path, monkeypatch
):
    """A large write from the caller's memory is one call to the file's helper (8 MiB
    requests back to back): it is hung only once a whole wait passes in which none of its
    requests ended. A device slower than that per write but ending a request within each
    wait finishes; one that stops taking requests is named within about one wait, not one
    wait per request of the slice. The hang is faked (os.pwrite held on an event): a real
    device cannot be made to stop on cue."""
    if not _direct_capable(tmp_path):
        pytest.skip("the test's filesystem does not do O_DIRECT")
    monkeypatch.setattr(device_queue, "_HELPER_WAIT_S", 0.5)
    real_pwrite = os.pwrite
    stopped = threading.Event()
    released = threading.Event()

    def device(fd, data, offset):
        if stopped.is_set() and offset > 0:
            released.wait(30)  # stops taking requests after the first
        else:
            time.sleep(0.3)  # slow, but ends a request within each wait
        return real_pwrite(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", device)
    memory, view = _aligned_bytes(32 * MiB, 0)
    path = tmp_path / "slow.distcp"
    written = write_checksummed(path, lambda s: s.write(view), options=DIRECT)
    assert (written.size, written.checksum) == file_checksum(path)

    stopped.set()
    started = time.monotonic()
    with pytest.raises(OSError, match="hung"):
        write_checksummed(tmp_path / "hung.distcp", lambda s: s.write(view), options=DIRECT)
    # Four requests: one wait per request of the slice would be 2 s.
    assert time.monotonic() - started < 1.8
    # The helper of the file found hung may still hold the memory: left to the collector.
    released.set()


# ---- held writes: gathered into whole vectored requests ------------------------------------


def _held_file(pieces: list[tuple[int, int, int, bool]]) -> tuple[bytes, list, list]:
    """A file of `pieces` (bytes before, lead within a page, nbytes, held or not), each
    after a header of random bytes padded so that the piece's memory and position agree
    modulo the block (as the rank's writer lays a large storage out); returns the expected
    bytes, the memory to keep alive until the caller is done, and the (bytes, held) writes
    that make the file."""
    kept, parts, actions = [], [], []
    position = 0
    for before, lead, nbytes, held in pieces:
        head = os.urandom(before)
        position += before
        pad = (lead - position) % 4096
        memory, view = _aligned_bytes(nbytes, lead)
        kept.append((memory, view))
        parts += [head, bytes(pad), bytes(view)]
        actions += [(head, False), (bytes(pad), False), (view, held)]
        position += pad + nbytes
    return b"".join(parts), kept, actions


def _filled_with(actions: list) -> Callable:
    """A fill for write_checksummed: each (bytes, held) written, held ones by write_held."""

    def fill(stream) -> None:
        for data, held in actions:
            (stream.write_held if held else stream.write)(data)

    return fill


@pytest.mark.parametrize(
    "pieces",
    [
        [(100, 64, 3 * MiB + 17, True)],
        [(300, 64, 6 * MiB, True), (300, 128, 2 * MiB, True), (300, 64, 8 * MiB + 5, True)],
        [(0, 0, 20 * MiB + 7, True), (5000, 64, 1 * MiB, True), (10, 0, 3 * MiB, False)],
        [(64, 64, 2 * MiB, False), (64, 64, 2 * MiB, True), (9 * MiB, 64, 5 * MiB, True)],
    ],
)
def test_held_writes_go_in_whole_vectored_requests_and_the_file_is_exact(
    tmp_path, monkeypatch, pieces
):
    """Tensors a write bucket holds until the file is finished (write_held) are not waited
    for one by one: with the buffer's blocks between them (headers, padding) they go to the
    device in vectored requests of 8 MiB, all whole but the file's last, from the tensors'
    own memory; held and waited writes mixed, the file and its checksum are exactly the
    bytes written."""
    if not _direct_capable(tmp_path):
        pytest.skip("the test's filesystem does not do O_DIRECT")
    real_pwritev = os.pwritev
    requests = []

    def counting(fd, buffers, offset):
        wrote = real_pwritev(fd, buffers, offset)
        requests.append(wrote)
        return wrote

    monkeypatch.setattr(os, "pwritev", counting)
    expected, kept, actions = _held_file(pieces)
    path = tmp_path / "rank.distcp"
    written = write_checksummed(path, _filled_with(actions), options=DIRECT)
    assert path.read_bytes() == expected
    assert (written.size, written.checksum) == file_checksum(path)
    assert requests and all(r <= 8 * MiB for r in requests), requests
    if all(held for *_, held in pieces):
        assert all(r == 8 * MiB for r in requests[:-1]), requests
        assert sum(requests) > len(expected) - 4096  # all but the last partial block


@pytest.mark.parametrize("refusal", [errno.EINVAL, errno.EFAULT])
def test_a_device_that_refuses_a_gathered_request_gets_copies(tmp_path, monkeypatch, refusal):
    """Faked, saying so (as for a single write from the caller's memory): the device
    refuses the vectored request from the tensors' memory; it and the rest of the file go
    through the buffers, and the file is whole."""
    if not _direct_capable(tmp_path):
        pytest.skip("the test's filesystem does not do O_DIRECT")
    refused = []

    def refusing(fd, buffers, offset):
        refused.append(offset)
        raise OSError(refusal, os.strerror(refusal))

    monkeypatch.setattr(os, "pwritev", refusing)
    expected, kept, actions = _held_file(
        [(300, 64, 6 * MiB, True), (300, 64, 7 * MiB, True), (300, 64, 9 * MiB, True)]
    )
    path = tmp_path / "rank.distcp"
    written = write_checksummed(path, _filled_with(actions), options=DIRECT)
    assert refused == [0]  # tried once, then copies for the rest of the file
    assert path.read_bytes() == expected
    assert (written.size, written.checksum) == file_checksum(path)


def test_a_filesystem_that_refuses_direct_writes_takes_held_ones_buffered(tmp_path, monkeypatch):
    """Faked, saying so: the flag is taken and every write refused while it is set (some
    network and FUSE filesystems); held writes end up through the page cache, whole."""
    real_pwritev, real_pwrite = os.pwritev, os.pwrite

    def refusing(real):
        def call(fd, data, offset):
            if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
                raise OSError(errno.EINVAL, "Invalid argument")
            return real(fd, data, offset)

        return call

    monkeypatch.setattr(os, "pwritev", refusing(real_pwritev))
    monkeypatch.setattr(os, "pwrite", refusing(real_pwrite))
    expected, kept, actions = _held_file([(300, 64, 6 * MiB, True), (300, 64, 9 * MiB + 3, True)])
    path = tmp_path / "rank.distcp"
    written = write_checksummed(path, _filled_with(actions), options=DIRECT)
    assert path.read_bytes() == expected
    assert (written.size, written.checksum) == file_checksum(path)


def test_a_pause_takes_hold_between_the_gathered_requests_of_held_writes(tmp_path, monkeypatch):
    """The writer queues held writes without waiting, so a pause (quiet()) must hold the
    queued requests back on the file's helper: started during the first request, no other
    is written until it ends, and the file is whole after. Started from inside the first
    request (os.pwritev wrapped): the one moment a real quiet() could not be placed at."""
    if not _direct_capable(tmp_path):
        pytest.skip("the test's filesystem does not do O_DIRECT")
    gate, requests = _pause_at_the_first_request(monkeypatch, "pwritev")
    expected, kept, actions = _held_file(
        [(300, 64, 6 * MiB, True), (300, 64, 7 * MiB, True), (300, 64, 9 * MiB, True)]
    )
    path = tmp_path / "rank.distcp"
    writer, result = _write_paused_in_thread(path, _filled_with(actions), gate)
    assert requests == [0], "queued requests were written during the pause"
    gate.set()
    writer.join(10)
    assert not writer.is_alive() and len(requests) >= 2
    assert path.read_bytes() == expected
    assert (result[0].size, result[0].checksum) == file_checksum(path)


def test_I5_a_device_that_stops_taking_held_writes_is_named_as_hung(tmp_path, monkeypatch):
    """Queued held writes are waited for as a whole, but a device on which none of their
    requests ended for a whole wait is named as hung, within about one wait. The hang is
    faked (os.pwritev held on an event): a real device cannot be made to stop on cue."""
    if not _direct_capable(tmp_path):
        pytest.skip("the test's filesystem does not do O_DIRECT")
    monkeypatch.setattr(device_queue, "_HELPER_WAIT_S", 0.5)
    real_pwritev = os.pwritev
    released = threading.Event()

    def device(fd, buffers, offset):
        if offset > 0:
            released.wait(30)  # stops taking requests after the first
        return real_pwritev(fd, buffers, offset)

    monkeypatch.setattr(os, "pwritev", device)
    expected, kept, actions = _held_file(
        [(300, 64, 9 * MiB, True), (300, 64, 9 * MiB, True), (300, 64, 9 * MiB, True)]
    )
    started = time.monotonic()
    with pytest.raises(OSError, match="hung"):
        write_checksummed(
            tmp_path / "hung.distcp",
            _filled_with(actions),
            options=DIRECT,
        )
    assert time.monotonic() - started < 1.8
    released.set()


def test_a_device_error_in_a_queued_held_write_is_raised_within_a_few_writes(tmp_path, monkeypatch):
    """Held writes are queued, not waited for, but not without bound: an error of the
    device (ENOSPC here) is raised to the writer within a couple of writes after it, not
    only once the whole file has been queued and finished. Faked, saying so: a full disk
    cannot be produced on cue on the test's filesystem."""
    if not _direct_capable(tmp_path):
        pytest.skip("the test's filesystem does not do O_DIRECT")

    def full(fd, buffers, offset):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "pwritev", full)
    expected, kept, actions = _held_file([(300, 64, 9 * MiB, True)] * 12)
    handed = []

    def fill(stream) -> None:
        for data, held in actions:
            (stream.write_held if held else stream.write)(data)
            handed.append(len(data))

    with pytest.raises(OSError, match="rank.distcp") as caught:
        write_checksummed(tmp_path / "rank.distcp", fill, options=DIRECT)
    assert caught.value.errno == errno.ENOSPC
    assert sum(1 for n in handed if n == 9 * MiB) <= 4, "the error waited for the whole file"


def test_a_writer_that_fails_leaves_no_queued_write_running(tmp_path, monkeypatch):
    """The writer fails (a copy that never came, a template mismatch) with held writes
    queued: closing the file cancels those not started, and waits only for the one the
    device is writing, so that a failed save stops writing at once. The device is slowed
    (os.pwritev wrapped with a sleep) so that writes are still queued when it fails."""
    if not _direct_capable(tmp_path):
        pytest.skip("the test's filesystem does not do O_DIRECT")
    real_pwritev = os.pwritev
    requests = []

    def slow(fd, buffers, offset):
        requests.append(offset)
        time.sleep(0.3)
        return real_pwritev(fd, buffers, offset)

    monkeypatch.setattr(os, "pwritev", slow)
    expected, kept, actions = _held_file([(300, 64, 9 * MiB, True)] * 4)

    def fill(stream) -> None:
        _filled_with(actions)(stream)
        raise RuntimeError("the copy of the next tensor never came")

    with pytest.raises(RuntimeError, match="never came"):
        write_checksummed(tmp_path / "rank.distcp", fill, options=DIRECT)
    started = len(requests)
    time.sleep(1.0)
    assert len(requests) == started, "a queued write went on after the file was closed"
    assert started < 4


def test_a_held_write_refused_after_its_file_closed_is_not_copied(tmp_path, monkeypatch):
    """A request in flight when its file is closed (the writer gave up on a hung device, or
    the save failed) may come back refused or short; the caller no longer holds the memory
    then, so the rest is not copied from it (the copy would read it in this process, where
    freed memory ends the trainer; the kernel's own reads of it are pinned and safe). The
    device is faked, saying so: os.pwritev held on an event, then refused (EFAULT)."""
    if not _direct_capable(tmp_path):
        pytest.skip("the test's filesystem does not do O_DIRECT")
    monkeypatch.setattr(device_queue, "_HELPER_WAIT_S", 0.5)
    entered, released = threading.Event(), threading.Event()

    def hung_then_refused(fd, buffers, offset):
        entered.set()
        released.wait(30)
        raise OSError(errno.EFAULT, "Bad address")

    bounces = []
    real_take = direct_io._buffers.take

    def taking():  # a buffer taken for a copy of the caller's bytes
        bounces.append(threading.current_thread().name)
        return real_take()

    monkeypatch.setattr(os, "pwritev", hung_then_refused)
    expected, kept, actions = _held_file([(300, 64, 9 * MiB, True)] * 3)
    fd = os.open(tmp_path / "f", os.O_WRONLY | os.O_CREAT, 0o600)
    direct = open_direct(fd)
    monkeypatch.setattr(direct_io._buffers, "take", taking)  # the file has its two already
    with pytest.raises(OSError, match="hung"):
        for data, held in actions:
            direct.write(data, held=held)
        direct.finish()
    assert entered.is_set()
    queue = direct._queue
    direct.close()  # the writer gives up; the request is still in flight
    released.set()  # ... and comes back refused
    assert queue._pool is not None and not queue._pool.close(5), "the helper's job did not end"
    assert bounces == [], "the caller's bytes were copied after the file closed"
    running = queue.unchecked[0]  # the job in flight when the writer gave up
    assert isinstance(running.exception(), OSError) and running.exception().errno == errno.EBADF
