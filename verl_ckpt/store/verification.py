"""Checking a committed step's files against its commit record, on every core.

Two depths: `checksums=False` only stats each file (present, with its recorded size: catches
a missing or truncated shard at no read cost); `checksums=True` re-reads and re-hashes every
byte (catches bit flips too). Used by start-up (`checkpoint.resume_verify`, resume_check.py)
and by `verl-ckpt verify`.

Files are hashed in parallel threads: file reads and xxh3_64 (and zlib's crc32) release the
GIL, so one thread per core keeps every core busy. One streaming checksum cannot be split
over threads, so a step is as parallel as its number of files (megatron-core writes
`writer.threads` files per rank); the largest files start first so that one big file does
not end up alone at the end.
"""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path

from verl_ckpt.store.commit_record import CommitRecord, FileEntry
from verl_ckpt.store.fsio import new_hasher

__all__ = ["FileProblem", "StepVerification", "available_cores", "verify_files", "verify_step"]

_READ_CHUNK = 8 << 20


@dataclass(frozen=True)
class FileProblem:
    """One file of a step that does not match its commit record."""

    path: Path
    # "missing", "size 10, expected 20", "checksum ab12, expected cd34", "unreadable: ..."
    reason: str

    def describe(self) -> str:
        return f"{self.path}: {self.reason}"


@dataclass
class StepVerification:
    """What `verify_step` found, and how fast it read."""

    step_path: Path
    files: int
    # Bytes read and hashed (0 when only sizes were checked).
    bytes_read: int
    seconds: float
    threads: int
    problems: list[FileProblem] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    @property
    def gb_per_s(self) -> float:
        return self.bytes_read / 1e9 / self.seconds if self.seconds > 0 else 0.0

    def summary(self) -> str:
        """The first problem, and how many more: one line for an error or a warning."""
        if not self.problems:
            return f"{self.step_path}: {self.files} files verified"
        more = len(self.problems) - 1
        return self.problems[0].describe() + (f" (and {more} more problem(s))" if more else "")


def available_cores() -> int:
    """The cores this process may run on (its affinity mask, not the machine's count)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def verify_step(
    step_path: str | os.PathLike,
    record: CommitRecord,
    checksums: bool = True,
    threads: int | None = None,
) -> StepVerification:
    """Check every file of `record` under `step_path`; with `checksums`, re-hash them all
    with `threads` threads (default: one per available core). Never raises for a bad file:
    each one is a FileProblem, sorted by path."""
    step_path = Path(step_path)
    entries = sorted(record.files, key=lambda e: e.size, reverse=True)
    started = time.perf_counter()
    if not checksums:
        problems = [p for p in (_check_size(step_path, e) for e in entries) if p is not None]
        return StepVerification(
            step_path, len(entries), 0, time.perf_counter() - started, 1, _sorted(problems)
        )
    workers = max(1, min(threads or available_cores(), len(entries) or 1))
    buffers = threading.local()

    def check(entry: FileEntry) -> tuple[int, FileProblem | None]:
        if not hasattr(buffers, "chunk"):
            buffers.chunk = bytearray(_READ_CHUNK)
        return _check_checksum(step_path, entry, record.checksum_algorithm, buffers.chunk)

    with ThreadPoolExecutor(workers, thread_name_prefix="verl_ckpt_verify") as pool:
        results = list(pool.map(check, entries))
    problems = [problem for _, problem in results if problem is not None]
    read = sum(size for size, _ in results)
    return StepVerification(
        step_path, len(entries), read, time.perf_counter() - started, workers, _sorted(problems)
    )


def verify_files(step_path: str | os.PathLike, record: CommitRecord, prefix: str = "") -> list[str]:
    """Re-hash (in parallel) the files of `record` whose path starts with `prefix`; one line
    per problem found, naming the file."""
    subset = replace(record, files=[f for f in record.files if f.path.startswith(prefix)])
    return [problem.describe() for problem in verify_step(step_path, subset).problems]


# ---- helpers -------------------------------------------------------------------------------


def _sorted(problems: list[FileProblem]) -> list[FileProblem]:
    return sorted(problems, key=lambda p: str(p.path))


def _check_size(step_path: Path, entry: FileEntry) -> FileProblem | None:
    path = step_path / entry.path
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        return FileProblem(path, "missing")
    except OSError as exc:
        return FileProblem(path, f"unreadable: {exc.strerror or exc}")
    if size != entry.size:
        return FileProblem(path, f"size {size}, expected {entry.size}")
    return None


def _check_checksum(
    step_path: Path, entry: FileEntry, algorithm: str, chunk: bytearray
) -> tuple[int, FileProblem | None]:
    """(bytes read, problem) for one file, read through the thread's reused buffer."""
    path = step_path / entry.path
    hasher = new_hasher(algorithm)
    size = 0
    view = memoryview(chunk)
    try:
        with open(path, "rb", buffering=0) as f:
            while n := f.readinto(view):
                hasher.update(view[:n])
                size += n
    except FileNotFoundError:
        return 0, FileProblem(path, "missing")
    except OSError as exc:
        return size, FileProblem(path, f"unreadable: {exc.strerror or exc}")
    if size != entry.size:
        return size, FileProblem(path, f"size {size}, expected {entry.size}")
    checksum = hasher.hexdigest()
    if checksum != entry.checksum:
        return size, FileProblem(path, f"checksum {checksum}, expected {entry.checksum}")
    return size, None
