"""One root, one job: the root lock (verl_ckpt/startup/root_lock.py) against real processes.

Every holder is a real process (tests/lock_holder.py) and every crash a real SIGKILL. This
machine's filesystem supports flock, so the lease fallback is not reached by a failing
flock here: the tests that exercise it choose it by argument (mode="lease"), which runs the
same code that "auto" falls back to on Lustre without `-o flock`.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from datetime import datetime

import pytest

from tests.lock_holder import REPO_ROOT, HolderProcesses
from verl_ckpt.protocol.errors import RootLockedError
from verl_ckpt.startup.root_lock import (
    LEASE_FILENAME,
    LOCK_FILENAME,
    LockHolder,
    RootLock,
    is_locked,
    read_holder,
)

JOB = "job `python -m recipes.ppo_toy`"


@pytest.fixture
def holders():
    started = HolderProcesses()
    yield started
    started.close()


def acquire_elsewhere(root) -> str:
    """Try the lock from a fresh process: "ACQUIRED <mode>" or the RootLockedError message."""
    code = (
        "import sys\n"
        "from verl_ckpt.protocol.errors import RootLockedError\n"
        "from verl_ckpt.startup.root_lock import RootLock\n"
        "try:\n"
        "    lock = RootLock.acquire(sys.argv[1], purpose='probe')\n"
        "except RootLockedError as exc:\n"
        "    print(exc)\n"
        "else:\n"
        "    print('ACQUIRED', lock.mode)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, str(root)],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def assert_names_holder(message: str, root, lock_file, pid: int, purpose: str = JOB) -> None:
    assert message.startswith(f"checkpoint root {root} is in use by {purpose} on host ")
    assert f"on host {socket.gethostname()} (pid {pid}, since " in message
    assert message.endswith(
        f"; stop it, or use another checkpoint.root_dir (lock {root / lock_file})"
    )
    assert "\n" not in message


def test_one_root_one_job_second_holder_refused_naming_holder(tmp_path, holders):
    """A second job on a held root is refused at start-up with one line naming the root, the
    holder's host, pid and start time, and the lock file."""
    root = tmp_path / "ckpt"
    proc = holders.start(root)
    with pytest.raises(RootLockedError) as refused:
        RootLock.acquire(root, purpose="second launch")
    assert_names_holder(str(refused.value), root, LOCK_FILENAME, proc.pid)
    assert is_locked(root)
    holder = read_holder(root)
    assert (holder.host, holder.pid, holder.purpose) == (socket.gethostname(), proc.pid, JOB)


def test_flock_dead_holder_never_blocks_a_restart(tmp_path, holders):
    """The kernel drops the flock of a killed holder: the restart gets the root at once,
    although the dead holder's info is still in the file (a kill runs no cleanup)."""
    root = tmp_path / "ckpt"
    proc = holders.start(root)
    holders.kill(proc)
    assert read_holder(root).pid == proc.pid  # stale info, no longer a lock
    assert not is_locked(root)
    with RootLock.acquire(root, purpose=JOB) as lock:
        assert lock.mode == "flock"
        assert read_holder(root).pid == os.getpid()


def test_lease_live_holder_refused_dead_one_on_this_host_taken_over_at_once(tmp_path, holders):
    """Lease mode: a holder whose heartbeat is recent and whose pid is alive is refused; once
    it is killed, its lease (heartbeat still recent, lease_s 30 s) is taken over at once,
    because it ran on this machine and its pid is dead."""
    root = tmp_path / "ckpt"
    proc = holders.start(root, mode="lease", lease_s=30.0)
    with pytest.raises(RootLockedError) as refused:
        RootLock.acquire(root, purpose="second launch", mode="lease")
    assert_names_holder(str(refused.value), root, LEASE_FILENAME, proc.pid)
    assert is_locked(root)

    holders.kill(proc)
    lease = json.loads((root / LEASE_FILENAME).read_text())
    assert lease["pid"] == proc.pid and time.time() - lease["heartbeat"] < 30
    started = time.monotonic()
    with RootLock.acquire(root, purpose=JOB, mode="lease") as lock:
        assert time.monotonic() - started < 5  # not after lease_s
        assert lock.mode == "lease"
        assert read_holder(root).pid == os.getpid()


def test_lease_of_a_holder_on_another_host_is_stale_only_after_lease_s(tmp_path):
    """A lease written on another node cannot be judged by its pid: it holds the root while
    its heartbeat is younger than lease_s, and is taken over once it is older."""
    root = tmp_path / "ckpt"
    root.mkdir()
    heartbeat = time.time()
    other = {
        "host": "node-17.example",
        "pid": 4242,
        "since": "2026-11-23T19:25:18+00:00",
        "purpose": JOB,
        "machine": "node-17.example/some-boot-id/4026531836",
        "token": "0" * 32,
        "lease_s": 1.0,
        "heartbeat": heartbeat,
    }
    (root / LEASE_FILENAME).write_text(json.dumps(other))
    with pytest.raises(RootLockedError, match=r"on host node-17\.example \(pid 4242, since "):
        RootLock.acquire(root, purpose="second launch", mode="lease", lease_s=1.0)
    # Wait on the clock itself (with a deadline) until the heartbeat is older than lease_s.
    deadline = time.monotonic() + 10
    while time.time() <= heartbeat + 1.0 and time.monotonic() < deadline:
        time.sleep(0.05)
    with RootLock.acquire(root, purpose=JOB, mode="lease", lease_s=1.0):
        taken = json.loads((root / LEASE_FILENAME).read_text())
        assert (taken["host"], taken["pid"]) == (socket.gethostname(), os.getpid())


def test_lease_heartbeat_renews_and_release_removes_the_lease(tmp_path):
    """The holder's heartbeat keeps its lease fresh (every lease_s/4); release stops it and
    removes the lease file, so the root is free at once."""
    root = tmp_path / "ckpt"
    lock = RootLock.acquire(root, purpose=JOB, mode="lease", lease_s=0.4)
    first = json.loads(lock.path.read_text())["heartbeat"]
    deadline = time.monotonic() + 10
    while json.loads(lock.path.read_text())["heartbeat"] == first:
        assert time.monotonic() < deadline, "the lease was never renewed"
        time.sleep(0.02)
    lock.release()
    assert not (root / LEASE_FILENAME).exists()
    assert not is_locked(root)
    assert acquire_elsewhere(root) == "ACQUIRED flock"


@pytest.mark.parametrize(("held_with", "taken_with"), [("lease", "auto"), ("flock", "lease")])
def test_flock_and_lease_holders_exclude_each_other(tmp_path, holders, held_with, taken_with):
    """A root held through one mechanism is refused to a taker using the other one."""
    root = tmp_path / "ckpt"
    proc = holders.start(root, mode=held_with)
    with pytest.raises(RootLockedError) as refused:
        RootLock.acquire(root, purpose="second launch", mode=taken_with)
    lock_file = LEASE_FILENAME if held_with == "lease" else LOCK_FILENAME
    assert_names_holder(str(refused.value), root, lock_file, proc.pid)


def test_reentrant_in_process_handles_share_one_lock_released_with_the_last(tmp_path):
    """Acquiring a root this process holds gives another handle on the same lock (keyed by
    the resolved path); the lock goes with the last handle, not the first."""
    root = tmp_path / "ckpt"
    first = RootLock.acquire(root, purpose=JOB)
    second = RootLock.acquire(tmp_path / "ckpt" / ".." / "ckpt", purpose="verl-ckpt prune")
    assert second.path == first.path and second.mode == first.mode == "flock"
    assert read_holder(root).purpose == JOB  # the first taker's info stays
    first.release()
    first.release()  # idempotent: does not drop the second handle's share
    assert acquire_elsewhere(root).startswith(f"checkpoint root {root} is in use by {JOB}")
    second.release()
    assert acquire_elsewhere(root) == "ACQUIRED flock"


def test_reentrant_acquire_is_thread_safe(tmp_path):
    """Threads of one process acquiring one root at once all get handles on one lock."""
    root = tmp_path / "ckpt"
    barrier = threading.Barrier(8)
    handles: list[RootLock] = []
    errors: list[BaseException] = []

    def take() -> None:
        barrier.wait(timeout=30)
        try:
            handles.append(RootLock.acquire(root, purpose=JOB))
        except BaseException as exc:  # noqa: BLE001 - reported by the assertion below
            errors.append(exc)

    threads = [threading.Thread(target=take) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert errors == [] and len(handles) == 8
    assert {h.path for h in handles} == {root / LOCK_FILENAME}
    for handle in handles[:-1]:
        handle.release()
    assert is_locked(root)
    handles[-1].release()
    assert not is_locked(root)


def test_release_is_idempotent_and_leaves_no_holder_info(tmp_path):
    """A released root names nobody; the lock file stays (unlinking a file that others may
    have open would let two processes lock two different files)."""
    root = tmp_path / "ckpt"
    with RootLock.acquire(root, purpose=JOB) as lock:
        assert read_holder(root).pid == os.getpid()
    lock.release()
    assert (root / LOCK_FILENAME).exists()
    assert read_holder(root) is None and not is_locked(root)


@pytest.mark.parametrize("mode", ["flock", "lease"])
def test_holder_info_is_readable_and_root_created_if_missing(tmp_path, mode):
    """The lock creates a missing root with its parents and records who holds it: host, pid,
    local start time with its UTC offset, purpose."""
    root = tmp_path / "a" / "b" / "ckpt"
    with RootLock.acquire(root, purpose="verl-ckpt rollback", mode=mode) as lock:
        assert root.is_dir() and lock.mode == mode
        holder = read_holder(root)
        assert (holder.host, holder.pid) == (socket.gethostname(), os.getpid())
        assert holder.purpose == "verl-ckpt rollback"
        since = datetime.fromisoformat(holder.since)
        assert since.utcoffset() is not None
        assert abs(since.timestamp() - time.time()) < 60


def test_holder_describe_names_purpose_host_pid_and_since():
    """The one phrase every refusal and `verl-ckpt ls` use to name a holder."""
    holder = LockHolder("h", 12, "2026-11-23T19:25:18+00:00", "verl-ckpt rollback")
    assert holder.describe() == (
        "verl-ckpt rollback on host h (pid 12, since 2026-11-23T19:25:18+00:00)"
    )
