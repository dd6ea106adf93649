"""Resume resolution (resume_mode auto | disable | resume_path) over real directories.

Invariant I1 from the reader's side: only a committed step is ever resumed from, and a
tracker that names anything else is an error naming the path, never a silent fresh start.
"""

from __future__ import annotations

import pytest

from verl_ckpt import CommitRecordError, TrackerError, resolve_resume_dir, to_checkpoint_config
from verl_ckpt.commit_record import CommitRecord, write_commit_record
from verl_ckpt.layout import step_dir
from verl_ckpt.tracker import tracker_path, write_tracker


def committed(root, step):
    path = step_dir(root, step)
    path.mkdir(parents=True)
    write_commit_record(path, CommitRecord(step, {"actor": 1}, []))
    return path


def cfg(root, **kw):
    return to_checkpoint_config({"root_dir": str(root), **kw})


def test_I1_auto_without_any_checkpoint_starts_fresh(tmp_path):
    assert resolve_resume_dir(cfg(tmp_path / "never-created")) is None
    assert resolve_resume_dir(cfg(tmp_path)) is None


def test_I1_auto_resumes_from_the_trackers_committed_step(tmp_path):
    committed(tmp_path, 2)
    path = committed(tmp_path, 4)
    write_tracker(tmp_path, 4)
    assert resolve_resume_dir(cfg(tmp_path)) == path
    assert resolve_resume_dir(cfg(tmp_path, resume_mode="disable")) is None


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


def test_I1_step_dirs_without_tracker_are_not_a_silent_fresh_start(tmp_path):
    committed(tmp_path, 2)
    with pytest.raises(TrackerError, match="missing but .* holds step directories"):
        resolve_resume_dir(cfg(tmp_path))


def test_I1_corrupt_tracker_is_an_error(tmp_path):
    committed(tmp_path, 2)
    tracker_path(tmp_path).write_text("")
    with pytest.raises(TrackerError, match="latest_checkpointed_iteration.txt"):
        resolve_resume_dir(cfg(tmp_path))


def test_I1_resume_path_must_be_a_committed_step_directory(tmp_path):
    path = committed(tmp_path, 5)
    assert resolve_resume_dir(cfg(tmp_path, resume_mode="resume_path", resume_from_path=str(path)))
    with pytest.raises(CommitRecordError, match="is not a global_step_<N> directory"):
        resolve_resume_dir(cfg(tmp_path, resume_mode="resume_path", resume_from_path=str(tmp_path)))
    step_dir(tmp_path, 6).mkdir()
    with pytest.raises(CommitRecordError, match="not a committed step"):
        resolve_resume_dir(
            cfg(tmp_path, resume_mode="resume_path", resume_from_path=str(step_dir(tmp_path, 6)))
        )


def test_root_dir_that_is_a_file_is_an_error(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(TrackerError, match="not a directory"):
        resolve_resume_dir(cfg(tmp_path / "file"))
