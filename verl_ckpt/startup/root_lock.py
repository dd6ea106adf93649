"""One checkpoint root, one job: a lock on the root that dies with its holder.

The same job launched twice on one root (a scheduler's double launch, a re-submitted Ray
job) would interleave its saves in one step namespace. The driver takes this lock at
start-up, before anything under the root changes; `verl-ckpt` commands that change a root
take it too. A second taker is refused at once with a `RootLockedError` naming the holder.

Two mechanisms behind one interface:

- "flock" (preferred): `flock(LOCK_EX | LOCK_NB)` on `<root>/.verl_ckpt.lock`. The kernel
  drops it when the holder dies, however it dies, so a stale lock never blocks a restart.
  Over NFS, Linux maps flock onto POSIX locks held by the server, so it excludes processes
  on other nodes too (unless the mount says `local_lock=flock` or `local_lock=all`). Not
  fcntl/lockf record locks: a process loses those as soon as it closes ANY descriptor of
  the file, which any code that reads the lock file would do.
- "lease" (the fallback where flock fails with ENOLCK, EOPNOTSUPP or ENOSYS: Lustre mounted
  without `-o flock`, some FUSE filesystems): `<root>/.verl_ckpt.lease`, whose heartbeat a
  daemon thread renews every lease_s/4. A lease is stale when its heartbeat is older than
  lease_s (the nodes' clocks must agree to well within lease_s), or at once when its holder
  ran on this machine and is dead, or asks for the absurd (a heartbeat in the future, a
  lease_s beyond MAX_LEASE_S: a warning names the holder). A lease is lost once another
  process took it over or the heartbeat was not renewed within lease_s: from then on the
  job's saves, commits and deletions are refused (`RootLock.check_held`, and the
  `LeaseGuard` of store/lock_record.py that the finalizer and the ranks check).

The lock and lease files are opened without following links (a planted link must not
redirect the holder's writes), a lock file with other hard links is refused (the holder
would rewrite the file it shares), created exclusively with mode 0o640, and read as untrusted
records (store/lock_record.py: bounded, one line naming a file that is no record). A job's
purpose names its program and a hash of its arguments, never the arguments (`this_job`).

Each taker publishes its own lock first and then checks the other mechanism, so that a
lease holder and a flock holder exclude each other where both can be seen. A node that
cannot flock at all cannot see a flock holder: mount the root with the same lock support on
every node.

Within one process the lock is re-entrant: acquiring a root this process holds returns
another handle on the same lock, released with the last handle.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import logging
import os
import secrets
import socket
import stat
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import psutil

from verl_ckpt.protocol.deadlines import deadline_in
from verl_ckpt.protocol.errors import RootLockedError
from verl_ckpt.store.fsio import atomic_write_bytes, fsync_dir, make_dir
from verl_ckpt.store.lock_record import (
    MAX_LEASE_S,
    LeaseGuard,
    LockHolder,
    LockRead,
    lease_window,
    read_lock_record,
)
from verl_ckpt.store.rollback import INTENT_FILENAME

__all__ = [
    "LEASE_FILENAME",
    "LOCK_FILENAME",
    "LockHolder",
    "RootLock",
    "is_locked",
    "read_holder",
    "this_job",
]

logger = logging.getLogger(__name__)

LOCK_FILENAME = ".verl_ckpt.lock"
LEASE_FILENAME = ".verl_ckpt.lease"
_MODES = ("auto", "flock", "lease")
# flock errors meaning "this filesystem cannot flock", as opposed to "someone holds it".
_NO_FLOCK = frozenset({errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP, errno.ENOSYS})
# A held flock is retried this long before refusing: `is_locked` probes hold a shared flock
# for microseconds, and a probe must not turn a job's start into a refusal.
_CONTENDED_GRACE_S = 0.5
_RETRY_S = 0.02
# How long a lease taker waits before re-reading the lease to learn whether it won.
_SETTLE_S = 0.2
# Process start times read twice through psutil differ by rounding only.
_START_TIME_SLACK_S = 1.0
# Lock and lease files: the owner and the group (the jobs sharing a root) read them, nobody
# else writes them.
_FILE_MODE = 0o640


# ---- holder records ------------------------------------------------------------------------


def _machine() -> str:
    """Where our pids mean something: hostname, kernel boot and pid namespace. The hostname
    alone is not enough: containers on one node can share it and not their pids."""
    parts = [socket.gethostname()]
    for read in (
        lambda: Path("/proc/sys/kernel/random/boot_id").read_text().strip(),
        lambda: str(os.stat("/proc/self/ns/pid").st_ino),
    ):
        try:
            parts.append(read())
        except OSError:
            pass
    return "/".join(parts)


def this_job() -> str:
    """The purpose a job's lock names: its program, and a hash of its arguments, never the
    arguments themselves (a Hydra override may carry a secret, and everyone who can read the
    root can read the lock file)."""
    program = sys.argv[0] if sys.argv and sys.argv[0] else sys.executable
    args = "\0".join(sys.argv[1:]).encode("utf-8", "surrogateescape")
    return f"job `{program}` (arguments sha256 {hashlib.sha256(args).hexdigest()[:12]})"


def _new_record(purpose: str) -> dict[str, Any]:
    holder = LockHolder(
        host=socket.gethostname(),
        pid=os.getpid(),
        since=datetime.now().astimezone().isoformat(timespec="seconds"),
        purpose=purpose,
    )
    # The start time tells our pid from a later process that reuses it.
    started = psutil.Process().create_time()
    return {**asdict(holder), "machine": _machine(), "pid_started": started}


def _holder_is_dead(record: dict[str, Any]) -> bool:
    """True only when the holder ran where we can see its pid and that process is gone."""
    if record.get("machine") != _machine():
        return False
    try:
        process = psutil.Process(record["pid"])
        if process.status() == psutil.STATUS_ZOMBIE:
            return True
        started = record.get("pid_started")
        reused = isinstance(started, (int, float)) and (
            abs(process.create_time() - started) > _START_TIME_SLACK_S
        )
        return reused
    except psutil.NoSuchProcess:
        return True
    except (psutil.AccessDenied, ValueError, OverflowError):
        # It exists (someone else's process, but alive), or the record's pid is no pid:
        # nothing tells that the holder is dead, and the heartbeat's age decides.
        return False


def _locked_error(root: Path, path: Path, read: LockRead) -> RootLockedError:
    return RootLockedError(
        f"checkpoint root {root} is in use by {read.who()}; stop it, or use another "
        f"checkpoint.root_dir (lock {path})"
    )


def _unusable_lock_file(root: Path, path: Path, what: str) -> RootLockedError:
    return RootLockedError(
        f"checkpoint root {root} cannot be locked: {path} is {what}, not a lock file that "
        "verl_ckpt made; remove it"
    )


# ---- flock ---------------------------------------------------------------------------------


def _flock_held(root: Path) -> bool:
    """Whether some open file (of any process, ours included) holds the root's flock.

    Probes with a shared lock that is dropped at once; False where flock is unsupported,
    and for anything but a regular file (a planted link or FIFO is no lock of a job).
    """
    flags = os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK
    try:
        fd = os.open(root / LOCK_FILENAME, flags)
    except FileNotFoundError:
        return False
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            return False
        raise
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return False
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError as exc:
        if exc.errno in _NO_FLOCK:
            return False
        raise
    finally:
        os.close(fd)  # also drops the probe's shared lock
    return False


def _open_lock_file(root: Path, path: Path) -> int:
    """The lock file, opened for writing: created exclusively with _FILE_MODE when missing,
    else opened as it is; never through a link (a planted `.verl_ckpt.lock` link would have
    the holder truncate the file it points to) and never anything but a regular file."""
    # O_CLOEXEC: a child that exec()s must not inherit the lock and keep it alive.
    flags = os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK
    while True:
        try:
            fd = os.open(path, flags | os.O_CREAT | os.O_EXCL, _FILE_MODE)
            break
        except FileExistsError:
            pass
        try:
            fd = os.open(path, flags)
            break
        except FileNotFoundError:
            continue  # removed between the two opens: create it
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise _unusable_lock_file(root, path, "a symbolic link") from None
            raise
    status = os.fstat(fd)
    if not stat.S_ISREG(status.st_mode):
        os.close(fd)
        raise _unusable_lock_file(root, path, "not a regular file")
    if status.st_nlink > 1:
        # A hard link planted at the name (where the kernel allows one to another's file):
        # the holder would truncate and rewrite the file it shares an inode with.
        os.close(fd)
        raise _unusable_lock_file(
            root, path, "a hard link to another file (a `cp -al` copy of a root shares it)"
        )
    return fd


class _Flock:
    mode = "flock"

    def __init__(self, path: Path, fd: int) -> None:
        self.path = path
        self._fd: int | None = fd
        self._pid = os.getpid()

    @classmethod
    def take(cls, root: Path, record: dict[str, Any]) -> _Flock:
        path = root / LOCK_FILENAME
        fd = _open_lock_file(root, path)
        try:
            deadline = deadline_in(_CONTENDED_GRACE_S)
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() >= deadline:
                        raise _locked_error(root, path, read_lock_record(path)) from None
                    time.sleep(_RETRY_S)
            # Published (the flock), now check the other mechanism: a lease taker does the
            # same in the opposite order, so of two simultaneous takers one sees the other.
            live, lease = _lease_state(root / LEASE_FILENAME, 0.0)
            if live:
                raise _locked_error(root, root / LEASE_FILENAME, lease)
            try:
                os.ftruncate(fd, 0)
                os.pwrite(fd, json.dumps(record).encode(), 0)
                os.fsync(fd)
            except OSError as exc:  # a full disk: name the file, which the call does not
                raise OSError(exc.errno, exc.strerror, str(path)) from None
        except BaseException:
            os.close(fd)  # the only descriptor of this open file: closing drops the flock
            raise
        return cls(path, fd)

    def guard(self) -> LeaseGuard | None:
        return None  # the kernel keeps a flock for as long as its holder lives

    def check(self, what: str) -> None:
        pass

    def release(self) -> None:
        fd, self._fd = self._fd, None
        if fd is None:
            return
        try:
            # A child forked while we held the lock shares our open file, and with it the
            # lock: its copy only closes, it never unlocks its parent.
            if os.getpid() == self._pid:
                # Clear the holder info while still holding the lock, so that a cleanly
                # released root names nobody. Never unlink the file: a process that opened
                # it before the unlink would lock an orphan inode while a newcomer locks a
                # new file, and both would run.
                os.ftruncate(fd, 0)
                fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)


# ---- lease ---------------------------------------------------------------------------------


def _lease_state(path: Path, lease_s: float) -> tuple[bool, LockRead]:
    """(whether the lease in `path` is live, what the file held). Fresh means a heartbeat
    younger than the larger of `lease_s` and the holder's own lease_s (the holder decides
    how often it renews, so it decides when its silence means death); a record asking for
    the absurd (lease_window) is stale at once, with a warning naming its holder."""
    read = read_lock_record(path)
    if read.mtime is None:
        return False, read  # no file (or one that is no regular file: no lease of a job)
    if read.record is None:
        # Created with O_EXCL and not yet written, or damaged: its age is the file's.
        return time.time() - read.mtime < lease_s, read
    window = lease_window(read.record, lease_s)
    if isinstance(window, str):
        logger.warning("the lease %s of %s is stale: %s", path, read.who(), window)
        return False, read
    heartbeat = read.record.get("heartbeat")
    heartbeat = read.mtime if heartbeat is None else heartbeat
    fresh = time.time() - heartbeat < window
    return fresh and not _holder_is_dead(read.record), read


class _LeaseLost(Exception):
    """Raised inside a renewal when the lease file no longer holds our token."""


def _write_lease(
    path: Path, record: dict[str, Any], before_replace: Callable[[], None] | None = None
) -> None:
    """Replace the lease atomically. Its temporary is named by the lease's random token, not
    by pid: two nodes can run the same pid."""
    data = json.dumps(record).encode()
    atomic_write_bytes(path, data, before_replace=before_replace, tmp_tag=record["token"])


def _create_lease(path: Path, record: dict[str, Any]) -> bool:
    """Create the lease file if there is none; False when one exists (a link included)."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW
    try:
        fd = os.open(path, flags, _FILE_MODE)
    except FileExistsError:
        return False
    try:
        os.write(fd, json.dumps(record).encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    fsync_dir(path.parent)
    return True


class _Lease:
    mode = "lease"

    def __init__(self, path: Path, record: dict[str, Any], lease_s: float) -> None:
        self.path = path
        self._record = record
        self._lease_s = lease_s
        self._pid = os.getpid()
        self._guard = LeaseGuard(path, record["token"], lease_s)
        self._renewed_at = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._heartbeat, name=f"verl-ckpt lease {path.parent}", daemon=True
        )

    @classmethod
    def take(cls, root: Path, record: dict[str, Any], lease_s: float) -> _Lease:
        path = root / LEASE_FILENAME
        record = {**record, "token": secrets.token_hex(16), "lease_s": lease_s}
        record["heartbeat"] = time.time()
        # An exclusive create cannot race: only one taker finds no file. Taking over a stale
        # lease can, and is settled by re-reading (see `_take_over`).
        if not _create_lease(path, record):
            cls._take_over(root, path, record, lease_s)
        lease = cls(path, record, lease_s)
        # Published (the lease), now check the other mechanism (see _Flock.take).
        if _flock_held(root):
            lease.release()
            lock_path = root / LOCK_FILENAME
            raise _locked_error(root, lock_path, read_lock_record(lock_path))
        lease._thread.start()
        return lease

    @staticmethod
    def _take_over(root: Path, path: Path, record: dict[str, Any], lease_s: float) -> None:
        def refuse_if_live() -> None:
            live, current = _lease_state(path, lease_s)
            if live:
                raise _locked_error(root, path, current)

        refuse_if_live()
        # Judged once more right before the rename: between judgement and rename there is
        # then one read, not a write and an fsync, for another taker to slip into. The
        # rename replaces a planted link itself, never the file it points to.
        _write_lease(path, record, before_replace=refuse_if_live)
        # Two takers that both judged the lease stale both rename, and the last rename wins:
        # after a moment, whoever no longer finds its own token has lost.
        time.sleep(min(_SETTLE_S, lease_s / 4))
        winner = read_lock_record(path)
        if winner.record is None or winner.record.get("token") != record["token"]:
            raise _locked_error(root, path, winner)
        logger.warning("took over the stale lease %s", path)

    def guard(self) -> LeaseGuard:
        return self._guard

    def check(self, what: str) -> None:
        self._guard.check(what)

    def _heartbeat(self) -> None:
        while not self._stop.wait(self._lease_s / 4):
            # Silent for lease_s (a stalled process, or renewals failing): anyone may have
            # judged the lease stale and taken the root, and the guards of the finalizer and
            # the ranks judge it lost. It is: renewing now could let two jobs believe they
            # hold the root.
            if time.monotonic() - self._renewed_at >= self._lease_s:
                self._lost(
                    f"the lease {self.path} was not renewed for {self._lease_s:g} s (this "
                    "process stalled or cannot write the root): another job may take the root"
                )
                return
            try:
                self._renew()
            except _LeaseLost:
                self._lost(f"lost the lease {self.path} to {read_lock_record(self.path).who()}")
                return
            except OSError as exc:  # a transient NFS error; the lease has lease_s of slack
                logger.warning("could not renew the lease %s: %s", self.path, exc)

    def _lost(self, why: str) -> None:
        """Saves stop here: every later check of the guard (this job's saves, commits and
        deletions) refuses, naming `why`."""
        self._guard.mark_lost(why)
        logger.error("%s: this job's saves are stopped", why)

    def _renew(self) -> None:
        def still_ours() -> None:
            current = read_lock_record(self.path).record
            if current is None or current.get("token") != self._record["token"]:
                raise _LeaseLost

        self._record = {**self._record, "heartbeat": time.time()}
        _write_lease(self.path, self._record, before_replace=still_ours)
        self._renewed_at = time.monotonic()

    def release(self) -> None:
        if self._stop.is_set():
            return
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=self._lease_s)  # one renewal at most is under way
        if os.getpid() != self._pid:
            return  # a forked child's copy: the lease is its parent's
        current = read_lock_record(self.path).record
        if current is not None and current.get("token") == self._record["token"]:
            self.path.unlink(missing_ok=True)
            fsync_dir(self.path.parent)


# ---- the public handle ---------------------------------------------------------------------


@dataclass
class _Held:
    lock: _Flock | _Lease
    pid: int
    handles: int = 0


# Roots this process holds, by resolved path. Re-entrance must be handled here: two flocks
# of one process on two open files of the same file conflict like two processes' would.
_HELD: dict[Path, _Held] = {}
_HELD_LOCK = threading.Lock()


def _take(root: Path, purpose: str, mode: str, lease_s: float) -> _Flock | _Lease:
    record = _new_record(purpose)
    if mode != "lease":
        try:
            return _Flock.take(root, record)
        except OSError as exc:
            if mode == "flock" or exc.errno not in _NO_FLOCK:
                raise
            logger.warning(
                "cannot flock %s (%s): locking the root with a heartbeat lease instead",
                root / LOCK_FILENAME,
                exc.strerror,
            )
    return _Lease.take(root, record, lease_s)


class RootLock:
    """A handle on the lock of one checkpoint root; get one with `RootLock.acquire`."""

    def __init__(self, key: Path, held: _Held) -> None:
        self._key = key
        self._held = held
        self._released = False

    @classmethod
    def acquire(
        cls,
        root: str | os.PathLike,
        purpose: str,
        mode: str = "auto",
        lease_s: float = 30.0,
    ) -> RootLock:
        """Lock `root` (created with its parents if missing) for `purpose`, or raise
        RootLockedError naming the holder. `mode`: "auto" (flock, else a lease where the
        filesystem cannot flock), "flock" or "lease". `lease_s`: how long a silent lease
        holder stays the holder. A root this process holds gives another handle on the same
        lock, whatever `purpose` and `mode` say."""
        if mode not in _MODES:
            raise ValueError(f"mode must be one of {', '.join(_MODES)}, got {mode!r}")
        if not 0 < lease_s <= MAX_LEASE_S:
            raise ValueError(f"lease_s must be > 0 and <= {MAX_LEASE_S:.0f}, got {lease_s}")
        root = Path(root)
        make_dir(root, parents=True, exist_ok=True)  # DIR_MODE, whatever the umask
        key = root.resolve()
        with _HELD_LOCK:
            held = _HELD.get(key)
            # An entry of another pid was inherited through fork: that lock is the parent's.
            if held is None or held.pid != os.getpid():
                held = _Held(_take(root, purpose, mode, lease_s), os.getpid())
                _HELD[key] = held
            held.handles += 1
            return cls(key, held)

    def release(self) -> None:
        """Drop this handle; the lock itself goes with the process's last handle."""
        with _HELD_LOCK:
            if self._released:
                return
            self._released = True
            self._held.handles -= 1
            if self._held.handles > 0:
                return
            if _HELD.get(self._key) is self._held:
                del _HELD[self._key]
            self._held.lock.release()

    def check_held(self, what: str) -> None:
        """Raise RootLockedError, naming the lease file and its new holder, once a lease was
        lost (another process took the root over, or the heartbeat could not be renewed
        within lease_s); `what` names the refused action. A flock is never lost."""
        self._held.lock.check(what)

    def lease_guard(self) -> LeaseGuard | None:
        """What the job's other processes check before they save, commit or delete (a
        lease's guard, which pickles); None for a flock, which the kernel keeps."""
        return self._held.lock.guard()

    def __enter__(self) -> RootLock:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.release()

    @property
    def path(self) -> Path:
        """The lock file (flock) or the lease file."""
        return self._held.lock.path

    @property
    def mode(self) -> str:
        """Either "flock" or "lease"."""
        return self._held.lock.mode


def read_holder(root: str | os.PathLike) -> LockHolder | None:
    """The holder named in the root's lock or lease file, None when neither names one.

    It may be a holder that died: a killed process cannot clear its info. Whether the root
    is held now is `is_locked`. Where both files name a holder, the newer file wins: a
    holder writes its file when it takes the lock. A file that is not a holder record is
    one warning naming it.
    """
    found = []
    for name in (LOCK_FILENAME, LEASE_FILENAME):
        read = read_lock_record(Path(root) / name)
        if read.problem is not None:
            logger.warning("%s", read.problem)
        if read.holder is not None:
            found.append((read.mtime, read.holder))
    return max(found, key=lambda pair: pair[0])[1] if found else None


def local_root_in_use(path: str | os.PathLike) -> str | None:
    """Why the directory `path`, named as a remote tier (a file:// URL, which has no lock and
    no rollback journal), is a local root that a change through that URL would bypass: a
    process holds it now, or a rollback of it is pending. None otherwise (a directory that
    only once held a job, such as a copy of a root used as a tier, is a tier like any)."""
    path = Path(path)
    if is_locked(path):
        return "a job or command holds it as its checkpoint root now"
    if (path / INTENT_FILENAME).exists():
        return f"a rollback of it is pending ({INTENT_FILENAME})"
    return None


def is_locked(root: str | os.PathLike) -> bool:
    """Whether some process holds the root now (this one included), without taking it."""
    root = Path(root)
    return _flock_held(root) or _lease_state(root / LEASE_FILENAME, 0.0)[0]
