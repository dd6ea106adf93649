"""The least a save that snapshots by copying can take on this machine, against the write
floor that never copies: the bound behind issue 44's item 4 (durable within 1.10x of the
strongest write floor) beside its item 3 (blocking within 1.25x of the copy floor).

Two processes (a save's two ranks) each hold 504 MiB of tensors (the benchmark's default
state per rank, in tensors of 1 to 16 MiB). Every round runs, in a rotated order, with a
pause before each so the disk settles:

- the write floor: page-aligned memory written O_DIRECT (8 MiB requests) and fsynced, by
  one thread and by two (each half the bytes); the faster of the two in each round is the
  round's floor, as the save benchmark takes the fastest of its floor's variants;
- `copy floor`: the tensors copied, tensor by tensor, into a touched page-aligned mapping
  (the least a snapshot costs; the save benchmark's copy floor copies alike);
- `copy, then write`: that copy in 32 MiB `torch._foreach_copy_` groups (as
  rank/staging.py copies), then the copy written as the floor writes it: a save with no
  checksum, no serialisation and no commit, which writes once its copy ended;
- `write beside the copy`: the same, with a thread of each process writing every group as
  soon as it is copied (nice 0), so the device starts at the first group;
- `write beside the copy, idle class`: the same thread in SCHED_IDLE, as
  `writer.write_while_copying` runs its writers.

Blocking is the copy's time, durable the time to the end of the fsync (and close), both from
a barrier, the slower process's; the file is deleted after the timing. Each ratio is taken
against the floor of the same round, then the median (range) over the rounds is printed:

    python -m benchmarks.snapshot_bound --dir /path/on/the/checkpoint/disk [--rounds 6]

Linux only, on a filesystem that takes O_DIRECT.
"""

from __future__ import annotations

import argparse
import mmap
import os
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from multiprocessing import Barrier, Queue
from pathlib import Path

import torch

from benchmarks.copy_beside_write import check_direct, private_mapping, pwrite_direct, run_pair

__all__ = ["main"]

_BYTES = 504 << 20
_TENSOR_SIZES = (16 << 20, 4 << 20, 1 << 20, 12 << 20)
_GROUP = 32 << 20
_REQUEST = 8 << 20
# Every wait ends: a process that failed leaves its peer at the barrier.
_RUN_S = 900.0

WRITE_FLOOR = "write floor, O_DIRECT"
WRITE_FLOOR_2 = "write floor, O_DIRECT x2 threads"
COPY_FLOOR = "copy floor"
THEN = "copy, then write"
BESIDE = "write beside the copy"
BESIDE_IDLE = "write beside the copy, idle class"
VARIANTS = (WRITE_FLOOR, WRITE_FLOOR_2, COPY_FLOOR, THEN, BESIDE, BESIDE_IDLE)
# Issue 44's targets for a save: item 3 and item 4.
BLOCKING_TARGET = 1.25
DURABLE_TARGET = 1.10


class _Rank:
    """One process's tensors, staging and floor memory, and the variants run on them."""

    def __init__(self) -> None:
        sizes, left = [], _BYTES
        while left:
            sizes.append(min(left, _TENSOR_SIZES[len(sizes) % len(_TENSOR_SIZES)]))
            left -= sizes[-1]
        self.sources = [torch.randn(n // 4) for n in sizes]
        self.staging_memory = private_mapping(_BYTES)
        staging = torch.frombuffer(self.staging_memory, dtype=torch.float32)
        staging.zero_()  # every page touched before the timings
        self.targets, self.groups = [], []  # groups: (tensor indices, end offset in bytes)
        offset, group = 0, []
        for index, nbytes in enumerate(sizes):
            self.targets.append(staging[offset // 4 : (offset + nbytes) // 4])
            offset += nbytes
            group.append(index)
            if sum(sizes[i] for i in group) >= _GROUP or offset == _BYTES:
                self.groups.append((group, offset))
                group = []
        self.floor_memory = private_mapping(_BYTES)
        torch.frombuffer(self.floor_memory, dtype=torch.uint8).fill_(1)

    def _copy_group(self, indices: list[int]) -> None:
        torch._foreach_copy_([self.targets[i] for i in indices], [self.sources[i] for i in indices])

    def _write(
        self,
        memory: mmap.mmap,
        path: Path,
        copied: list[threading.Event] | None = None,
        threads: int = 1,
    ) -> float:
        """Write `memory` O_DIRECT, by `threads` threads each writing its share, and fsync;
        with `copied` (one thread), each request waits for the group that holds its last
        byte. Returns the clock at the end of the fsync and close."""
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o600)
        try:
            share = -(-_BYTES // threads // _REQUEST) * _REQUEST
            parts = [(first, min(first + share, _BYTES)) for first in range(0, _BYTES, share)]
            if threads == 1:
                self._write_part(memory, fd, *parts[0], copied)
            else:
                with ThreadPoolExecutor(threads) as pool:
                    list(pool.map(lambda part: self._write_part(memory, fd, *part), parts))
            os.fsync(fd)
        finally:
            os.close(fd)
        return time.perf_counter()

    def _write_part(
        self,
        memory: mmap.mmap,
        fd: int,
        offset: int,
        stop: int,
        copied: list[threading.Event] | None = None,
    ) -> None:
        view = memoryview(memory)
        try:
            group = 0
            while offset < stop:
                end = min(offset + _REQUEST, stop)
                if copied is not None:
                    while self.groups[group][1] < end:
                        group += 1
                    if not copied[group].wait(_RUN_S):
                        raise TimeoutError(f"group {group} of the copy never came")
                pwrite_direct(fd, view, offset, end)
                offset = end
        finally:
            view.release()

    def _beside(self, path: Path, idle: bool) -> tuple[float, float]:
        """(blocking, the clock at the write's end) of a write beside the copy."""
        copied = [threading.Event() for _ in self.groups]
        ended: list[float] = []
        failed: list[BaseException] = []

        def write() -> None:
            try:
                if idle:
                    os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))  # this thread
                ended.append(self._write(self.staging_memory, path, copied))
            except BaseException as exc:  # re-raised on the process's own thread below
                failed.append(exc)

        # A daemon: a copy that raises leaves it waiting, and must not keep the process.
        writer = threading.Thread(target=write, daemon=True)
        began = time.perf_counter()
        writer.start()
        for event, (indices, _) in zip(copied, self.groups, strict=True):
            self._copy_group(indices)
            event.set()
        blocking = time.perf_counter() - began
        writer.join(_RUN_S)
        if failed or not ended:
            raise RuntimeError(f"the write beside the copy failed: {failed or 'still running'}")
        return blocking, ended[0]

    def run(self, variant: str, path: Path) -> tuple[float | None, float]:
        """(blocking, durable) of one variant, in seconds; blocking is None for a write
        floor, durable the copy's time for the copy floor."""
        began = time.perf_counter()
        blocking = None
        if variant in (WRITE_FLOOR, WRITE_FLOOR_2):
            ended = self._write(self.floor_memory, path, threads=1 if variant == WRITE_FLOOR else 2)
        elif variant == COPY_FLOOR:
            for target, source in zip(self.targets, self.sources, strict=True):
                target.copy_(source)
            ended = time.perf_counter()
            blocking = ended - began
        elif variant == THEN:
            for indices, _ in self.groups:
                self._copy_group(indices)
            blocking = time.perf_counter() - began
            ended = self._write(self.staging_memory, path)
        else:
            blocking, ended = self._beside(path, idle=variant == BESIDE_IDLE)
        path.unlink(missing_ok=True)  # after the timing
        return blocking, ended - began


def _process(
    rank: int, directory: Path, rounds: int, settle_s: float, start: Barrier, out: Queue
) -> None:
    torch.set_num_threads(1)
    try:
        state = _Rank()
        figures = []
        for round_ in range(rounds):
            shift = round_ % len(VARIANTS)
            for variant in VARIANTS[shift:] + VARIANTS[:shift]:
                time.sleep(settle_s)
                start.wait()
                path = directory / f"bound_{rank}.bin"
                figures.append((round_, variant, *state.run(variant, path)))
    except BaseException:
        start.abort()  # the peer's wait at the barrier ends at once
        raise
    out.put(figures)


def _run(directory: Path, rounds: int, settle_s: float) -> dict[tuple[int, str], tuple]:
    """{(round, variant): (blocking, durable)}, the slower process's of each."""
    both = run_pair(_process, (directory, rounds, settle_s), _RUN_S, "a process")
    slowest = {}
    for (round_, variant, b0, d0), (_, _, b1, d1) in zip(*both, strict=True):
        blocking = None if b0 is None else max(b0, b1)
        slowest[(round_, variant)] = (blocking, max(d0, d1))
    return slowest


def _spread(values: list[float]) -> str:
    return f"{statistics.median(values):.2f}x ({min(values):.2f}-{max(values):.2f})"


def report(figures: dict[tuple[int, str], tuple], rounds: int) -> list[str]:
    """The table's lines and the verdict, from `_run`'s figures."""
    floor = {
        r: min(figures[(r, WRITE_FLOOR)][1], figures[(r, WRITE_FLOOR_2)][1]) for r in range(rounds)
    }
    copy = {r: figures[(r, COPY_FLOOR)][0] for r in range(rounds)}
    lines = [
        f"write floor {statistics.median(floor.values()):.3f} s, "
        f"copy floor {statistics.median(copy.values()):.3f} s (medians of {rounds} rounds)",
        "",
        "| variant | blocking / copy floor | durable / write floor |",
        "|---|---|---|",
    ]
    both_met = []
    for variant in (THEN, BESIDE, BESIDE_IDLE):
        blocking = [figures[(r, variant)][0] / copy[r] for r in range(rounds)]
        durable = [figures[(r, variant)][1] / floor[r] for r in range(rounds)]
        lines.append(f"| {variant} | {_spread(blocking)} | {_spread(durable)} |")
        if (
            statistics.median(blocking) <= BLOCKING_TARGET
            and statistics.median(durable) <= DURABLE_TARGET
        ):
            both_met.append(variant)
    lines += [
        "",
        f"blocking <= {BLOCKING_TARGET}x the copy floor and durable <= {DURABLE_TARGET}x the "
        "write floor, both (medians): "
        + (f"reached by {', '.join(both_met)}" if both_met else "reached by no variant"),
    ]
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, required=True, help="a directory on the disk to use")
    parser.add_argument("--rounds", type=int, default=6, help="rounds of every variant")
    parser.add_argument("--settle-s", type=float, default=2.0, help="pause before each variant")
    args = parser.parse_args()
    check_direct(args.dir)
    for line in report(_run(args.dir, args.rounds, args.settle_s), args.rounds):
        print(line)


if __name__ == "__main__":
    main()
