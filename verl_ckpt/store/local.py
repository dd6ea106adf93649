"""A `Store` over a local directory (or a filesystem every node shares): store/base.py.

Durable means fsynced: a file's bytes before its rename, the directory after every
creation, rename and removal (fsio.py). Renames are cheap and atomic, so a step leaves the
step namespace at once when it is deleted, and rollback can archive steps.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

from verl_ckpt.store.base import PartPool, Publisher, Store
from verl_ckpt.store.fsio import (
    FILE_MODE,
    RenameNotDurable,
    atomic_write_bytes,
    fsync_dir,
    open_dir_beneath,
    open_regular,
    read_regular,
    remove_stale_temporaries,
    temporary_name,
    unlink_beneath,
)
from verl_ckpt.store.layout import DELETING_PREFIX, list_step_dirs, step_name

__all__ = ["LocalStore"]


class LocalStore(Store):
    """The directory `root` (which may not exist yet: then it holds nothing)."""

    can_rename = True
    failed_put_left_old = True
    fault_hooks = True

    def __init__(self, root: str | os.PathLike) -> None:
        self.root = Path(root)
        self.url = str(self.root)

    def path(self, rel: str = "") -> Path:
        """The local path of `rel`."""
        return self.root / rel if rel else self.root

    def uri(self, *parts: str) -> str:
        return str(self.root.joinpath(*(p for p in parts if p)))

    def __repr__(self) -> str:
        return f"LocalStore({self.url!r})"

    # ---- reading -------------------------------------------------------------------------

    def read_bytes(self, rel: str, max_bytes: int | None = None) -> bytes | None:
        # Read only if it is a regular file: a FIFO in its place would wait for a writer
        # forever, a link to a device never end (fsio.open_regular).
        return read_regular(self.path(rel), max_bytes)

    def exists(self, rel: str) -> bool:
        return self.path(rel).exists()

    def list_steps(self) -> list[int]:
        return sorted(list_step_dirs(self.root))

    def list_files(self, rel: str) -> dict[str, int]:
        base = self.path(rel)
        found = {}
        for parent, _, names in os.walk(base):
            for name in names:
                full = os.path.join(parent, name)
                try:
                    size = os.lstat(full).st_size
                except FileNotFoundError:
                    continue  # deleted while we walked
                found[os.path.relpath(full, base).replace(os.sep, "/")] = size
        return found

    def modified_at(self, rel: str) -> float | None:
        try:
            return self.path(rel).stat().st_mtime
        except OSError:
            return None

    def open_read(self, rel: str) -> BinaryIO:
        # Unbuffered: readers read large chunks with readinto (verification.py). A regular
        # file only: a FIFO or a device named by a record must not hang a check or a copy.
        return open(open_regular(self.path(rel)), "rb", buffering=0)

    # ---- writing -------------------------------------------------------------------------

    # Every name written or removed is reached below the root without following a link
    # (fsio.open_dir_beneath): a writer of the root cannot redirect it by swapping one of
    # its directories for a link between two calls.

    def put_bytes(
        self, rel: str, data: bytes, before_replace: Callable[[], None] | None = None
    ) -> None:
        atomic_write_bytes(self.path(rel), data, before_replace=before_replace, beneath=self.root)

    def open_publish(
        self, rel: str, size: int, part_size: int, parts: PartPool | None = None
    ) -> Publisher:
        return _RenamedIntoPlace(self.root, rel)

    def remove(self, rel: str) -> None:
        unlink_beneath(self.root, rel)
        parent = rel.rpartition("/")[0]
        try:
            fsync_dir(self.path(parent))  # by name: only durability is at stake
        except FileNotFoundError:
            pass  # its directory went too: nothing to make durable here
        except OSError as exc:
            where = str(self.path(parent))
            raise RenameNotDurable(exc.errno, exc.strerror or str(exc), where) from exc

    def remove_tree(self, rel: str) -> None:
        path = self.path(rel)
        if path.is_symlink():
            path.unlink()
        elif path.exists():
            shutil.rmtree(path)

    def make_durable(self, rel: str) -> None:
        fsync_dir(self.path(rel))

    def clear_temporaries(self, rel: str) -> None:
        path = self.path(rel)
        remove_stale_temporaries(path.parent, path.name)

    def retired_leftovers(self) -> list[str]:
        return sorted(p.name for p in self.root.glob(f"{DELETING_PREFIX}*"))

    def retire_step(self, step: int) -> str | None:
        path = self.path(step_name(step))
        doomed = path.with_name(f"{DELETING_PREFIX}{path.name}")
        if doomed.is_symlink() or doomed.exists():
            self.remove_tree(doomed.name)
        if path.is_symlink():
            # A step linked in from elsewhere: only the link is the root's. Deleting through it
            # would take the commit record of a checkpoint outside the root (another run's).
            path.unlink()
            fsync_dir(path.parent)
            return None
        os.replace(path, doomed)
        fsync_dir(path.parent)
        return doomed.name


class _RenamedIntoPlace(Publisher):
    """A temporary file beside `rel` under `root`, fsynced and renamed into place on publish;
    its directory reached and held by descriptor (fsio.open_dir_beneath), made if missing.
    The descriptor is closed once, by whichever of publish() and discard() ends it."""

    def __init__(self, root: Path, rel: str) -> None:
        parent, _, self._name = rel.rpartition("/")
        self._dir: int | None = open_dir_beneath(root, parent, create=True)
        try:
            # Created new under a random name: a link planted beside the target is never
            # followed.
            self._tmp = temporary_name(self._name).name
            flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
            self._file = open(os.open(self._tmp, flags, FILE_MODE, dir_fd=self._dir), "wb")
        except BaseException:
            self._close_dir()
            raise

    def write(self, data: bytes) -> None:
        self._file.write(data)

    def publish(self) -> None:
        try:
            self._file.flush()
            os.fsync(self._file.fileno())
            self._file.close()
            os.replace(self._tmp, self._name, src_dir_fd=self._dir, dst_dir_fd=self._dir)
        except BaseException:
            self.discard()
            raise
        self._close_dir()

    def discard(self) -> None:
        if self._dir is None:
            return  # published or discarded already
        try:
            self._file.close()  # flushes again: a full disk raises here once more
        except OSError:
            pass
        try:
            os.unlink(self._tmp, dir_fd=self._dir)
        except FileNotFoundError:
            pass
        finally:
            self._close_dir()

    def _close_dir(self) -> None:
        if self._dir is not None:
            os.close(self._dir)
            self._dir = None
