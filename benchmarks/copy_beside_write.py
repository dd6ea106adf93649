"""What a device write costs a copy running beside it: why writing during save()'s copy
slows the copy on a small host (benchmarks/results_issue44.md, "the trade-off of writing
during the copy").

Two processes (a save's two ranks) each copy 512 MiB into a page-aligned private mapping
with `torch._foreach_copy_` in 32 MiB groups, as rank/staging.py copies a snapshot, six
times. In the "beside a write" rounds, a thread of each process writes another 512 MiB of
its own memory O_DIRECT to a file in `--dir` (8 MiB requests, as store/direct_io.py
makes them) while the copy runs. The copies' times are printed per round, in ms:

    python -m benchmarks.copy_beside_write --dir /path/on/the/checkpoint/disk

Rounds alternate alone / beside a write, twice. Linux only, on a filesystem that takes
O_DIRECT (checked first: tmpfs does not); the files are deleted after each copy. What the
write costs the copy is its thread's CPU (the system calls, pinning the pages) and the
device's reads of memory together.
"""

from __future__ import annotations

import argparse
import mmap
import os
import statistics
import threading
import time
from collections.abc import Callable
from multiprocessing import Barrier, Process, Queue
from pathlib import Path
from queue import Empty

import torch

__all__ = ["check_direct", "main", "private_mapping", "pwrite_direct", "run_pair"]

_BYTES = 512 << 20
_GROUP = 32 << 20
_REQUEST = 8 << 20
_COPIES = 6
# Every wait of a round ends: a process that failed leaves its peer at the barrier.
_ROUND_S = 300.0


def private_mapping(nbytes: int) -> mmap.mmap:
    """Page-aligned anonymous private memory, as rank/staging.py maps a large staging buffer."""
    return mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)


def pwrite_direct(fd: int, view: memoryview, offset: int, end: int) -> None:
    """One O_DIRECT request: `view[offset:end]` at file offset `offset`, whole."""
    done = os.pwrite(fd, view[offset:end], offset)
    if done != end - offset:  # the next O_DIRECT write would be misaligned
        raise OSError(f"short direct write: {done} of {end - offset} bytes")


def _rank(rank: int, beside_write: bool, directory: Path, start: Barrier, out: Queue) -> None:
    torch.set_num_threads(1)
    source = torch.randn(_BYTES // 4)
    target_memory = private_mapping(_BYTES)
    target = torch.frombuffer(target_memory, dtype=torch.float32)
    target.copy_(source)  # every page touched before the timings
    written_memory = private_mapping(_BYTES)
    torch.frombuffer(written_memory, dtype=torch.uint8).fill_(1)  # touched, not zero pages
    group = _GROUP // 4
    times = []
    for _ in range(_COPIES):
        path = directory / f"copy_beside_write_{rank}.bin"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o600)
        stop = threading.Event()

        def write(fd: int = fd, stop: threading.Event = stop) -> None:
            view = memoryview(written_memory)
            offset = 0
            while not stop.is_set() and offset < _BYTES:
                pwrite_direct(fd, view, offset, offset + _REQUEST)
                offset += _REQUEST
            view.release()

        writer = threading.Thread(target=write) if beside_write else None
        start.wait()
        if writer is not None:
            writer.start()
        began = time.perf_counter()
        for first in range(0, _BYTES // 4, group):
            torch._foreach_copy_([target[first : first + group]], [source[first : first + group]])
        times.append(time.perf_counter() - began)
        stop.set()
        if writer is not None:
            writer.join()
        os.close(fd)
        path.unlink()
    out.put(times)


def run_pair(target: Callable[..., None], args: tuple, timeout_s: float, what: str) -> list:
    """Run `target(rank, *args, start, out)` in two processes (ranks 0 and 1) that meet at the
    barrier `start`; return what each put on the queue `out`, in the order they finished."""
    start, out = Barrier(2, timeout=timeout_s), Queue()
    ranks = [Process(target=target, args=(r, *args, start, out)) for r in (0, 1)]
    for process in ranks:
        process.start()
    results: list = []
    deadline = time.monotonic() + timeout_s
    try:
        while len(results) < 2:
            try:
                results.append(out.get(timeout=1.0))
                continue
            except Empty:
                pass
            # A rank that raised exits without a result: say so now, not at the deadline.
            failed = [(r, p.exitcode) for r, p in enumerate(ranks) if p.exitcode not in (None, 0)]
            if failed:
                raise SystemExit(f"{what} failed: (rank, exit code) {failed}; its error is above")
            if time.monotonic() > deadline:
                raise SystemExit(f"{what} did not finish within {timeout_s:.0f}s")
        return results
    finally:
        for process in ranks:
            process.join(timeout=5.0 if len(results) < 2 else timeout_s)
            if process.is_alive():
                process.kill()
                process.join()


def _round(beside_write: bool, directory: Path) -> list[float]:
    first, second = run_pair(_rank, (beside_write, directory), _ROUND_S, "a copy process")
    return first + second


def check_direct(directory: Path) -> None:
    """Exit with one line unless files in `directory` can be opened O_DIRECT."""
    probe = directory / "o_direct_probe.bin"
    try:
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o600))
    except (AttributeError, OSError) as exc:
        raise SystemExit(f"{directory}: no O_DIRECT files here ({exc})") from None
    probe.unlink()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, required=True, help="a directory on the disk to use")
    args = parser.parse_args()
    check_direct(args.dir)
    for beside_write in (False, True, False, True):
        times = _round(beside_write, args.dir)
        label = "beside a write" if beside_write else "alone"
        figures = " ".join(f"{t * 1e3:.1f}" for t in times)
        median = statistics.median(times) * 1e3
        print(f"{label:15s} median {median:.1f} ms; each copy (both processes): {figures}")


if __name__ == "__main__":
    main()
