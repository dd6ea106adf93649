"""How a rank's files reach the device around the page cache (store/direct_io.py), against
the raw O_DIRECT floor, side by side in one run.

Two processes (two ranks) each hold 504 MiB in page-aligned memory (as staging buffers are)
and write it at the same time into two files (writer.threads=2) with fsync, in three ways,
rotated round by round:
- `O_DIRECT floor`: os.pwrite of 8 MiB requests straight from the memory, one thread per file;
  no header, no checksum. The least these bytes can cost.
- `verl_ckpt`: `checksummed_file.write_checksummed` as the rank's writer calls it (a header, then
  the tensor's bytes in one write): the file's helper writes 8 MiB requests back to back while
  the writer thread hashes the slice (xxh3) beside them.
- `verl_ckpt, a hand-off per 8 MiB`: the same with the stream's `beside` turned off, which is
  how it wrote before: one hand-off to the helper per 8 MiB, and the hash after each.

    python -m benchmarks.direct_writes --dir /work --rounds 30

Each round: os.sync(), both ranks start together (a barrier), the slowest rank's time counts,
and the files are unlinked afterwards (outside the timing: rewriting files in place costs the
filesystem extra work that a save into a new step directory never pays).
"""

from __future__ import annotations

import argparse
import mmap
import os
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from multiprocessing import Barrier, Process, Queue
from pathlib import Path

FLOOR = "O_DIRECT floor"
BESIDE = "verl_ckpt"
HAND_OFF = "verl_ckpt, a hand-off per 8 MiB"
VARIANTS = (FLOOR, BESIDE, HAND_OFF)
RANK_BYTES = 504 << 20
FILES = 2
_REQUEST = 8 << 20


def _floor_file(path: Path, view: memoryview) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o600)
    try:
        for start in range(0, len(view), _REQUEST):
            os.pwrite(fd, view[start : start + _REQUEST], start)
        os.fsync(fd)
    finally:
        os.close(fd)


def _rank(index: int, directory: Path, rounds: int, barrier: Barrier, out: Queue) -> None:
    from verl_ckpt.store import direct_io
    from verl_ckpt.store.checksummed_file import write_checksummed
    from verl_ckpt.store.fsio import WriteOptions

    memory = mmap.mmap(-1, RANK_BYTES)
    memory.write(os.urandom(1 << 20) * (RANK_BYTES >> 20))
    view = memoryview(memory)
    part = RANK_BYTES // FILES
    header = b"h" * direct_io.BLOCK_BYTES  # keeps the tensor's bytes on a page of the file
    paths = [directory / f"rank{index}_{k}" for k in range(FILES)]

    def verl_file(k: int) -> None:
        piece = view[k * part : (k + 1) * part]
        write_checksummed(
            paths[k],
            lambda stream: (stream.write(header), stream.write(piece)),
            options=WriteOptions(direct_io=True),
        )

    with ThreadPoolExecutor(FILES) as pool:
        for round_ in range(rounds):
            variant = VARIANTS[round_ % len(VARIANTS)]
            direct_io.DirectFile.writes_beside = variant != HAND_OFF
            barrier.wait()
            if index == 0:
                os.sync()
            barrier.wait()
            started = time.perf_counter()
            if variant == FLOOR:
                list(
                    pool.map(
                        lambda k: _floor_file(paths[k], view[k * part : (k + 1) * part]),
                        range(FILES),
                    )
                )
            else:
                list(pool.map(verl_file, range(FILES)))
            out.put((round_, variant, time.perf_counter() - started))
            for path in paths:
                path.unlink()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", default=None, help="where the files go (default: a temporary one)")
    parser.add_argument("--rounds", type=int, default=30, help="rounds in all (three per pairing)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="verl_ckpt_direct_") as scratch:
        barrier, out = Barrier(2), Queue()
        ranks = [
            Process(target=_rank, args=(i, Path(scratch), args.rounds, barrier, out))
            for i in range(2)
        ]
        for rank in ranks:
            rank.start()
        slowest: dict[int, tuple[str, float]] = {}
        for _ in range(2 * args.rounds):
            round_, variant, seconds = out.get(timeout=600)
            slowest[round_] = (variant, max(seconds, slowest.get(round_, ("", 0.0))[1]))
        for rank in ranks:
            rank.join(60)
    # Paired: each variant against the floor of its own triple of rounds, seconds apart.
    by_triple: dict[int, dict[str, float]] = {}
    for round_, (variant, seconds) in slowest.items():
        by_triple.setdefault(round_ // len(VARIANTS), {})[variant] = seconds
    triples = [t for t in by_triple.values() if len(t) == len(VARIANTS)]
    print(
        f"| both ranks, {FILES} files of {RANK_BYTES // FILES >> 20} MiB each | median s | "
        "vs the floor (median of paired ratios) | pairings |"
    )
    print("|---|---|---|---|")
    for variant in VARIANTS:
        median = statistics.median(t[variant] for t in triples)
        ratio = statistics.median(t[variant] / t[FLOOR] for t in triples)
        print(f"| {variant} | {median:.3f} | {ratio:.3f}x | {len(triples)} |")


if __name__ == "__main__":
    main()
