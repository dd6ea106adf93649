"""How an fsspec store publishes a file whole (store/base.py's Publisher, PartPool): one
PUT for a small file, a multipart upload completed only after the caller checked the bytes
(else aborted: an incomplete multipart upload is no object), or an fsspec file closed or
discarded."""

from __future__ import annotations

import threading
from concurrent.futures import Future
from concurrent.futures import wait as wait_for_futures
from typing import Any

from verl_ckpt.protocol.deadlines import deadline_in, time_left
from verl_ckpt.protocol.errors import CommitTimeoutError
from verl_ckpt.protocol.threads import DaemonPool
from verl_ckpt.store.base import PartPool, Publisher

__all__ = ["MultipartUpload", "OnePut", "S3PartPool", "StreamedObject"]


class OnePut(Publisher):
    """A small object: buffered, sent in one PUT on publish."""

    def __init__(self, fs: Any, path: str) -> None:
        self._fs, self._path, self._chunks = fs, path, []

    def write(self, data: bytes) -> None:
        self._chunks.append(data)

    def publish(self) -> None:
        self._fs.pipe_file(self._path, b"".join(self._chunks))

    def discard(self) -> None:
        self._chunks = []


class StreamedObject(Publisher):
    """An fsspec file opened for writing: closed to publish, discarded (its multipart upload
    aborted, or its buffer dropped) otherwise."""

    def __init__(self, target: Any) -> None:
        self._target = target

    def write(self, data: bytes) -> None:
        self._target.write(data)

    def publish(self) -> None:
        self._target.close()

    def discard(self) -> None:
        try:
            self._target.discard()
        except Exception:  # noqa: BLE001 - best effort: the store may be what failed
            pass
        # fsspec's AbstractBufferedFile.discard() does nothing, and its __del__ closes the
        # file, which would upload what it buffered: marked closed, it never does.
        try:
            self._target.closed = True
        except AttributeError:  # a file whose `closed` is read-only (io's)
            pass


class S3PartPool(PartPool):
    """Parallel multipart uploads to S3 (s3fs): each file is read and hashed in order by its
    own thread, its parts sent by this pool, at most `threads` parts in flight (and so in
    memory) across every file of the transfer."""

    def __init__(self, fs: Any, threads: int, timeout_s: float) -> None:
        self.fs = fs
        self.pool = DaemonPool(threads, "verl_ckpt_parts")
        self.room = threading.BoundedSemaphore(threads)
        self.deadline = deadline_in(timeout_s)

    def close(self) -> None:
        self.pool.close(0.0)

    def remaining(self) -> float:
        return time_left(self.deadline)


class MultipartUpload(Publisher):
    """One file's multipart upload on an S3PartPool: completed on publish, else aborted."""

    def __init__(self, parts: S3PartPool, path: str) -> None:
        self._parts = parts
        self._bucket, self._key, _ = parts.fs.split_path(path)
        answer = parts.fs.call_s3("create_multipart_upload", Bucket=self._bucket, Key=self._key)
        self._upload_id = answer["UploadId"]
        self._futures: list[Future] = []

    def write(self, data: bytes) -> None:
        if not self._parts.room.acquire(timeout=self._parts.remaining()):
            raise CommitTimeoutError(f"{self._key}: no part of it sent in time")
        number = len(self._futures) + 1
        self._futures.append(self._parts.pool.submit(self._send, number, data))

    def publish(self) -> None:
        try:
            _, pending = wait_for_futures(self._futures, timeout=self._parts.remaining())
            if pending:
                raise CommitTimeoutError(f"{self._key}: {len(pending)} parts not sent in time")
            etags = [{"PartNumber": i + 1, "ETag": f.result()} for i, f in enumerate(self._futures)]
            self._parts.fs.call_s3(
                "complete_multipart_upload",
                Bucket=self._bucket,
                Key=self._key,
                UploadId=self._upload_id,
                MultipartUpload={"Parts": etags},
            )
        except BaseException:
            self.discard()
            raise

    def discard(self) -> None:
        for future in self._futures:
            if future.cancel():  # never ran: its slot is given back here
                self._parts.room.release()
        try:
            self._parts.fs.call_s3(
                "abort_multipart_upload",
                Bucket=self._bucket,
                Key=self._key,
                UploadId=self._upload_id,
            )
        except Exception:  # noqa: BLE001 - best effort: the store may be what failed
            pass

    def _send(self, number: int, data: bytes) -> str:
        try:
            answer = self._parts.fs.call_s3(
                "upload_part",
                Bucket=self._bucket,
                Key=self._key,
                UploadId=self._upload_id,
                PartNumber=number,
                Body=data,
            )
            return answer["ETag"]
        finally:
            self._parts.room.release()
