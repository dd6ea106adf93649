"""The holder records in a checkpoint root's lock and lease files, read without trusting
them, and the lease guard that stops a job's saves once its lease is lost.

startup/root_lock.py takes the lock and writes the records; the finalizer (commit/) and the
ranks (rank/) only check the guard, so both live here, below them all. Anyone who can write
the root can write these files: a read is bounded (LOCK_RECORD_MAX_BYTES), never follows a
link or opens a FIFO, and any content that is not a holder record (too large, nested too
deeply, wrong fields) is one line naming the file, never a traceback.
"""

from __future__ import annotations

import errno
import json
import math
import os
import stat
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from verl_ckpt.protocol.errors import RootLockedError

__all__ = [
    "LOCK_RECORD_MAX_BYTES",
    "MAX_LEASE_S",
    "LeaseGuard",
    "LockHolder",
    "LockRead",
    "lease_window",
    "read_lock_record",
]

# A holder record is a few hundred bytes; anything much larger is not one.
LOCK_RECORD_MAX_BYTES = 64 * 1024
# A lease that stays its holder's for longer than this after its last heartbeat would lock a
# root for good after a crash: a record asking for more is treated as stale.
MAX_LEASE_S = 3600.0


@dataclass(frozen=True)
class LockHolder:
    """Who holds a root: written into the lock (or lease) file by the holder."""

    host: str
    pid: int
    since: str  # ISO-8601 local time with its UTC offset
    purpose: str  # e.g. "job `python -m recipes.ppo_toy`", "verl-ckpt rollback"

    def describe(self) -> str:
        return f"{self.purpose} on host {self.host} (pid {self.pid}, since {self.since})"


_FIELDS = {"host": str, "pid": int, "since": str, "purpose": str}


@dataclass(frozen=True)
class LockRead:
    """What a lock or lease file held: a holder record, or nothing (no file, or an empty one
    being written), or a `problem` (one line naming the file)."""

    record: dict[str, Any] | None
    problem: str | None = None
    mtime: float | None = None  # None: no file

    @property
    def holder(self) -> LockHolder | None:
        if self.record is None:
            return None
        record = self.record
        return LockHolder(record["host"], record["pid"], record["since"], record["purpose"])

    def who(self) -> str:
        """The holder, in words, for an error message."""
        if self.record is not None:
            return self.holder.describe()
        if self.problem is not None:
            return f"a holder whose record is unreadable ({self.problem})"
        return "another process (no holder info in the file yet)"


def read_lock_record(path: str | os.PathLike) -> LockRead:
    """The holder record in `path` (see the module docstring); never raises for content."""
    path = Path(path)
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:
        return LockRead(None)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            return LockRead(None, f"{path} is a symbolic link, not a lock file")
        return LockRead(None, f"{path}: {exc.strerror}")
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            return LockRead(None, f"{path} is not a regular file")
        data = os.read(fd, LOCK_RECORD_MAX_BYTES + 1)
    except OSError as exc:
        return LockRead(None, f"{path}: {exc.strerror}")
    finally:
        os.close(fd)
    if not data:  # created, not yet written (or cleared by a clean release)
        return LockRead(None, None, info.st_mtime)
    if len(data) > LOCK_RECORD_MAX_BYTES:
        problem = f"{path} is larger than {LOCK_RECORD_MAX_BYTES // 1024} KiB"
        return LockRead(None, problem, info.st_mtime)
    try:
        record = json.loads(data)
    except RecursionError:  # json recurses once per level of nesting
        return LockRead(None, f"{path} is not a lock record (nested too deeply)", info.st_mtime)
    except ValueError:  # damaged, or half written this very moment
        return LockRead(None, f"{path} is not a lock record (not JSON)", info.st_mtime)
    if not isinstance(record, dict) or not all(
        type(record.get(key)) is kind for key, kind in _FIELDS.items()
    ):
        fields = ", ".join(_FIELDS)
        return LockRead(None, f"{path} is not a lock record (needs {fields})", info.st_mtime)
    return LockRead(record, None, info.st_mtime)


def lease_window(record: dict[str, Any], lease_s: float) -> float | str:
    """How long after its heartbeat the lease in `record` stays its holder's: the larger of
    the reader's `lease_s` and the holder's own (the holder decides how often it renews);
    or, where the record asks for the absurd (a lease_s that is not a number of seconds in
    (0, MAX_LEASE_S], a heartbeat in the future), why it is stale at once."""
    own = record.get("lease_s")
    if own is not None and not (
        isinstance(own, (int, float)) and math.isfinite(own) and 0 < own <= MAX_LEASE_S
    ):
        return f"its lease_s {own!r} is not within (0, {MAX_LEASE_S:.0f}] s"
    window = max(lease_s, own or 0.0)
    heartbeat = record.get("heartbeat")
    if heartbeat is not None:
        if not (isinstance(heartbeat, (int, float)) and math.isfinite(heartbeat)):
            return f"its heartbeat {heartbeat!r} is not a time"
        # The nodes' clocks agree to well within lease_s (root_lock.py): further ahead is not
        # a clock's drift but a record that would hold the root for as long as it says.
        if heartbeat - time.time() > window:
            ahead = heartbeat - time.time()
            return f"its heartbeat is {ahead:.0f} s in the future"
    return window


class LeaseGuard:
    """A job's lease on its root, as every process of the job checks it before it saves.

    The driver holds the lease (root_lock.py) and renews its heartbeat; the finalizer and
    every rank get this guard (it pickles) and `check` it before a step begins, before a
    commit and before anything is deleted. Lost, once and for good, when the lease file no
    longer holds this job's token (another job took the root over) or its heartbeat is
    older than `lease_s` (the driver could not renew it: anyone may take the root now).
    """

    def __init__(self, path: str | os.PathLike, token: str, lease_s: float) -> None:
        self.path = Path(path)
        self.token = token
        self.lease_s = lease_s
        self._lost: str | None = None
        self._checked_at = -math.inf
        self._mutex = threading.Lock()

    def __getstate__(self) -> dict[str, Any]:
        return {"path": self.path, "token": self.token, "lease_s": self.lease_s}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["path"], state["token"], state["lease_s"])

    @property
    def lost(self) -> str | None:
        """Why the lease is lost (one line naming the lease file), None while it is held."""
        return self._lost

    def mark_lost(self, why: str) -> None:
        with self._mutex:
            if self._lost is None:
                self._lost = why

    def check(self, what: str, fresh_within_s: float = 0.0) -> None:
        """Raise RootLockedError naming the lease file and its new holder once the lease is
        lost; `what` names the refused action. The file is read again unless it was found
        held less than `fresh_within_s` ago (for calls every rank makes at every step; a
        commit or a deletion passes 0)."""
        if self._lost is None and time.monotonic() - self._checked_at >= fresh_within_s:
            why = self._problem()
            if why is None:
                self._checked_at = time.monotonic()
            else:
                self.mark_lost(why)
        if self._lost is not None:
            raise RootLockedError(
                f"{what} refused: {self._lost}; this job commits and deletes nothing more "
                "under the root (stop it; another job may be using the root)"
            )

    def _problem(self) -> str | None:
        read = read_lock_record(self.path)
        if read.record is None or read.record.get("token") != self.token:
            if read.record is None and read.problem is None:
                return f"the lease {self.path} was removed"
            return f"lost the lease {self.path} to {read.who()}"
        heartbeat = read.record.get("heartbeat")
        age = time.time() - heartbeat if isinstance(heartbeat, (int, float)) else math.inf
        if not age < self.lease_s:
            return (
                f"the lease {self.path} was not renewed for {self.lease_s:g} s (the driver "
                "stalled or cannot write the root): another job may take the root"
            )
        return None
