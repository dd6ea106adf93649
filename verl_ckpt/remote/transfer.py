"""Verified transfers of a committed step's files between a local root and the remote tier.

An upload hashes the bytes as it sends them (multipart, `PART_SIZE` per part) and completes
the object only when they match the commit record's size and checksum: a file changed or
damaged on disk after its commit is never published as part of the step. A download hashes
the bytes as they arrive and fails naming the object that differs. Files go in parallel on
a pool of daemon threads, under one deadline.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from concurrent.futures import wait as wait_for_futures
from dataclasses import dataclass, field
from pathlib import Path

from verl_ckpt.protocol.deadlines import deadline_in, time_left
from verl_ckpt.protocol.errors import CheckpointError, CommitTimeoutError
from verl_ckpt.protocol.threads import DaemonPool
from verl_ckpt.store.commit_record import FileEntry
from verl_ckpt.store.fsio import new_hasher
from verl_ckpt.store.fsspec_store import RemoteStore

__all__ = [
    "PART_SIZE",
    "TransferOutcome",
    "download_files",
    "upload_file",
    "upload_files",
    "verify_remote_files",
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


def upload_file(
    store: RemoteStore,
    local: Path,
    rel: str,
    entry: FileEntry,
    algorithm: str,
    parts: _PartPool | None = None,
) -> None:
    """Upload `local` as object `rel`, published only if its bytes match `entry`. With
    `parts` (s3 stores), the parts of a large file go up in parallel on that pool."""
    if store.is_local:
        _copy_local(local, Path(store.key(rel)), entry, algorithm)
        return
    if entry.size <= PART_SIZE:
        # One PUT: a multipart upload would cost three requests for one part.
        chunks: list[bytes] = []
        _send(local, chunks.append, entry, algorithm)
        store.fs.pipe_file(store.key(rel), b"".join(chunks))
        return
    if parts is not None:
        parts.upload(local, rel, entry, algorithm)
        return
    target = store.fs.open(store.key(rel), "wb", block_size=PART_SIZE)
    try:
        _send(local, target.write, entry, algorithm)
    except BaseException:
        # Abort the multipart upload (or drop the buffer): a half-sent object is never
        # completed. The record is uploaded after every file, so nothing looks committed.
        _discard(target)
        raise
    target.close()


def upload_files(
    store: RemoteStore,
    step_path: Path,
    step: int,
    entries: Iterable[FileEntry],
    algorithm: str,
    threads: int,
    timeout_s: float,
) -> TransferOutcome:
    """Upload `entries` of the local step directory `step_path` in parallel."""
    prefix = step_path.name
    parts = _PartPool(store, threads, timeout_s) if hasattr(store.fs, "call_s3") else None

    def one(entry: FileEntry) -> None:
        rel = f"{prefix}/{entry.path}"
        upload_file(store, step_path / entry.path, rel, entry, algorithm, parts)

    try:
        return _in_parallel(list(entries), one, threads, timeout_s, f"upload of step {step}")
    finally:
        if parts is not None:
            parts.close()


def download_files(
    store: RemoteStore,
    step: int,
    entries: Iterable[FileEntry],
    algorithm: str,
    dest: Path,
    threads: int,
    timeout_s: float,
) -> TransferOutcome:
    """Download `entries` of remote step `step` into `dest`, verified and fsynced."""
    prefix = f"global_step_{step}"

    def one(entry: FileEntry) -> None:
        path = dest / entry.path
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "wb") as out:
            _read_verified(store, f"{prefix}/{entry.path}", entry, algorithm, out.write)
            out.flush()
            os.fsync(out.fileno())

    return _in_parallel(list(entries), one, threads, timeout_s, f"download of step {step}")


def verify_remote_files(
    store: RemoteStore,
    step: int,
    entries: Iterable[FileEntry],
    algorithm: str,
    threads: int,
    timeout_s: float,
) -> TransferOutcome:
    """Re-read every object of remote step `step` and compare with its commit record."""
    prefix = f"global_step_{step}"

    def one(entry: FileEntry) -> None:
        _read_verified(store, f"{prefix}/{entry.path}", entry, algorithm, lambda _: None)

    return _in_parallel(list(entries), one, threads, timeout_s, f"verification of step {step}")


# ---- helpers -------------------------------------------------------------------------------


class _PartPool:
    """Parallel multipart uploads to S3 (s3fs): each file is read and hashed in order by its
    own thread, its parts sent by this pool, at most `threads` parts in flight (and so in
    memory) across every file of the transfer; the upload is completed only when the bytes
    read match the record, else aborted (an incomplete multipart upload is no object)."""

    def __init__(self, store: RemoteStore, threads: int, timeout_s: float) -> None:
        self._fs = store.fs
        self._store = store
        self._pool = DaemonPool(threads, "verl_ckpt_parts")
        self._room = threading.BoundedSemaphore(threads)
        self._deadline = deadline_in(timeout_s)

    def upload(self, local: Path, rel: str, entry: FileEntry, algorithm: str) -> None:
        bucket, key, _ = self._fs.split_path(self._store.key(rel))
        upload_id = self._fs.call_s3("create_multipart_upload", Bucket=bucket, Key=key)["UploadId"]
        futures: list[Future] = []
        try:
            hasher, size = new_hasher(algorithm), 0
            with open(local, "rb") as source:
                while chunk := source.read(PART_SIZE):
                    hasher.update(chunk)
                    size += len(chunk)
                    if not self._room.acquire(timeout=self._remaining()):
                        raise CommitTimeoutError(f"{local}: no part of it sent in time")
                    number = len(futures) + 1
                    futures.append(
                        self._pool.submit(self._part, bucket, key, upload_id, number, chunk)
                    )
            checksum = hasher.hexdigest()
            if (size, checksum) != (entry.size, entry.checksum):
                raise ChecksumMismatch(
                    f"{local}: read {size} bytes with checksum {checksum}, but its commit "
                    f"record says {entry.size} bytes, {entry.checksum}; not uploaded"
                )
            done, pending = wait_for_futures(futures, timeout=self._remaining())
            if pending:
                raise CommitTimeoutError(f"{local}: {len(pending)} parts not sent in time")
            etags = [{"PartNumber": i + 1, "ETag": f.result()} for i, f in enumerate(futures)]
            self._fs.call_s3(
                "complete_multipart_upload",
                Bucket=bucket,
                Key=key,
                UploadId=upload_id,
                MultipartUpload={"Parts": etags},
            )
        except BaseException:
            for future in futures:
                if future.cancel():  # never ran: its slot is given back here
                    self._room.release()
            try:
                self._fs.call_s3(
                    "abort_multipart_upload", Bucket=bucket, Key=key, UploadId=upload_id
                )
            except Exception:  # noqa: BLE001 - best effort: the store may be what failed
                pass
            raise

    def close(self) -> None:
        self._pool.close(0.0)

    def _part(self, bucket: str, key: str, upload_id: str, number: int, data: bytes) -> str:
        try:
            answer = self._fs.call_s3(
                "upload_part",
                Bucket=bucket,
                Key=key,
                UploadId=upload_id,
                PartNumber=number,
                Body=data,
            )
            return answer["ETag"]
        finally:
            self._room.release()

    def _remaining(self) -> float:
        return time_left(self._deadline)


def _send(local: Path, write: Callable, entry: FileEntry, algorithm: str) -> None:
    """Pass the bytes of `local` to `write`, then fail unless they match `entry`."""
    hasher = new_hasher(algorithm)
    size = 0
    with open(local, "rb") as source:
        while chunk := source.read(PART_SIZE):
            hasher.update(chunk)
            write(chunk)
            size += len(chunk)
    checksum = hasher.hexdigest()
    if (size, checksum) != (entry.size, entry.checksum):
        raise ChecksumMismatch(
            f"{local}: read {size} bytes with checksum {checksum}, but its commit record "
            f"says {entry.size} bytes, {entry.checksum}; not uploaded"
        )


def _copy_local(local: Path, target: Path, entry: FileEntry, algorithm: str) -> None:
    """A file:// tier: a temporary file, fsynced, renamed into place only if it matches."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.tmp.{os.getpid()}.{threading.get_ident()}")
    try:
        with open(tmp, "wb") as out:
            _send(local, out.write, entry, algorithm)
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _read_verified(
    store: RemoteStore, rel: str, entry: FileEntry, algorithm: str, sink: Callable
) -> None:
    hasher = new_hasher(algorithm)
    size = 0
    try:
        source = store.fs.open(store.key(rel), "rb", block_size=PART_SIZE)
    except FileNotFoundError:
        raise ChecksumMismatch(f"{store.uri(rel)}: missing") from None
    with source:
        while chunk := source.read(PART_SIZE):
            hasher.update(chunk)
            sink(chunk)
            size += len(chunk)
    if size != entry.size:
        raise ChecksumMismatch(f"{store.uri(rel)}: size {size}, expected {entry.size}")
    checksum = hasher.hexdigest()
    if checksum != entry.checksum:
        raise ChecksumMismatch(f"{store.uri(rel)}: checksum {checksum}, expected {entry.checksum}")


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


def _discard(target) -> None:
    try:
        target.discard()
    except Exception:  # noqa: BLE001 - best effort: the store may be the thing that failed
        pass
