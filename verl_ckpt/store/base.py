"""The one seam under every place steps live: a `Store` (protocol page, steps 5-11 and 0).

Everything else of the store floor (commit record, tracker, retention, recovery, rollback,
verification, transfer) is written once over these methods, as PyTorch DCP writes its file
logic once over `FileSystemBase`. Two implementations: a local directory (store/local.py)
and an fsspec URL (store/fsspec_store.py); `open_store` (store/open_store.py) picks one. A
store is addressed by POSIX paths relative to its root, e.g. "latest_checkpointed_iteration.txt"
or "global_step_5/actor/__0_0.distcp".

Who calls what: the finalizer (commit thread) writes records, the tracker and deletes
steps; ranks' upload threads publish files; start-up, recovery and the CLI read, list and
(under the root lock) write. A store is used from several threads at once; each method is
one self-contained operation.

"Durable" is per method below: once a method that writes returns, a crash (power loss on
a local disk) does not undo what it did. Local: file and directory fsyncs; object stores:
an acknowledged PUT, DELETE or completed multipart upload.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import BinaryIO

from verl_ckpt.store.fsio import NotARegularFile
from verl_ckpt.store.layout import step_name

__all__ = ["NotARegularFile", "PartPool", "Publisher", "Store"]


class Publisher(ABC):
    """A file being written that nobody sees until `publish()`: then it appears whole, in
    one step (local: tmp file, fsync, rename; s3: multipart upload completed). `discard()`
    drops it (s3: the multipart upload aborted): readers still see what was there before.
    The caller checks the bytes it wrote (size, checksum) before it publishes."""

    @abstractmethod
    def write(self, data: bytes) -> None: ...

    @abstractmethod
    def publish(self) -> None: ...

    @abstractmethod
    def discard(self) -> None: ...


class PartPool(ABC):
    """Threads sending the parts of large files in parallel during one transfer (s3);
    bounded in memory to `threads` parts in flight. Closed at the end of the transfer."""

    @abstractmethod
    def close(self) -> None: ...


class Store(ABC):
    """Where steps live (see the module docstring)."""

    #: The store's root, as a user names it (a path or a URL): for messages.
    url: str
    #: Whether `retire_step` takes a step out of the namespace at once (a rename) and
    #: rollback can archive steps instead of deleting them.
    can_rename: bool = False
    #: Whether a `put_bytes` that raised (other than RenameNotDurable) certainly left the old
    #: content: a local rename that did not happen. An object store's PUT that raised may
    #: still land (a timed-out call goes on in its thread; a PUT applied, then reported as
    #: failed), so a failure there proves nothing.
    failed_put_left_old: bool = False
    #: Whether the local tier's fault phases (`tracker`, `delete`, `rollback`; protocol
    #: page) fire on this store. The root's own store only: the remote tier's steps 10 and
    #: 11 have none, so that a drill of the local tier never breaks the remote one.
    fault_hooks: bool = False

    def uri(self, *parts: str) -> str:
        """The path or URL of `parts` under the root, for messages."""
        return "/".join([self.url.rstrip("/"), *(p for p in parts if p)])

    def step_rel(self, step: int, *parts: str) -> str:
        """The relative path of `parts` under step `step`."""
        return "/".join([step_name(step), *parts])

    def hold_back(self, rel: str, thread: threading.Thread) -> None:  # noqa: B027
        """`thread` was left running past a caller's deadline and may still change `rel`:
        no call on `rel` is sent before it ended (FsspecStore). A local root is never
        called under such a deadline: nothing to do."""

    # ---- reading -------------------------------------------------------------------------

    @abstractmethod
    def read_bytes(self, rel: str, max_bytes: int | None = None) -> bytes | None:
        """The whole file `rel`, or None when it does not exist. IsADirectoryError for a
        directory, NotARegularFile for anything else that is not a file (a link included),
        fsio.FileTooLarge when it holds more than `max_bytes` (the bound of a record's
        kind: never read whole)."""

    @abstractmethod
    def exists(self, rel: str) -> bool:
        """Whether a file or a directory (a prefix holding objects) `rel` exists."""

    @abstractmethod
    def list_steps(self) -> list[int]:
        """Every step in the step namespace (`global_step_<N>`), committed or not, sorted."""

    @abstractmethod
    def list_files(self, rel: str) -> dict[str, int]:
        """Every file under directory `rel` (a step's, say), relative to it, with its size;
        empty when there is none."""

    def modified_at(self, rel: str) -> float | None:
        """When `rel` last changed (time.time()), where the store says; for listings."""
        return None

    @abstractmethod
    def open_read(self, rel: str) -> BinaryIO:
        """A binary stream of file `rel` (FileNotFoundError when it does not exist)."""

    # ---- writing -------------------------------------------------------------------------

    @abstractmethod
    def put_bytes(
        self, rel: str, data: bytes, before_replace: Callable[[], None] | None = None
    ) -> None:
        """Replace file `rel` with `data` atomically: readers see the old or the new content,
        never less; durable when it returns. Local: tmp + fsync + rename + directory fsync,
        raising fsio.RenameNotDurable when only the directory fsync after the rename failed
        (readers see the new content). Object store: one PUT. `before_replace` runs just
        before the content is replaced (a fault injection point)."""

    @abstractmethod
    def open_publish(
        self, rel: str, size: int, part_size: int, parts: PartPool | None = None
    ) -> Publisher:
        """A Publisher of file `rel` of `size` bytes, fed in writes of `part_size` bytes
        (the last shorter); `parts` (from `part_pool`) sends large files in parallel parts."""

    def part_pool(self, threads: int, timeout_s: float) -> PartPool | None:
        """A PartPool for one transfer into this store, or None where it has none."""
        return None

    @abstractmethod
    def remove(self, rel: str) -> None:
        """Remove file `rel` (nothing when absent); durable when it returns."""

    @abstractmethod
    def remove_tree(self, rel: str) -> None:
        """Remove `rel` and everything under it (nothing when absent). A symbolic link is
        removed as a link, never followed."""

    def make_durable(self, rel: str) -> None:  # noqa: B027 - a no-op where writes are durable
        """Make the entries created and removed in directory `rel` durable (local: the
        directory's fsync); nothing where every write is durable when it returns."""

    def clear_temporaries(self, rel: str) -> None:  # noqa: B027 - a no-op where none are left
        """Remove what a crash inside `put_bytes(rel)` left beside `rel` (local: its
        temporary files); nothing where a write leaves nothing."""

    def retired_leftovers(self) -> list[str]:
        """The relative paths that interrupted deletions left out of the step namespace
        (where `can_rename`), for the next retention to remove."""
        return []

    @abstractmethod
    def retire_step(self, step: int) -> str | None:
        """Take step `step` out of the step namespace at once where the store can, for its
        deletion; return the relative path its files are now under (their record to be
        removed first, then the rest), or None when nothing is left to remove (a local step
        that was a symbolic link: only the link was the root's). Local: one durable rename
        to `.deleting_global_step_<N>`. Object store: no cheap rename, the step's own name is
        returned and removing its record first is what takes it out."""
