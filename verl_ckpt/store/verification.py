"""Checking a committed step's files against its commit record, on every core.

Two depths: `checksums=False` only stats each file (present, with its recorded size: catches
a missing or truncated shard at no read cost); `checksums=True` re-reads and re-hashes every
byte (catches bit flips too). Used by start-up (`checkpoint.resume_verify`, resume_check.py)
and by `verl-ckpt verify`, on any store (store/base.py): a local step directory or a step of
a remote tier.

Files are hashed in parallel threads: file reads and xxh3_64 (and zlib's crc32) release the
GIL, so one thread per core keeps every core busy. One streaming checksum cannot be split
over threads, so a step is as parallel as its number of files (megatron-core writes
`writer.threads` files per rank); the largest files start first so that one big file does
not end up alone at the end.
"""

from __future__ import annotations

import os
import stat
import threading
import time
from collections.abc import Iterable
from concurrent.futures import wait as wait_for_futures
from dataclasses import dataclass, field, replace
from pathlib import Path

from verl_ckpt.protocol.threads import DaemonPool
from verl_ckpt.store.base import Store
from verl_ckpt.store.commit_record import CommitRecord, FileEntry, locate_step
from verl_ckpt.store.fsio import new_hasher
from verl_ckpt.store.local import LocalStore
from verl_ckpt.store.open_store import Where

__all__ = [
    "FileProblem",
    "StepVerification",
    "available_cores",
    "check_step_files",
    "verify_files",
    "verify_step",
]

_READ_CHUNK = 8 << 20


@dataclass(frozen=True)
class FileProblem:
    """One file of a step that does not match its commit record."""

    path: Path | str  # a local path, or a URL
    # "missing", "size 10, expected 20", "checksum ab12, expected cd34", "unreadable: ..."
    reason: str

    def describe(self) -> str:
        return f"{self.path}: {self.reason}"


@dataclass
class StepVerification:
    """What `verify_step` found, and how fast it read."""

    step_path: Path | str  # a local path, or a URL
    files: int
    # Bytes read and hashed (0 when only sizes were checked).
    bytes_read: int
    seconds: float
    threads: int
    problems: list[FileProblem] = field(default_factory=list)
    # The entries that passed, by path.
    done: list[FileEntry] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    @property
    def errors(self) -> list[str]:
        """One line per problem (the shape of a transfer's outcome)."""
        return [problem.describe() for problem in self.problems]

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
    where: Where,
    record: CommitRecord,
    checksums: bool = True,
    threads: int | None = None,
    step: int | None = None,
) -> StepVerification:
    """Check every file of `record` under the step (a local step directory, or a store and
    `step`): check_step_files on the record's files."""
    return check_step_files(
        where, step, record.files, record.checksum_algorithm, threads, None, checksums
    )


def check_step_files(
    where: Where,
    step: int | None,
    entries: Iterable[FileEntry],
    algorithm: str,
    threads: int | None = None,
    timeout_s: float | None = None,
    checksums: bool = True,
) -> StepVerification:
    """Check `entries` under the step (a local step directory with `step` None, or a store
    and `step`); with `checksums`, re-hash them all with `threads` threads (default: one per
    available core), ending at `timeout_s` (a file not checked by then is a problem). Never
    raises for a bad file: each one is a FileProblem, sorted by path."""
    store, rel = locate_step(where, step)
    step_path = _name(store, rel)
    entries = sorted(entries, key=lambda e: e.size, reverse=True)
    started = time.perf_counter()
    if not checksums:
        problems = _check_sizes(store, rel, entries)
        return _outcome(step_path, entries, 0, started, 1, problems)
    workers = max(1, min(threads or available_cores(), len(entries) or 1))
    buffers = threading.local()

    def check(entry: FileEntry) -> tuple[int, FileProblem | None]:
        if not hasattr(buffers, "chunk"):
            buffers.chunk = bytearray(_READ_CHUNK)
        return _check_checksum(store, rel, entry, algorithm, buffers.chunk)

    # Daemon threads: a read hung on a store past `timeout_s` is left behind, never waited.
    pool = DaemonPool(workers, "verl_ckpt_verify")
    try:
        futures = {pool.submit(check, entry, label=entry.path): entry for entry in entries}
        done, _ = wait_for_futures(futures, timeout=timeout_s)
    finally:
        pool.close(0.0)
    read, problems = 0, []
    for future, entry in futures.items():
        path = _name(store, f"{rel}/{entry.path}")
        if future not in done:
            problems.append(FileProblem(path, f"not checked within {timeout_s:g}s"))
            continue
        error = future.exception()
        if error is not None:  # a store's own error (an endpoint, credentials)
            problems.append(FileProblem(path, f"unreadable: {type(error).__name__}: {error}"))
            continue
        size, problem = future.result()
        read += size
        if problem is not None:
            problems.append(problem)
    return _outcome(step_path, entries, read, started, workers, problems)


def _outcome(
    step_path: Path | str,
    entries: list[FileEntry],
    read: int,
    started: float,
    workers: int,
    problems: list[FileProblem],
) -> StepVerification:
    bad = {str(p.path) for p in problems}
    passed = sorted(
        (e for e in entries if str(_join(step_path, e.path)) not in bad), key=lambda e: e.path
    )
    seconds = time.perf_counter() - started
    return StepVerification(
        step_path, len(entries), read, seconds, workers, _sorted(problems), passed
    )


def _join(step_path: Path | str, rel: str) -> Path | str:
    return step_path / rel if isinstance(step_path, Path) else f"{step_path}/{rel}"


def verify_files(where: Where, record: CommitRecord, prefix: str = "") -> list[str]:
    """Re-hash (in parallel) the files of `record` whose path starts with `prefix`; one line
    per problem found, naming the file."""
    subset = replace(record, files=[f for f in record.files if f.path.startswith(prefix)])
    return [problem.describe() for problem in verify_step(where, subset).problems]


# ---- helpers -------------------------------------------------------------------------------


def _sorted(problems: list[FileProblem]) -> list[FileProblem]:
    return sorted(problems, key=lambda p: str(p.path))


def _name(store: Store, rel: str) -> Path | str:
    """How a problem names a file: its local path, or its URL."""
    return store.path(rel) if isinstance(store, LocalStore) else store.uri(rel)


def _check_sizes(store: Store, rel: str, entries: list[FileEntry]) -> list[FileProblem]:
    if isinstance(store, LocalStore):
        sizes: dict[str, int | str] = {}
        for entry in entries:  # one stat per file: cheaper than a walk of the whole step
            try:
                # lstat: a link in a step is not its file (it could name anything).
                info = os.lstat(store.path(f"{rel}/{entry.path}"))
                regular = stat.S_ISREG(info.st_mode)
                sizes[entry.path] = info.st_size if regular else "not a regular file"
            except FileNotFoundError:
                pass
            except OSError as exc:
                sizes[entry.path] = f"unreadable: {exc.strerror or exc}"
    else:
        sizes = dict(store.list_files(rel))
    problems = []
    for entry in entries:
        size = sizes.get(entry.path)
        path = _name(store, f"{rel}/{entry.path}")
        if size is None:
            problems.append(FileProblem(path, "missing"))
        elif isinstance(size, str):
            problems.append(FileProblem(path, size))
        elif size != entry.size:
            problems.append(FileProblem(path, f"size {size}, expected {entry.size}"))
    return problems


def _check_checksum(
    store: Store, rel: str, entry: FileEntry, algorithm: str, chunk: bytearray
) -> tuple[int, FileProblem | None]:
    """(bytes read, problem) for one file, read through the thread's reused buffer. A local
    file is read only if it is a regular file (LocalStore.open_read): a FIFO or /dev/zero
    named by a record is a problem, never a hang."""
    path = _name(store, f"{rel}/{entry.path}")
    hasher = new_hasher(algorithm)
    size = 0
    view = memoryview(chunk)
    try:
        with store.open_read(f"{rel}/{entry.path}") as f:
            while n := f.readinto(view):
                hasher.update(view[:n])
                size += n
                if size > entry.size:
                    break  # longer than recorded: a problem already, not worth reading on
    except FileNotFoundError:
        return 0, FileProblem(path, "missing")
    except OSError as exc:
        return size, FileProblem(path, f"unreadable: {exc.strerror or exc}")
    if size > entry.size:
        return size, FileProblem(path, f"size over {entry.size}, expected {entry.size}")
    if size != entry.size:
        return size, FileProblem(path, f"size {size}, expected {entry.size}")
    checksum = hasher.hexdigest()
    if checksum != entry.checksum:
        return size, FileProblem(path, f"checksum {checksum}, expected {entry.checksum}")
    return size, None
