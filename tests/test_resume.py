"""Start-up (protocol step 0) over real directories: resume resolution, roll-forward, and
the mistakes refused before anything is written (no Ray, no megatron).

Invariant I1 from the reader's side: only a committed step is ever resumed from, and a
tracker that names anything else is an error naming the path, never a silent fresh start.
I2: a committed step newer than the tracker is rolled forward to. I3: start-up deletes
nothing.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from verl_ckpt import (
    CheckpointConfigError,
    CheckpointError,
    CommitRecordError,
    ResumeConflictError,
    TrackerError,
    prepare_start,
    resolve_resume_dir,
    to_checkpoint_config,
)
from verl_ckpt.store.commit_record import CommitRecord, is_committed, write_commit_record
from verl_ckpt.store.layout import list_step_dirs, step_dir
from verl_ckpt.store.recovery import read_root_state, recover_root
from verl_ckpt.store.tracker import read_tracker, tracker_path, write_tracker


def committed(root, step):
    path = step_dir(root, step)
    path.mkdir(parents=True)
    write_commit_record(path, CommitRecord(step, {"actor": 1}, []))
    return path


def cfg(root, **kw):
    return to_checkpoint_config({"root_dir": str(root), **kw})


def snapshot(root):
    """Every path under `root` with its size: what "nothing written or deleted" compares."""
    return sorted(
        (str(p.relative_to(root)), p.stat().st_size if p.is_file() else -1) for p in root.rglob("*")
    )


def test_I1_auto_without_any_checkpoint_starts_fresh(tmp_path):
    assert resolve_resume_dir(cfg(tmp_path / "never-created")) is None
    assert resolve_resume_dir(cfg(tmp_path)) is None
    assert not (tmp_path / "never-created").exists()


def test_I1_auto_resumes_from_the_trackers_committed_step(tmp_path):
    committed(tmp_path, 2)
    path = committed(tmp_path, 4)
    write_tracker(tmp_path, 4)
    assert resolve_resume_dir(cfg(tmp_path)) == path


def test_I1_tracker_naming_a_missing_step_is_an_error_naming_the_path(tmp_path):
    committed(tmp_path, 2)
    write_tracker(tmp_path, 9)
    with pytest.raises(TrackerError, match=r"names step 9, but .*global_step_9 does not exist"):
        resolve_resume_dir(cfg(tmp_path))


def test_I1_tracker_naming_an_uncommitted_step_is_an_error(tmp_path):
    step_dir(tmp_path, 3).mkdir(parents=True)
    write_tracker(tmp_path, 3)
    with pytest.raises(TrackerError, match="names step 3, which is unusable.*not a committed"):
        resolve_resume_dir(cfg(tmp_path))


def test_I2_committed_step_newer_than_the_tracker_is_rolled_forward(tmp_path):
    """A commit record newer than the tracker is a commit interrupted before the tracker
    moved (the finalizer or the whole job killed): start-up completes it."""
    committed(tmp_path, 30)
    newest = committed(tmp_path, 40)
    write_tracker(tmp_path, 30)
    assert resolve_resume_dir(cfg(tmp_path)) == newest
    assert read_tracker(tmp_path) == 30, "resolving alone must not write"
    plan = prepare_start(cfg(tmp_path))
    try:
        assert plan.resume_dir == newest and read_tracker(tmp_path) == 40
    finally:
        plan.release()


def test_I2_committed_steps_without_a_tracker_resume_from_the_newest(tmp_path):
    """The first commit of a root interrupted before its tracker existed."""
    committed(tmp_path, 2)
    newest = committed(tmp_path, 4)
    assert resolve_resume_dir(cfg(tmp_path)) == newest


def test_I1_only_uncommitted_leftovers_start_fresh_and_are_kept(tmp_path):
    step_dir(tmp_path, 2).mkdir(parents=True)
    plan = prepare_start(cfg(tmp_path))
    try:
        assert plan.resume_dir is None
        assert list(list_step_dirs(tmp_path)) == [2]  # start-up deletes nothing (I3)
    finally:
        plan.release()


def test_I1_corrupt_tracker_is_an_error(tmp_path):
    committed(tmp_path, 2)
    tracker_path(tmp_path).write_text("")
    with pytest.raises(TrackerError, match="latest_checkpointed_iteration.txt"):
        resolve_resume_dir(cfg(tmp_path))


def test_I1_resume_path_must_be_a_committed_step_directory(tmp_path):
    path = committed(tmp_path, 5)
    assert resolve_resume_dir(cfg(tmp_path, resume_mode="resume_path", resume_from_path=str(path)))
    with pytest.raises(CheckpointConfigError, match="is not a global_step_<N> directory"):
        resolve_resume_dir(cfg(tmp_path, resume_mode="resume_path", resume_from_path=str(tmp_path)))
    with pytest.raises(CheckpointConfigError, match="resume_from_path=.*global_step_7.*not exist"):
        resolve_resume_dir(
            cfg(tmp_path, resume_mode="resume_path", resume_from_path=str(step_dir(tmp_path, 7)))
        )
    step_dir(tmp_path, 6).mkdir()
    with pytest.raises(CommitRecordError, match="resume_from_path.*not a committed step"):
        resolve_resume_dir(
            cfg(tmp_path, resume_mode="resume_path", resume_from_path=str(step_dir(tmp_path, 6)))
        )


def test_I3_resuming_an_older_step_of_the_same_root_is_refused_and_nothing_changes(tmp_path):
    """Issue "Trust" #1 and #3: resume_path at step 30 of a root that committed step 40
    would collide with step 40 minutes later (and start-up retention used to delete step
    30 itself). Refused at start-up, naming the newer steps and both ways out; the root is
    byte for byte what it was."""
    old = committed(tmp_path, 30)
    committed(tmp_path, 40)
    write_tracker(tmp_path, 40)
    before = snapshot(tmp_path)
    config = cfg(tmp_path, resume_mode="resume_path", resume_from_path=str(old), max_ckpt_to_keep=1)
    with pytest.raises(ResumeConflictError) as failure:
        prepare_start(config)
    message = str(failure.value)
    assert "newer committed steps [40]" in message
    assert "new checkpoint.root_dir" in message
    assert f"verl-ckpt rollback {tmp_path} --to 30" in message
    assert snapshot(tmp_path) == before


def test_I3_resume_path_from_another_root_conflicts_only_with_newer_steps_here(tmp_path):
    elsewhere = committed(tmp_path / "pretrained", 30)
    here = tmp_path / "run"
    config = cfg(here, resume_mode="resume_path", resume_from_path=str(elsewhere))
    assert resolve_resume_dir(config) == elsewhere
    committed(here, 20)
    assert resolve_resume_dir(config) == elsewhere  # older steps here are fine
    committed(here, 50)
    with pytest.raises(ResumeConflictError, match=r"newer committed steps \[50\]"):
        resolve_resume_dir(config)


def test_I3_disable_in_a_root_with_committed_steps_is_refused(tmp_path):
    committed(tmp_path, 10)
    with pytest.raises(ResumeConflictError, match="resume_mode=disable.*resume_mode=auto"):
        resolve_resume_dir(cfg(tmp_path, resume_mode="disable"))
    assert resolve_resume_dir(cfg(tmp_path / "empty", resume_mode="disable")) is None


@pytest.mark.parametrize("mode", ["disable", "resume_path"])
def test_I1_a_tracker_naming_an_uncommitted_newer_step_is_refused_for_a_fresh_or_older_start(
    tmp_path, mode
):
    """A root whose tracker names a step without a commit record (a plain verl or Megatron
    save, or steps deleted by hand): a run that starts below that step would commit steps
    the tracker never moves to (it never moves backwards), so I1 would break and the next
    resume would fail. Refused at start-up, naming the tracker; nothing changes."""
    (step_dir(tmp_path, 40) / "actor").mkdir(parents=True)
    write_tracker(tmp_path, 40)
    other_root = tmp_path / "elsewhere"
    options = {"resume_mode": mode}
    if mode == "resume_path":
        options["resume_from_path"] = str(committed(other_root, 20))
    before = snapshot(tmp_path)
    with pytest.raises(
        ResumeConflictError, match=r"latest_checkpointed_iteration.txt names step 40"
    ):
        prepare_start(cfg(tmp_path, **options))
    assert snapshot(tmp_path) == before
    if mode == "resume_path":
        # From a step beyond it, the run's commits move the tracker past it: accepted.
        options["resume_from_path"] = str(committed(other_root, 50))
        prepare_start(cfg(tmp_path, **options)).release()


def test_root_dir_that_is_a_file_is_an_error_naming_the_key(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(CheckpointConfigError, match="checkpoint.root_dir=.*is not a directory"):
        resolve_resume_dir(cfg(tmp_path / "file"))
    with pytest.raises(CheckpointConfigError, match=r"checkpoint.root_dir=.*under .*file, a file"):
        resolve_resume_dir(cfg(tmp_path / "file" / "ckpt"))


def test_root_dir_with_a_path_component_too_long_is_an_error_naming_the_key(tmp_path):
    config = cfg(tmp_path / ("x" * 300) / "ckpt")
    with pytest.raises(CheckpointConfigError, match="checkpoint.root_dir=.*300 bytes, longer"):
        prepare_start(config)
    assert list(tmp_path.iterdir()) == []


def test_root_dir_that_is_a_step_directory_is_an_error(tmp_path):
    with pytest.raises(CheckpointConfigError, match="is a step directory"):
        resolve_resume_dir(cfg(step_dir(tmp_path, 3)))


def test_read_only_root_is_an_error_naming_the_key(tmp_path):
    read_only = tmp_path / "ro"
    read_only.mkdir()
    subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(read_only)], check=True
    )
    try:
        with pytest.raises(CheckpointConfigError, match="root_dir=.*ro/ckpt.*not writable"):
            prepare_start(cfg(read_only / "ckpt"))
    finally:
        subprocess.run(["umount", "-l", str(read_only)], check=False)


def test_I2_recovery_rolls_forward_and_deletes_nothing(tmp_path):
    committed(tmp_path, 1)
    committed(tmp_path, 2)
    step_dir(tmp_path, 3).mkdir()  # an uncommitted leftover
    (tmp_path / ".deleting_global_step_0").mkdir()  # a half-done retention
    stale = tmp_path / f".latest_checkpointed_iteration.txt.tmp.{os.getpid()}"
    stale.write_text("garbage")
    write_tracker(tmp_path, 1)
    state = recover_root(tmp_path)
    assert state.tracker == 2 and read_tracker(tmp_path) == 2
    assert state.committed == (1, 2) and state.uncommitted == (3,)
    assert (tmp_path / ".deleting_global_step_0").exists()  # left for the next retention
    assert not stale.exists()
    assert read_root_state(tmp_path) == state


_START_WHERE_NO_FILE_CAN_GROW = """
import resource, signal, sys
from verl_ckpt import CheckpointError
from verl_ckpt.startup.prepare import prepare_start
# A file that cannot grow, for real (what a full disk does to the lock's record): the
# process's file size limit at 0, its signal ignored so that write() fails with EFBIG.
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (0, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
try:
    prepare_start({"root_dir": sys.argv[1]})
except CheckpointError as exc:
    print("ERROR", exc)
"""


def test_a_start_on_a_root_where_no_file_can_grow_is_one_line_naming_the_file(tmp_path):
    """Start-up writes (the lock's record, a rolled-forward tracker, a quarantine): a full
    disk there was an OSError with a traceback. Now one CheckpointError line names the file
    and the cause; the committed step and the tracker are untouched."""
    root = tmp_path / "ckpt"
    committed(root, 30)
    write_tracker(root, 30)
    run = subprocess.run(
        [sys.executable, "-c", _START_WHERE_NO_FILE_CAN_GROW, str(root)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"},
    )
    assert run.returncode == 0 and "Traceback" not in run.stderr, run.stderr[-2000:]
    assert run.stdout.startswith("ERROR checkpoint start-up under "), run.stdout
    assert str(root / ".verl_ckpt.lock") in run.stdout, run.stdout
    assert "File too large" in run.stdout and run.stdout.count("\n") == 1, run.stdout
    assert read_tracker(root) == 30 and is_committed(step_dir(root, 30))


def test_a_resume_path_with_a_name_too_long_is_one_line_naming_it(tmp_path):
    """checkpoint.resume_from_path with a component longer than the filesystem allows was an
    OSError (ENAMETOOLONG) with a traceback from start-up's first look at it."""
    too_long = tmp_path / ("a" * 300) / "global_step_1"
    with pytest.raises(CheckpointError) as caught:
        prepare_start(
            cfg(tmp_path / "ckpt", resume_mode="resume_path", resume_from_path=str(too_long))
        )
    assert "a" * 40 in str(caught.value) and "\n" not in str(caught.value), caught.value
