"""Protocol steps 5-7 (verl_ckpt/commit/steps.py) as plain functions on a temporary root: the
commit record, the tracker, retention. No Ray; the driver is the only participant, so no
megatron-core directory needs completing."""

from __future__ import annotations

import errno
import os
import subprocess
from pathlib import Path

import pytest

from verl_ckpt.commit.steps import commit_step, discard_failed_steps, reported_files_problem
from verl_ckpt.protocol import Phase
from verl_ckpt.protocol.faults import ENV_VAR
from verl_ckpt.protocol.messages import RankReport
from verl_ckpt.store import fsio
from verl_ckpt.store import local as commit_module
from verl_ckpt.store.checksummed_file import write_checksummed
from verl_ckpt.store.commit_record import CommitRecord, FileEntry, is_committed, write_commit_record
from verl_ckpt.store.layout import (
    COMMIT_RECORD_FILENAME,
    DRIVER_STATE_FILENAME,
    list_step_dirs,
    step_dir,
)
from verl_ckpt.store.retention import apply_retention
from verl_ckpt.store.tracker import (
    CommitPhaseError,
    advance_tracker,
    read_tracker,
    tracker_path,
    write_tracker,
)

DRIVER_ONLY = {"driver": 1}


def driver_report(root: Path, step: int) -> RankReport:
    path = step_dir(root, step)
    path.mkdir(parents=True)
    written = write_checksummed(path / DRIVER_STATE_FILENAME, lambda s: s.write(b"state"))
    entry = FileEntry(DRIVER_STATE_FILENAME, written.size, written.checksum)
    return RankReport(step, "driver", 0, 1, "save", files=[entry])


def committed(root: Path, step: int) -> None:
    path = step_dir(root, step)
    path.mkdir(parents=True)
    write_commit_record(path, CommitRecord(step, DRIVER_ONLY, []))


def test_I1_commit_writes_the_record_then_moves_the_tracker(tmp_path):
    summary = commit_step(tmp_path, 3, DRIVER_ONLY, [driver_report(tmp_path, 3)])
    assert is_committed(step_dir(tmp_path, 3)) and read_tracker(tmp_path) == 3
    assert (summary.step, summary.files, summary.bytes, summary.tracker) == (3, 1, 5, 3)


def test_I1_a_reported_file_of_the_wrong_size_fails_before_the_record(tmp_path):
    report = driver_report(tmp_path, 1)
    (step_dir(tmp_path, 1) / DRIVER_STATE_FILENAME).write_bytes(b"torn")
    with pytest.raises(CommitPhaseError, match="reported by driver rank 0 with 5 bytes, found 4"):
        commit_step(tmp_path, 1, DRIVER_ONLY, [report])
    assert not is_committed(step_dir(tmp_path, 1)) and read_tracker(tmp_path) is None


def test_I1_a_problem_found_when_the_report_arrived_fails_the_commit(tmp_path):
    """The finalizer checks a report's files when it arrives (RankReport.files_on_arrival);
    the commit takes that outcome instead of checking again."""
    report = driver_report(tmp_path, 1)
    report.files_on_arrival = "state.pt: reported by driver rank 0 with 5 bytes, found 4"
    with pytest.raises(CommitPhaseError, match="with 5 bytes, found 4"):
        commit_step(tmp_path, 1, DRIVER_ONLY, [report])
    assert not is_committed(step_dir(tmp_path, 1)) and read_tracker(tmp_path) is None


def test_I1_a_reported_absolute_path_is_checked_under_the_step_not_where_it_points(tmp_path):
    """A report naming an absolute path (a rank's bug) names no file of the step: it is
    looked for under the step directory, not at that path, even where a file of the reported
    size exists there."""
    elsewhere = tmp_path / "elsewhere.bin"
    elsewhere.write_bytes(b"12345")
    report = driver_report(tmp_path / "root", 1)
    report.files = [FileEntry(str(elsewhere), 5, report.files[0].checksum)]
    problem = reported_files_problem(step_dir(tmp_path / "root", 1), report)
    assert problem.startswith(f"{step_dir(tmp_path / 'root', 1)}/") and "found no file" in problem


def test_I1_a_reported_file_replaced_by_a_link_fails_before_the_record(tmp_path):
    """A reported file that is now a symbolic link (planted by whoever else can write the
    root, to a file of the reported size) is not the rank's file: the commit names it and
    writes no record, as verification would later refuse the link (store/verification.py),
    instead of committing a step that no resume can use."""
    report = driver_report(tmp_path / "root", 1)
    reported = step_dir(tmp_path / "root", 1) / DRIVER_STATE_FILENAME
    elsewhere = tmp_path / "elsewhere.bin"
    elsewhere.write_bytes(b"state")  # the reported size
    reported.unlink()
    reported.symlink_to(elsewhere)
    with pytest.raises(CommitPhaseError, match=f"{reported}: .* found not a regular file"):
        commit_step(tmp_path / "root", 1, DRIVER_ONLY, [report])
    assert not is_committed(step_dir(tmp_path / "root", 1))
    assert read_tracker(tmp_path / "root") is None


def test_I1_a_declared_participants_directory_is_durable_before_the_record(tmp_path, monkeypatch):
    """Found by review: the commit synced each role's directory (with its .metadata) and the
    step's, never a declared participant's (`replay/`, files only): a crash after the commit
    could keep the record and lose the entry of `replay/state_0.pt`, a committed step that
    cannot be loaded. A crash cannot be produced here: the directory syncs are observed."""
    synced = []
    real_fsync_dir = fsio.fsync_dir

    def observed(path):
        synced.append((Path(path), is_committed(step_dir(tmp_path, 5))))
        real_fsync_dir(path)

    monkeypatch.setattr(commit_module, "fsync_dir", observed)
    reports = [driver_report(tmp_path, 5)]
    replay = step_dir(tmp_path, 5) / "replay"
    replay.mkdir()
    written = write_checksummed(replay / "state_0.pt", lambda s: s.write(b"replay"))
    entry = FileEntry("replay/state_0.pt", written.size, written.checksum)
    reports.append(RankReport(5, "replay", 0, 1, "save", files=[entry]))
    commit_step(tmp_path, 5, DRIVER_ONLY, reports, state_participants={"replay": 1})
    assert (replay, False) in synced, synced
    assert read_tracker(tmp_path) == 5


def test_I2_the_tracker_never_moves_backwards(tmp_path):
    commit_step(tmp_path, 5, DRIVER_ONLY, [driver_report(tmp_path, 5)])
    summary = commit_step(tmp_path, 4, DRIVER_ONLY, [driver_report(tmp_path, 4)])
    assert summary.tracker == 5 and read_tracker(tmp_path) == 5
    assert is_committed(step_dir(tmp_path, 4))


def test_I1_I2_a_tracker_write_failing_before_its_rename_withdraws_the_record(
    tmp_path, monkeypatch
):
    """ENOSPC exactly while the tracker's temporary file is written (the documented fault
    hook places it there; no real disk fills at that instant): the tracker is unchanged, and
    the step must not stay committed on disk either, since the commit is reported failed."""
    commit_step(tmp_path, 1, DRIVER_ONLY, [driver_report(tmp_path, 1)])
    monkeypatch.setenv(ENV_VAR, "tracker=enospc")
    with pytest.raises(CommitPhaseError) as failure:
        commit_step(tmp_path, 2, DRIVER_ONLY, [driver_report(tmp_path, 2)])
    assert failure.value.phase is Phase.TRACKER and failure.value.errno == errno.ENOSPC
    assert read_tracker(tmp_path) == 1
    assert not is_committed(step_dir(tmp_path, 2))


def test_I1_a_withdrawn_record_whose_directory_fsync_fails_is_still_no_commit(
    tmp_path, monkeypatch
):
    """ENOSPC on the tracker's temporary file (the fault hook), then EIO on the step
    directory's fsync once the record is unlinked again. Readers no longer see the record:
    the commit must be reported failed. It was reported done (the withdrawal counted as
    failed, so the step "stayed committed") while no record was left. A failing directory
    fsync cannot be produced for real here (it needs a failing device): injected."""
    real_fsync_dir = fsio.fsync_dir
    step_path = step_dir(tmp_path, 2)
    calls = []

    def fsync_dir_failing_after_the_withdrawal(path):
        # commit.py fsyncs the step directory twice here: before the record is written,
        # then after it is unlinked again (the withdrawal); the second one fails.
        if Path(path) == step_path:
            calls.append(path)
            if len(calls) == 2:
                raise OSError(errno.EIO, "Input/output error")
        real_fsync_dir(path)

    commit_step(tmp_path, 1, DRIVER_ONLY, [driver_report(tmp_path, 1)])
    monkeypatch.setattr(commit_module, "fsync_dir", fsync_dir_failing_after_the_withdrawal)
    monkeypatch.setenv(ENV_VAR, "tracker=enospc")
    with pytest.raises(CommitPhaseError) as failure:
        commit_step(tmp_path, 2, DRIVER_ONLY, [driver_report(tmp_path, 2)])
    assert len(calls) == 2, "the injected fault never fired"
    assert failure.value.phase is Phase.TRACKER
    assert read_tracker(tmp_path) == 1 and not is_committed(step_path)


def test_I2_nothing_uncommits_a_step_once_the_tracker_was_renamed(tmp_path, monkeypatch):
    """Issue "Trust": an error from the directory fsync after the tracker's rename used to
    reach the un-commit path, leaving the tracker naming a step without a record. A failing
    directory fsync cannot be produced for real here (it needs a failing device), so this
    test injects it: the fsync of the root after the rename raises EIO."""
    real_fsync_dir = fsio.fsync_dir
    tracker_renamed = []

    def fsync_dir_failing_after_rename(path):
        if Path(path) == tmp_path and (tmp_path / "latest_checkpointed_iteration.txt").exists():
            tracker_renamed.append(path)
            raise OSError(errno.EIO, "Input/output error")
        real_fsync_dir(path)

    monkeypatch.setattr(fsio, "fsync_dir", fsync_dir_failing_after_rename)
    summary = commit_step(tmp_path, 1, DRIVER_ONLY, [driver_report(tmp_path, 1)])
    assert tracker_renamed, "the injected fault never fired"
    assert summary.tracker == 1 and read_tracker(tmp_path) == 1
    assert is_committed(step_dir(tmp_path, 1))


@pytest.mark.parametrize("unlink", ["works", "fails"])
def test_I1_a_record_renamed_in_place_but_not_made_durable_is_withdrawn_or_kept_committed(
    tmp_path, monkeypatch, unlink
):
    """The commit record's rename happened (readers see the step committed), then the step
    directory's fsync failed. It used to be reported as a failed commit while the record
    stayed: the user told "step 1 will not commit" resumed from it at the next start. Now the
    record is withdrawn, so that disk and the reported failure agree, or, where even its
    unlink fails, the commit goes on and the tracker names it. A failing directory fsync and
    a failing unlink cannot be produced for real here (they need a failing device):
    injected, EIO on the fsync while the record exists, EIO on the record's unlink."""
    real_fsync_dir, real_unlink = fsio.fsync_dir, os.unlink
    step_path = step_dir(tmp_path, 1)
    failures = []

    def fsync_dir_failing_while_the_record_exists(path):
        if Path(path) == step_path and (step_path / COMMIT_RECORD_FILENAME).exists():
            failures.append(path)
            raise OSError(errno.EIO, "Input/output error")
        real_fsync_dir(path)

    def unlink_failing_for_the_record(path, *, dir_fd=None):
        # The store removes a file by name in its directory, held by descriptor.
        at = Path(os.readlink(f"/proc/self/fd/{dir_fd}")) / path if dir_fd is not None else path
        if unlink == "fails" and at == step_path / COMMIT_RECORD_FILENAME:
            raise OSError(errno.EIO, "Input/output error")
        real_unlink(path, dir_fd=dir_fd)

    monkeypatch.setattr(fsio, "fsync_dir", fsync_dir_failing_while_the_record_exists)
    monkeypatch.setattr(commit_module, "fsync_dir", fsync_dir_failing_while_the_record_exists)
    monkeypatch.setattr(os, "unlink", unlink_failing_for_the_record)
    report = driver_report(tmp_path, 1)
    if unlink == "works":
        with pytest.raises(CommitPhaseError, match="Input/output error"):
            commit_step(tmp_path, 1, DRIVER_ONLY, [report])
        assert not is_committed(step_path) and not tracker_path(tmp_path).exists()
    else:
        summary = commit_step(tmp_path, 1, DRIVER_ONLY, [report])
        assert is_committed(step_path) and summary.tracker == 1 == read_tracker(tmp_path)
    assert failures


def test_I2_advance_tracker_replaces_an_unreadable_tracker(tmp_path):
    committed(tmp_path, 2)
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("garbage")
    assert advance_tracker(tmp_path, 2) == 2 and read_tracker(tmp_path) == 2


def test_I3_retention_keeps_the_newest_and_the_tracker_target_and_protected(tmp_path):
    for step in (1, 2, 3, 4, 5):
        committed(tmp_path, step)
    step_dir(tmp_path, 6).mkdir()  # uncommitted: never counted, never deleted
    write_tracker(tmp_path, 2)  # a tracker behind (a rollback in progress, say)
    outcome = apply_retention(tmp_path, keep=2, protected=[3])
    assert outcome.deleted == [1] and outcome.errors == []
    assert sorted(list_step_dirs(tmp_path)) == [2, 3, 4, 5, 6]


def test_I3_retention_failure_is_collected_not_raised_and_the_next_retention_finishes(tmp_path):
    """A real failure: an immutable file (chattr +i) cannot be removed even by root."""
    committed(tmp_path, 1)
    committed(tmp_path, 2)
    write_tracker(tmp_path, 2)
    pinned = step_dir(tmp_path, 1) / "pinned"
    pinned.write_bytes(b"x")
    subprocess.run(["chattr", "+i", str(pinned)], check=True)
    try:
        outcome = apply_retention(tmp_path, keep=1)
        assert outcome.deleted == [] and len(outcome.errors) == 1
        assert "Operation not permitted" in outcome.errors[0]
        # Out of the step namespace (never loadable), its record gone, its files left over.
        assert sorted(list_step_dirs(tmp_path)) == [2]
        leftover = tmp_path / ".deleting_global_step_1"
        assert leftover.is_dir() and not (leftover / "verl_ckpt_commit.json").exists()
    finally:
        subprocess.run(["chattr", "-i", str(tmp_path / ".deleting_global_step_1" / "pinned")])
    outcome = apply_retention(tmp_path, keep=1)
    assert outcome.purged == [".deleting_global_step_1"] and outcome.errors == []


def test_I1_I3_a_failed_step_is_deleted_but_never_one_holding_a_commit_record(tmp_path):
    """The finalizer deletes failed steps' directories; a commit whose record could not be
    withdrawn is committed whatever the ledger says (the next start rolls forward to it)."""
    failed = step_dir(tmp_path, 3)
    (failed / "actor").mkdir(parents=True)
    (failed / "actor" / "__0_0.distcp").write_bytes(b"partial")
    kept = step_dir(tmp_path, 4)
    kept.mkdir()
    (kept / COMMIT_RECORD_FILENAME).write_bytes(b"{")  # even unreadable: left alone
    assert discard_failed_steps(tmp_path, [3, 4, 5]) == []  # 5: never created, no error
    assert sorted(list_step_dirs(tmp_path)) == [4]
    assert not list(tmp_path.glob(".deleting_*"))
