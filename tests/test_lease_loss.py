"""The root lock against a root that others can write (issue 45, item 4): a lost lease stops
the job's saves, commits and deletions; a lease record asking for the absurd is stale; the
lock and lease files are read as untrusted records and never written through a link.

The leases here are real (mode="lease", which "auto" falls back to where flock fails);
"another job took the lease over" is written as that job would write it: a new record with
its own token, renamed over the file.
"""

from __future__ import annotations

import asyncio
import errno
import json
import logging
import os
import pickle
import stat
import time
from pathlib import Path

import pytest
import ray

from tests.helpers import ckpt_config
from tests.test_finalizer import save_driver_step
from verl_ckpt.commit.finalizer import CheckpointFinalizer
from verl_ckpt.protocol.errors import CheckpointError, RootLockedError
from verl_ckpt.protocol.faults import ENV_VAR
from verl_ckpt.protocol.messages import RankReport
from verl_ckpt.startup import root_lock
from verl_ckpt.startup.root_lock import (
    LEASE_FILENAME,
    LOCK_FILENAME,
    RootLock,
    is_locked,
    read_holder,
    this_job,
)
from verl_ckpt.store.checksummed_file import write_checksummed
from verl_ckpt.store.commit_record import FileEntry, is_committed
from verl_ckpt.store.layout import DRIVER_STATE_FILENAME, step_dir
from verl_ckpt.store.tracker import read_tracker

THIEF = "job `python -m other_job`"


def take_over_lease(root: Path) -> None:
    """What another job writes when it takes the lease over (root_lock._take_over)."""
    record = {
        "host": "node-17.example",
        "pid": 4242,
        "since": "2026-11-28T14:00:00+00:00",
        "purpose": THIEF,
        "machine": "node-17.example/boot/1",
        "token": "f" * 32,
        "lease_s": 30.0,
        "heartbeat": time.time(),
    }
    tmp = root / ".lease.tmp"
    tmp.write_text(json.dumps(record))
    os.replace(tmp, root / LEASE_FILENAME)


def assert_names_lease_and_thief(message: str, root: Path) -> None:
    assert f"lost the lease {root / LEASE_FILENAME} to {THIEF} on host node-17.example" in message
    assert "\n" not in message


def test_a_lost_lease_refuses_begin_step_and_the_commit_in_the_finalizer(tmp_path):
    """Step 2 begun before the loss and reported after it does not commit (the commit names
    the lease and its new holder), step 1 stays, and no later step begins."""
    root = tmp_path / "ckpt"
    lock = RootLock.acquire(root, purpose="job", mode="lease", lease_s=30.0)

    async def run() -> None:
        finalizer = CheckpointFinalizer(str(root), {"driver": 1}, 1, lease=lock.lease_guard())
        await save_driver_step(finalizer, 1)
        directory = Path(await finalizer.begin_step(2, "driver", 0, 1, 10.0))
        written = write_checksummed(directory / DRIVER_STATE_FILENAME, lambda s: s.write(b"x"))
        take_over_lease(root)
        entry = FileEntry(DRIVER_STATE_FILENAME, written.size, written.checksum)
        await finalizer.report(RankReport(2, "driver", 0, 1, "save2", files=[entry]))
        with pytest.raises(CheckpointError) as commit:
            await finalizer.wait_for_commit(2, 10.0)
        assert_names_lease_and_thief(str(commit.value), root)
        assert "the commit of step 2 refused" in str(commit.value)
        with pytest.raises(RootLockedError) as begin:
            await finalizer.begin_step(3, "driver", 0, 1, 10.0)
        assert_names_lease_and_thief(str(begin.value), root)

    try:
        asyncio.run(run())
        assert not is_committed(step_dir(root, 2))
        assert is_committed(step_dir(root, 1)) and read_tracker(root) == 1
        with pytest.raises(RootLockedError) as driver:
            lock.check_held("the driver's save of step 3")
        assert_names_lease_and_thief(str(driver.value), root)
    finally:
        lock.release()


def test_a_lease_lost_while_a_begin_waits_for_room_deletes_no_leftover(tmp_path, monkeypatch):
    """Found by review: begin_step checks the lease when it arrives, then may wait long for
    room (here: the retention after step 2, slowed by the documented hook) before it removes
    the step's uncommitted leftover. A job that took the root over meanwhile may be writing
    that very step: the removal now checks the lease anew, as commits and retention do, and
    the other job's files stay."""
    root = tmp_path / "ckpt"
    lock = RootLock.acquire(root, purpose="job", mode="lease", lease_s=30.0)
    theirs = step_dir(root, 5) / DRIVER_STATE_FILENAME

    async def run() -> None:
        finalizer = CheckpointFinalizer(str(root), {"driver": 1}, 1, lease=lock.lease_guard())
        await save_driver_step(finalizer, 1)
        monkeypatch.setenv(ENV_VAR, "delete=sleep=2")
        await save_driver_step(finalizer, 2)  # its retention deletes step 1, slowly
        begin = asyncio.ensure_future(finalizer.begin_step(5, "driver", 0, 1, 30.0, "mine"))
        await asyncio.sleep(0.5)  # waiting for room, its lease check behind it
        take_over_lease(root)
        theirs.parent.mkdir(parents=True)
        theirs.write_bytes(b"the other job's step 5")
        with pytest.raises(CheckpointError) as refused:
            await begin
        assert_names_lease_and_thief(str(refused.value), root)
        await finalizer.drain(30.0)

    try:
        asyncio.run(run())
        assert theirs.read_bytes() == b"the other job's step 5"
    finally:
        lock.release()


def test_a_lost_lease_fails_the_drivers_next_save_and_every_ranks(ray_local, tmp_path, monkeypatch):
    """Through the coordinator, on a root that cannot flock (the lease fallback): the
    driver's next save fails naming the lease file and the new holder, and so does the
    guard the ranks get from the finalizer (CheckpointManager.save checks it first)."""
    from verl_ckpt import CheckpointCoordinator
    from verl_ckpt.commit.client import FinalizerClient

    def no_flock(root, record):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(root_lock._Flock, "take", no_flock)
    cfg = ckpt_config(tmp_path)
    root = Path(cfg["root_dir"])
    coordinator = CheckpointCoordinator(cfg, {})
    try:
        assert coordinator.start.lock.mode == "lease"
        coordinator.save_driver_state(1, {"step": 1})
        coordinator.wait_for_commit(1)
        take_over_lease(root)
        with pytest.raises(RootLockedError) as failed:
            coordinator.save_driver_state(2, {"step": 2})
        assert_names_lease_and_thief(str(failed.value), root)
        guard = FinalizerClient(coordinator.finalizer, "a rank", 60.0).lease_guard()
        with pytest.raises(RootLockedError) as rank:
            guard.check("actor rank 0: save of step 2")
        assert str(rank.value).startswith("actor rank 0: save of step 2 refused: lost the lease")
        assert_names_lease_and_thief(str(rank.value), root)
        assert read_tracker(root) == 1 and not step_dir(root, 2).exists()
    finally:
        coordinator.close()


def test_a_heartbeat_that_cannot_be_renewed_within_lease_s_stops_saves(tmp_path, monkeypatch):
    root = tmp_path / "ckpt"
    lock = RootLock.acquire(root, purpose="job", mode="lease", lease_s=0.4)
    guard = lock.lease_guard()

    def failing(*args, **kwargs):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(root_lock, "_write_lease", failing)
    try:
        deadline = time.monotonic() + 30
        while guard.lost is None:
            assert time.monotonic() < deadline, "the lost heartbeat was never noticed"
            time.sleep(0.05)
        with pytest.raises(RootLockedError, match="was not renewed for 0.4 s") as failed:
            lock.check_held("the driver's save of step 5")
        assert str(failed.value).startswith("the driver's save of step 5 refused: the lease ")
        assert str(root / LEASE_FILENAME) in str(failed.value)
        # The guard that the finalizer and the ranks hold judges it the same way from the file.
        fresh = pickle.loads(pickle.dumps(guard))
        with pytest.raises(RootLockedError, match="was not renewed"):
            fresh.check("a rank's save")
    finally:
        lock.release()


def other_hosts_lease(**fields) -> dict:
    return {
        "host": "node-17.example",
        "pid": 4242,
        "since": "2026-11-28T14:00:00+00:00",
        "purpose": THIEF,
        "machine": "node-17.example/boot/1",
        "token": "0" * 32,
        "lease_s": 30.0,
        "heartbeat": time.time(),
        **fields,
    }


@pytest.mark.parametrize(
    "absurd",
    [
        {"heartbeat": time.time() + 10 * 365 * 86400},
        {"lease_s": 1e12},
        {"lease_s": float("inf")},
        {"heartbeat": float("nan")},
    ],
    ids=["heartbeat in ten years", "lease_s 1e12", "lease_s inf", "heartbeat nan"],
)
def test_a_lease_asking_for_the_absurd_is_stale_with_one_warning_naming_its_holder(
    tmp_path, caplog, absurd
):
    """Before: a heartbeat dated in the future or a huge lease_s locked everyone out for as
    long as it said."""
    root = tmp_path / "ckpt"
    root.mkdir()
    (root / LEASE_FILENAME).write_text(json.dumps(other_hosts_lease(**absurd)))
    assert not is_locked(root)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger=root_lock.__name__):
        with RootLock.acquire(root, purpose="job", mode="lease", lease_s=1.0) as lock:
            assert json.loads(lock.path.read_text())["pid"] == os.getpid()
    stale = [r.getMessage() for r in caplog.records if "is stale" in r.getMessage()]
    assert stale, caplog.text
    assert f"the lease {root / LEASE_FILENAME} of {THIEF} on host node-17.example" in stale[0]
    assert all("\n" not in line for line in stale)


def test_acquire_refuses_an_absurd_lease_s(tmp_path):
    with pytest.raises(ValueError, match="lease_s must be > 0 and <= 3600"):
        RootLock.acquire(tmp_path, purpose="job", mode="lease", lease_s=1e9)


NESTED = "[" * 30000 + "]" * 30000  # under the size bound: json.loads recursed until it failed


@pytest.mark.parametrize(
    ("content", "problem"),
    [
        (NESTED, "is not a lock record (nested too deeply)"),
        ("{" + " " * 70000 + "}", "is larger than 64 KiB"),
        ('{"host": 1}', "is not a lock record (needs host, pid, since, purpose)"),
        ("not json at all", "is not a lock record (not JSON)"),
    ],
    ids=["deeply nested", "too large", "wrong fields", "garbage"],
)
def test_a_lock_record_that_is_no_record_is_one_line_naming_the_file(tmp_path, content, problem):
    """Before: a deeply nested record was a RecursionError traceback at every start and in
    `verl-ckpt ls`. Now a lease holding it is refused in one line naming the file (its age
    decides, as for a lease not yet written), `read_holder` names nobody, and a flock taker
    simply takes the root over it."""
    root = tmp_path / "ckpt"
    root.mkdir()
    (root / LEASE_FILENAME).write_text(content)
    with pytest.raises(RootLockedError) as refused:
        RootLock.acquire(root, purpose="job", mode="lease", lease_s=30.0)
    message = str(refused.value)
    assert f"a holder whose record is unreadable ({root / LEASE_FILENAME} {problem})" in message
    assert "\n" not in message
    assert read_holder(root) is None
    (root / LEASE_FILENAME).unlink()
    (root / LOCK_FILENAME).write_text(content)
    assert read_holder(root) is None and not is_locked(root)
    with RootLock.acquire(root, purpose="job") as lock:
        assert lock.mode == "flock" and read_holder(root).purpose == "job"


def test_a_planted_lock_file_link_never_truncates_its_target(tmp_path):
    root = tmp_path / "ckpt"
    root.mkdir()
    target = tmp_path / "precious.txt"
    target.write_text("do not truncate me")
    (root / LOCK_FILENAME).symlink_to(target)
    with pytest.raises(RootLockedError) as refused:
        RootLock.acquire(root, purpose="job")
    assert str(refused.value) == (
        f"checkpoint root {root} cannot be locked: {root / LOCK_FILENAME} is a symbolic link, "
        "not a lock file that verl_ckpt made; remove it"
    )
    assert not is_locked(root) and read_holder(root) is None
    assert target.read_text() == "do not truncate me"
    # A link planted as the lease is replaced by the taker's own file, never written through.
    (root / LOCK_FILENAME).unlink()
    (root / LEASE_FILENAME).symlink_to(target)
    with RootLock.acquire(root, purpose="job", mode="lease", lease_s=30.0):
        assert not (root / LEASE_FILENAME).is_symlink()
    assert target.read_text() == "do not truncate me"


def test_a_planted_lock_file_hard_link_never_truncates_its_target(tmp_path):
    """Found by review: `.verl_ckpt.lock` hard-linked to another file (which the kernel allows
    to its owner, or anywhere with fs.protected_hardlinks=0) was truncated and rewritten with
    the holder's record."""
    root = tmp_path / "ckpt"
    root.mkdir()
    target = tmp_path / "precious.txt"
    target.write_text("do not truncate me")
    os.link(target, root / LOCK_FILENAME)
    with pytest.raises(RootLockedError) as refused:
        RootLock.acquire(root, purpose="job")
    assert str(refused.value) == (
        f"checkpoint root {root} cannot be locked: {root / LOCK_FILENAME} is a hard link to "
        "another file (a `cp -al` copy of a root shares it), not a lock file that verl_ckpt "
        "made; remove it"
    )
    assert target.read_text() == "do not truncate me"
    (root / LOCK_FILENAME).unlink()
    with RootLock.acquire(root, purpose="job") as lock:
        assert lock.mode == "flock"


def test_a_planted_fifo_neither_blocks_nor_locks(tmp_path):
    root = tmp_path / "ckpt"
    root.mkdir()
    os.mkfifo(root / LEASE_FILENAME)
    os.mkfifo(root / LOCK_FILENAME)
    assert not is_locked(root) and read_holder(root) is None
    with pytest.raises(RootLockedError, match="is not a regular file, not a lock file"):
        RootLock.acquire(root, purpose="job")


@pytest.mark.parametrize("mode", ["flock", "lease"])
def test_lock_files_are_created_with_mode_0o640(tmp_path, mode):
    root = tmp_path / "ckpt"
    umask = os.umask(0)
    os.umask(umask)
    with RootLock.acquire(root, purpose="job", mode=mode, lease_s=30.0) as lock:
        assert stat.S_IMODE(lock.path.stat().st_mode) == 0o640 & ~umask


def test_a_jobs_purpose_names_its_program_and_never_its_arguments(monkeypatch):
    secret = "SECRET-7f3c2a"
    monkeypatch.setattr(
        "sys.argv",
        ["/opt/recipes/ppo_toy.py", f"checkpoint.remote.storage_options.secret={secret}"],
    )
    purpose = this_job()
    assert purpose.startswith("job `/opt/recipes/ppo_toy.py` (arguments sha256 ")
    assert secret not in purpose


def test_ls_of_a_held_root_whose_lock_record_is_deeply_nested_is_no_traceback(tmp_path, capsys):
    """Before: `verl-ckpt ls` raised RecursionError from json.loads of the holder record."""
    from tests.lock_holder import HolderProcesses
    from tests.test_cli import run_cli

    root = tmp_path / "ckpt"
    holders = HolderProcesses()
    try:
        holders.start(root)
        (root / LOCK_FILENAME).write_text(NESTED)  # the holder's flock stays
        code, out, err = run_cli(capsys, "ls", root)
    finally:
        holders.close()
    assert code == 0 and "Traceback" not in out + err, err
    assert "in use by: a process that left no name" in out


def test_a_lost_lease_fails_every_ranks_next_save_naming_the_lock(ranks, tmp_path, monkeypatch):
    """Real ranks (CheckpointManager in Ray actors) on a root held by a lease: after another
    job took the lease over, each rank's next save() raises RootLockedError naming the lease
    file and the new holder, and nothing of the step is committed."""
    from tests.conftest import ROLES
    from tests.helpers import close_all, every_rank, open_all, save_everyone
    from verl_ckpt import CheckpointCoordinator

    def no_flock(root, record):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(root_lock._Flock, "take", no_flock)
    cfg = ckpt_config(tmp_path)
    root = Path(cfg["root_dir"])
    coordinator = CheckpointCoordinator(cfg, ROLES)
    try:
        open_all(ranks, cfg)
        save_everyone(ranks, coordinator, 1)
        coordinator.wait_for_commit(1)
        take_over_lease(root)
        for worker in every_rank(ranks):
            with pytest.raises(ray.exceptions.RayTaskError) as failed:
                ray.get(worker.save.remote(2))
            assert isinstance(failed.value.cause, RootLockedError), failed.value
            message = str(failed.value.cause)
            assert " rank " in message and ": save of step 2 refused: " in message, message
            assert_names_lease_and_thief(message, root)
        assert read_tracker(root) == 1 and not is_committed(step_dir(root, 2))
    finally:
        close_all(ranks, coordinator)
