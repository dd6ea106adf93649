"""Verified transfers of a committed step's files from one store to another (store/base.py):
an upload is a local root to a remote tier, a download (pull.py) the other way.

Each file is read from its source store and hashed as it passes to the destination's
Publisher (multipart on s3, `PART_SIZE` per part; a temporary file renamed into place on a
local disk), which publishes it only when its bytes match the commit record's size and
checksum: a file changed or damaged after its commit is never published as part of the
step, and a mismatch names the file. Files go in parallel on a pool of daemon threads,
under one deadline.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable
from concurrent.futures import wait as wait_for_futures
from dataclasses import dataclass, field

from verl_ckpt.protocol.errors import CheckpointError, CommitTimeoutError
from verl_ckpt.protocol.threads import DaemonPool
from verl_ckpt.store.base import PartPool, Store
from verl_ckpt.store.commit_record import FileEntry, locate_step
from verl_ckpt.store.fsio import new_hasher
from verl_ckpt.store.local import LocalStore
from verl_ckpt.store.open_store import Where

__all__ = [
    "PART_SIZE",
    "ChecksumMismatch",
    "TransferOutcome",
    "copy_file",
    "copy_files",
]

# Multipart part size (S3's minimum is 5 MiB; s3fs's put uses 50 MiB): larger files go in parts,
# smaller ones in one PUT.
PART_SIZE = 50 << 20


class ChecksumMismatch(CheckpointError):
    """The bytes read differ from the commit record: the file is not transferred."""


@dataclass
class TransferOutcome:
    """What a parallel transfer did: the files that went through, and one line per failure."""

    done: list[FileEntry] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    nbytes: int = 0
    seconds: float = 0.0


def copy_file(
    dest: Store,
    source: Store | str | os.PathLike,
    rel: str,
    entry: FileEntry,
    algorithm: str,
    parts: PartPool | None = None,
    source_rel: str | None = None,
) -> None:
    """Copy file `source_rel` (default `rel`) of the store `source`, or the local file
    `source`, to `rel` of `dest`, published only if its bytes match `entry` (else
    ChecksumMismatch naming the source, and nothing is published): exactly `entry.size`
    bytes are read, a source shorter or longer is refused. With `parts`
    (dest.part_pool), the parts of a large file go in parallel on that pool."""
    if isinstance(source, Store):
        source_rel = rel if source_rel is None else source_rel
    else:
        source, source_rel = LocalStore(os.path.dirname(source)), os.path.basename(source)
    try:
        stream = source.open_read(source_rel)
    except FileNotFoundError:
        raise ChecksumMismatch(f"{source.uri(source_rel)}: missing") from None
    with stream:
        target = dest.open_publish(rel, entry.size, PART_SIZE, parts)
        try:
            hasher, size = new_hasher(algorithm), 0
            # Exactly the recorded size, then one byte more to prove the end: an object
            # longer than its record (or endless, as a device would be) is never read on.
            while size < entry.size and (chunk := stream.read(min(PART_SIZE, entry.size - size))):
                hasher.update(chunk)
                size += len(chunk)
                target.write(chunk)
            if size == entry.size and stream.read(1):
                raise ChecksumMismatch(
                    f"{source.uri(source_rel)}: longer than the recorded {entry.size} bytes; "
                    "not copied"
                )
            _check(source.uri(source_rel), entry, size, hasher.hexdigest())
            target.publish()
        except BaseException:
            # Abort (s3: the multipart upload; local: the temporary file): a half-sent file
            # is never published. The record is copied after every file, so nothing looks
            # committed.
            target.discard()
            raise


def copy_files(
    dest: Where,
    source: Where,
    step: int,
    entries: Iterable[FileEntry],
    algorithm: str,
    threads: int,
    timeout_s: float,
    what: str = "upload",
) -> TransferOutcome:
    """Copy `entries` of step `step` from `source` into `dest` in parallel, each verified
    (copy_file). Each side: a store (its step `step`), or a local step directory."""
    dest_store, dest_rel = locate_step(dest, step if isinstance(dest, Store) else None)
    source_store, source_rel = locate_step(source, step if isinstance(source, Store) else None)
    parts = dest_store.part_pool(threads, timeout_s)

    def one(entry: FileEntry) -> None:
        copy_file(
            dest_store,
            source_store,
            f"{dest_rel}/{entry.path}",
            entry,
            algorithm,
            parts,
            source_rel=f"{source_rel}/{entry.path}",
        )

    try:
        return _in_parallel(list(entries), one, threads, timeout_s, f"{what} of step {step}")
    finally:
        if parts is not None:
            parts.close()


# The names of the uploads (ranks, the remote commit): a copy from a local root.


# ---- helpers -------------------------------------------------------------------------------


def _check(where: str, entry: FileEntry, size: int, checksum: str) -> None:
    """ChecksumMismatch naming `where` unless the bytes read match `entry` (the reasons are
    verification.py's)."""
    if size != entry.size:
        raise ChecksumMismatch(f"{where}: size {size}, expected {entry.size}; not copied")
    if checksum != entry.checksum:
        raise ChecksumMismatch(
            f"{where}: checksum {checksum}, expected {entry.checksum}; not copied"
        )


def _in_parallel(
    entries: list[FileEntry],
    one: Callable[[FileEntry], None],
    threads: int,
    timeout_s: float,
    what: str,
) -> TransferOutcome:
    outcome = TransferOutcome()
    if not entries:
        return outcome
    started = time.perf_counter()
    pool = DaemonPool(min(threads, len(entries)), "verl_ckpt_transfer")
    try:
        futures = {pool.submit(one, entry, label=entry.path): entry for entry in entries}
        done, pending = wait_for_futures(futures, timeout=timeout_s)
        for future in done:
            entry = futures[future]
            error = future.exception()
            if error is None:
                outcome.done.append(entry)
                outcome.nbytes += entry.size
            else:
                outcome.errors.append(_one_line(entry, error))
        for future in pending:
            outcome.errors.append(
                str(
                    CommitTimeoutError(f"{futures[future].path}: {what} not done in {timeout_s:g}s")
                )
            )
    finally:
        pool.close(0.0)
    outcome.done.sort(key=lambda e: e.path)
    outcome.errors.sort()
    outcome.seconds = time.perf_counter() - started
    return outcome


def _one_line(entry: FileEntry, error: BaseException) -> str:
    text = " ".join(str(error).split())
    if isinstance(error, ChecksumMismatch):
        return text
    return f"{entry.path}: {type(error).__name__}: {text}"
