"""Verified resume with fallback at start-up (`checkpoint.resume_verify`, `resume_fallback`;
protocol step 0, verl_ckpt/startup/resume_check.py), before Ray: real files on disk, real commit
records with real checksums, real damage (a flipped bit, a truncated file, a deleted file,
a corrupt record). No Ray and no megatron-core here: verification works on files; the
recipe tests (test_recipe_resume_check.py) run the same on real megatron-core shards.
"""

from __future__ import annotations

import logging
import os
import random
from pathlib import Path

import pytest

from verl_ckpt import (
    ResumeVerificationError,
    TrackerError,
    prepare_start,
    read_tracker,
    step_dir,
    verify_step,
)
from verl_ckpt.cli.main import main as verl_ckpt_cli
from verl_ckpt.startup.resume_check import QUARANTINE_DIRNAME, quarantine_step
from verl_ckpt.store.commit_record import (
    CommitRecord,
    FileEntry,
    committed_steps,
    read_commit_record,
    write_commit_record,
)
from verl_ckpt.store.fsio import file_checksum
from verl_ckpt.store.layout import COMMIT_RECORD_FILENAME, list_step_dirs
from verl_ckpt.store.recovery import recover_root
from verl_ckpt.store.retention import apply_retention
from verl_ckpt.store.tracker import write_tracker
from verl_ckpt.store.verification import available_cores

SHARD = "actor/__0_1.distcp"
FILES = ("actor/__0_0.distcp", SHARD, "actor/.metadata", "driver_state.pt")


def commit(root: Path, step: int) -> Path:
    """A committed step: real files of a few KiB, a record with their real checksums."""
    path = step_dir(root, step)
    rng = random.Random(step)
    entries = []
    for name in FILES:
        (path / name).parent.mkdir(parents=True, exist_ok=True)
        (path / name).write_bytes(rng.randbytes(3000 + 1000 * len(entries)))
        size, checksum = file_checksum(path / name)
        entries.append(FileEntry(name, size, checksum))
    write_commit_record(path, CommitRecord(step, {"actor": 1, "driver": 1}, entries))
    return path


def a_root(tmp_path: Path, steps=(2, 4)) -> Path:
    root = tmp_path / "ckpt"
    for step in steps:
        commit(root, step)
    write_tracker(root, steps[-1])
    return root


def flip_bit(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x04  # one bit, same size: only a checksum sees it
    path.write_bytes(data)


def truncate(path: Path) -> None:
    os.truncate(path, path.stat().st_size // 2)


def remove(path: Path) -> None:
    path.unlink()


def config(root: Path, **overrides) -> dict:
    return {"root_dir": str(root), **overrides}


def start(cfg: dict) -> Path | None:
    plan = prepare_start(cfg)
    plan.release()
    return plan.resume_dir


def snapshot(root: Path) -> list[tuple[str, int]]:
    """Every file and its size, but the root lock's record (start-up takes the lock)."""
    return sorted(
        (str(p.relative_to(root)), p.stat().st_size)
        for p in root.rglob("*")
        if p.is_file() and not p.name.startswith(".verl_ckpt.lock")
    )


def quarantined(root: Path) -> list[str]:
    folder = root / QUARANTINE_DIRNAME
    return sorted(p.name.split(".")[0] for p in folder.iterdir()) if folder.exists() else []


# ---- fallback ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("damage", "mode"),
    [(flip_bit, "checksums"), (truncate, "record"), (remove, "record"), (truncate, "checksums")],
    ids=["bit_flip-checksums", "truncated-record", "missing-record", "truncated-checksums"],
)
def test_I1_previous_quarantines_the_failing_step_and_resumes_from_the_older_one(
    tmp_path, caplog, damage, mode
):
    """The damaged resume step leaves the step namespace into quarantine/ (renamed, bytes
    untouched), the tracker moves back to step 2, the run resumes from it, and one warning
    names the bad file."""
    root = a_root(tmp_path)
    bad = step_dir(root, 4) / SHARD
    damage(bad)
    kept = sorted(p.name for p in step_dir(root, 4).rglob("*"))
    caplog.set_level(logging.WARNING, logger="verl_ckpt.startup.resume_check")
    resume = start(config(root, resume_verify=mode, resume_fallback="previous"))
    assert resume == step_dir(root, 2)
    assert read_tracker(root) == 2
    assert sorted(list_step_dirs(root)) == [2]
    assert quarantined(root) == ["global_step_4"]
    moved = next((root / QUARANTINE_DIRNAME).iterdir())
    assert sorted(p.name for p in moved.rglob("*")) == kept, "quarantine changed the step"
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and str(bad) in warnings[0], warnings
    assert "resuming from step 2" in warnings[0] and str(moved) in warnings[0]


@pytest.mark.parametrize(
    ("damage", "mode", "reason"),
    [
        (flip_bit, "checksums", "checksum "),
        (truncate, "record", "size "),
        (remove, "record", "missing"),
    ],
    ids=["bit_flip", "truncated", "missing"],
)
def test_I1_error_is_one_line_naming_the_file_and_changes_nothing(tmp_path, damage, mode, reason):
    root = a_root(tmp_path)
    damage(step_dir(root, 4) / SHARD)
    before = snapshot(root)
    with pytest.raises(ResumeVerificationError) as failure:
        start(config(root, resume_verify=mode))
    message = str(failure.value)
    assert "\n" not in message
    assert f"{step_dir(root, 4) / SHARD}: {reason}" in message, message
    assert "checkpoint.resume_fallback=previous" in message
    assert snapshot(root) == before and read_tracker(root) == 4


def test_record_mode_reads_no_bytes_so_a_bit_flip_needs_checksums(tmp_path):
    """The default (`record`) only stats files: a flipped bit, same size, passes; that is what
    resume_verify=checksums is for."""
    root = a_root(tmp_path)
    flip_bit(step_dir(root, 4) / SHARD)
    assert start(config(root)) == step_dir(root, 4)
    with pytest.raises(ResumeVerificationError, match="checksum"):
        start(config(root, resume_verify="checksums"))


def test_I1_every_newer_failing_step_is_quarantined_down_to_one_that_verifies(tmp_path, caplog):
    root = a_root(tmp_path, steps=(2, 4, 6))
    flip_bit(step_dir(root, 6) / SHARD)
    remove(step_dir(root, 4) / "driver_state.pt")
    caplog.set_level(logging.WARNING, logger="verl_ckpt.startup.resume_check")
    resume = start(config(root, resume_verify="checksums", resume_fallback="previous"))
    assert resume == step_dir(root, 2) and read_tracker(root) == 2
    assert quarantined(root) == ["global_step_4", "global_step_6"]
    (warning,) = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert str(step_dir(root, 6) / SHARD) in warning
    assert f"{step_dir(root, 4) / 'driver_state.pt'}: missing" in warning


def test_I1_no_step_that_verifies_is_an_error_and_nothing_moves(tmp_path):
    root = a_root(tmp_path)
    for step in (2, 4):
        truncate(step_dir(root, step) / SHARD)
    before = snapshot(root)
    with pytest.raises(ResumeVerificationError, match="no committed step") as failure:
        start(config(root, resume_fallback="previous"))
    assert str(step_dir(root, 4) / SHARD) in str(failure.value)
    assert snapshot(root) == before and read_tracker(root) == 4


def _corrupt_record(path: Path) -> None:
    (path / COMMIT_RECORD_FILENAME).write_text("{not json")


def _no_record(path: Path) -> None:
    (path / COMMIT_RECORD_FILENAME).unlink()


@pytest.mark.parametrize("damage", [_corrupt_record, _no_record], ids=["corrupt", "missing"])
def test_I1_tracker_naming_a_step_with_an_unusable_record_falls_back_too(tmp_path, damage):
    """A corrupt or missing commit record of the tracker's step: `error` keeps today's error
    (TrackerError naming the tracker), `previous` quarantines the step and falls back."""
    root = a_root(tmp_path)
    damage(step_dir(root, 4))
    with pytest.raises(TrackerError, match="names step 4"):
        start(config(root))
    assert start(config(root, resume_fallback="previous")) == step_dir(root, 2)
    assert quarantined(root) == ["global_step_4"] and read_tracker(root) == 2


def test_I2_a_crash_between_quarantine_and_tracker_is_completed_by_the_next_start(tmp_path):
    """The fallback renames first, then moves the tracker. Killed in between, the tracker
    names a step that left the namespace: the next start with `previous` falls back the same
    way; with `error` it says the step is missing (the quarantine still holds it)."""
    root = a_root(tmp_path)
    quarantine_step(root, 4)  # the rename, durable; the tracker still names 4
    with pytest.raises(TrackerError, match="does not exist"):
        start(config(root))
    assert start(config(root, resume_fallback="previous")) == step_dir(root, 2)
    assert read_tracker(root) == 2 and quarantined(root) == ["global_step_4"]


def test_I2_I3_recovery_and_retention_never_see_a_quarantined_step(tmp_path):
    """After a fallback to step 2, recovery's roll-forward (every job and finalizer start)
    keeps the tracker at 2, retention counts and deletes only steps in the namespace, and the
    quarantined step stays byte for byte."""
    root = a_root(tmp_path, steps=(1, 2, 4))
    flip_bit(step_dir(root, 4) / SHARD)
    start(config(root, resume_verify="checksums", resume_fallback="previous"))
    moved = next((root / QUARANTINE_DIRNAME).iterdir())
    content = snapshot(moved)
    assert recover_root(root).tracker == 2 and committed_steps(root) == [1, 2]
    commit(root, 3)  # the resumed run's next commit
    write_tracker(root, 3)
    outcome = apply_retention(root, keep=1)
    assert outcome.deleted == [1, 2] and not outcome.errors
    assert snapshot(moved) == content and read_commit_record(moved).step == 4


def test_resume_path_is_never_replaced_by_another_step(tmp_path):
    """A step the user named explicitly fails with an error even with `previous`."""
    root = a_root(tmp_path)
    truncate(step_dir(root, 4) / SHARD)
    cfg = config(
        root,
        resume_mode="resume_path",
        resume_from_path=str(step_dir(root, 4)),
        resume_fallback="previous",
    )
    with pytest.raises(ResumeVerificationError, match="never replaced") as failure:
        start(cfg)
    assert str(step_dir(root, 4) / SHARD) in str(failure.value)
    assert not (root / QUARANTINE_DIRNAME).exists() and read_tracker(root) == 4


def test_quarantining_the_same_step_twice_keeps_both(tmp_path):
    root = a_root(tmp_path)
    first = quarantine_step(root, 4)
    commit(root, 4)
    second = quarantine_step(root, 4)
    assert first != second and first.is_dir() and second.is_dir()


def test_ls_lists_quarantined_steps(tmp_path, capsys):
    root = a_root(tmp_path)
    moved = quarantine_step(root, 4)
    write_tracker(root, 2)
    assert verl_ckpt_cli(["ls", str(root)]) == 0
    assert f"quarantined {moved}: failed verification" in capsys.readouterr().out


# ---- parallel verification -----------------------------------------------------------------


def test_verify_step_uses_every_core_and_agrees_with_one_thread(tmp_path):
    root = a_root(tmp_path)
    path = step_dir(root, 4)
    record = read_commit_record(path)
    truncate(path / FILES[0])
    flip_bit(path / SHARD)
    parallel = verify_step(path, record)
    single = verify_step(path, record, threads=1)
    assert parallel.threads == min(available_cores(), len(FILES)) and single.threads == 1
    assert parallel.problems == single.problems
    assert [p.path.name for p in parallel.problems] == ["__0_0.distcp", "__0_1.distcp"]
    assert parallel.bytes_read == sum(f.size for f in record.files) - (
        record.files[0].size - (path / FILES[0]).stat().st_size
    )
    assert parallel.gb_per_s > 0


def test_verify_step_reports_an_unreadable_file_instead_of_raising(tmp_path):
    root = a_root(tmp_path)
    path = step_dir(root, 4)
    record = read_commit_record(path)
    (path / SHARD).unlink()
    (path / SHARD).mkdir()  # a directory where the shard was
    (problem,) = verify_step(path, record).problems
    assert problem.path == path / SHARD and problem.reason.startswith("unreadable")
