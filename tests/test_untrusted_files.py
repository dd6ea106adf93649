"""A root (or a bucket) that others can write (issue 45 items 3 and 6): files the project
creates cannot be redirected by a planted link; names read from a record are checked by the
one validator (store/layout.py relative_path_problem) before anything is opened; names are
printed escaped; records are read only up to a bound, and only from regular files; a
download reads exactly the recorded size.

Every test plants what an attacker would, with a timeout: a FIFO or /dev/zero named by a
record must be refused, never waited on.
"""

from __future__ import annotations

import json
import os
import re
import stat
import threading
import time
from dataclasses import replace
from pathlib import Path

import pytest

from verl_ckpt.cli.main import main
from verl_ckpt.cli.output import escaped, print_table
from verl_ckpt.hf.record import (
    EXPORT_FORMAT_VERSION,
    EXPORT_RECORD_FILENAME,
    ExportRecord,
    verify_export,
    write_export_record,
)
from verl_ckpt.protocol.errors import CheckpointError, CommitRecordError, TrackerError
from verl_ckpt.protocol.faults import ENV_VAR
from verl_ckpt.remote.pull import pull_step
from verl_ckpt.store.checksummed_file import write_checksummed
from verl_ckpt.store.commit_record import (
    COMMIT_RECORD_MAX_BYTES,
    CommitRecord,
    FileEntry,
    read_commit_record,
    write_commit_record,
)
from verl_ckpt.store.fsio import (
    DIR_MODE,
    FILE_MODE,
    WriteOptions,
    atomic_write_bytes,
    file_checksum,
    make_dir,
    remove_stale_temporaries,
    temporary_name,
)
from verl_ckpt.store.fsspec_store import FsspecStore
from verl_ckpt.store.layout import (
    COMMIT_RECORD_FILENAME,
    TRACKER_FILENAME,
    relative_path_problem,
    step_dir,
)
from verl_ckpt.store.local import LocalStore
from verl_ckpt.store.recovery import recover_root
from verl_ckpt.store.retention import delete_step
from verl_ckpt.store.rollback import ROLLED_BACK_FILENAME, RollbackError, read_rolled_back
from verl_ckpt.store.tracker import read_tracker, write_tracker
from verl_ckpt.store.verification import check_step_files

ESCAPE = "\x1b[2J"
PRECIOUS = b"precious\n"


@pytest.fixture(autouse=True)
def _usual_umask():
    # Modes are checked under the usual umask: the project's own mode must be what shows.
    old = os.umask(0o022)
    yield
    os.umask(old)


def committed_step(root: Path, step: int) -> CommitRecord:
    """A local committed step: two files of some bytes and their commit record."""
    path = step_dir(root, step)
    files = []
    for rel, size in (("actor/__0_0.distcp", 3000), ("driver_state.pt", 10)):
        (path / rel).parent.mkdir(parents=True, exist_ok=True)
        (path / rel).write_bytes(bytes((step + i) % 251 for i in range(size)))
        files.append(FileEntry(rel, *file_checksum(path / rel)))
    record = CommitRecord(step=step, participants={"actor": 1, "driver": 1}, files=files)
    write_commit_record(path, record)
    write_tracker(root, step)
    return record


def plant_record(path: Path, record: CommitRecord) -> None:
    """Write `record` as the step's commit record, as anyone could (matching checksums)."""
    write_commit_record(path, record)


def outside_file(tmp_path: Path) -> tuple[Path, FileEntry]:
    """A file outside the root, and an entry whose size and checksum match it: were it read,
    a check would pass."""
    victim = tmp_path / "outside.bin"
    victim.write_bytes(PRECIOUS)
    return victim, FileEntry("x", *file_checksum(victim))


def cli(capsys, *argv) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def one_line_naming(err: str, *parts: str) -> None:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    for part in parts:
        assert part in lines[0], (part, err)
    assert "\x1b" not in err


# ---- files that cannot be redirected --------------------------------------------------------


@pytest.mark.timeout(30)
def test_a_link_planted_at_the_old_temporary_name_of_the_tracker_is_not_followed(tmp_path):
    """Before: the tracker's temporary was `.<name>.tmp.<pid>`, opened with open("wb"): a
    link planted there made the next write truncate and fill the file it names."""
    root = tmp_path / "ckpt"
    root.mkdir()
    victim = tmp_path / "victim.txt"
    victim.write_bytes(PRECIOUS)
    (root / f".{TRACKER_FILENAME}.tmp.{os.getpid()}").symlink_to(victim)
    write_tracker(root, 7)
    assert victim.read_bytes() == PRECIOUS
    assert read_tracker(root) == 7
    assert not (root / TRACKER_FILENAME).is_symlink()


@pytest.mark.timeout(30)
def test_a_link_planted_where_a_published_file_goes_is_not_followed(tmp_path):
    """A download's temporary file (LocalStore.open_publish) is created new, under a random
    name: links planted at the old predictable names are left alone."""
    victim = tmp_path / "victim.txt"
    victim.write_bytes(PRECIOUS)
    target = tmp_path / "root" / "global_step_1" / "a.bin"
    target.parent.mkdir(parents=True)
    for tag in (f"{os.getpid()}", f"{os.getpid()}.{__import__('threading').get_ident()}"):
        (target.parent / f".a.bin.tmp.{tag}").symlink_to(victim)
    publisher = LocalStore(tmp_path / "root").open_publish("global_step_1/a.bin", 3, 1 << 20)
    publisher.write(b"new")
    publisher.publish()
    assert target.read_bytes() == b"new"
    assert victim.read_bytes() == PRECIOUS


@pytest.mark.timeout(30)
def test_a_link_planted_at_a_rank_file_is_not_followed(tmp_path):
    """A rank's file is opened in place O_NOFOLLOW: a link in its place is an error naming
    the file, and the file it names is untouched."""
    victim = tmp_path / "victim.txt"
    victim.write_bytes(PRECIOUS)
    path = tmp_path / "__0_0.distcp"
    path.symlink_to(victim)
    with pytest.raises(OSError, match="__0_0.distcp"):
        write_checksummed(path, lambda stream: stream.write(b"rank bytes"))
    assert victim.read_bytes() == PRECIOUS


def swap_for_a_link(path: Path, to: Path) -> None:
    """What a writer of the root does between two calls: the directory moves away, and a link
    to anywhere takes its name."""
    os.rename(path, path.with_name(f"{path.name}.moved"))
    path.symlink_to(to)


@pytest.mark.timeout(30)
def test_a_pulled_step_is_never_written_through_a_staging_directory_swapped_for_a_link(
    tmp_path, monkeypatch
):
    """Found by review: a pull writes its step into `.pulling_global_step_<N>/` for the whole
    download, each file by a path whose directories were followed: swapped for a link to a
    home directory, it had a planted record's `.bashrc` written there. Now every name below
    the root is reached without following a link, and the download fails. The swap is placed
    right before the copy (the pull has no pause of its own to race with)."""
    from verl_ckpt.remote import pull as pull_module

    home = tmp_path / "home"
    home.mkdir()
    (home / ".bashrc").write_bytes(PRECIOUS)
    bucket = tmp_path / "bucket"
    step = step_dir(bucket, 7)
    step.mkdir(parents=True)
    payload = b"echo pwned\n"
    (step / ".bashrc").write_bytes(payload)
    entry = FileEntry(".bashrc", *file_checksum(step / ".bashrc"))
    write_commit_record(step, CommitRecord(7, {"driver": 1}, [entry]))
    real_copy = pull_module.copy_files

    def copy_after_the_swap(dest, *args, **kwargs):
        swap_for_a_link(Path(dest), home)
        return real_copy(dest, *args, **kwargs)

    monkeypatch.setattr(pull_module, "copy_files", copy_after_the_swap)
    root = tmp_path / "root"
    with pytest.raises(Exception, match="not followed"):
        pull_step(LocalStore(bucket), 7, root, 2, 20)
    assert (home / ".bashrc").read_bytes() == PRECIOUS
    assert sorted(p.name for p in home.iterdir()) == [".bashrc"]
    assert not step_dir(root, 7).exists()


@pytest.mark.timeout(30)
def test_a_staging_directory_replaced_before_its_install_is_not_installed(tmp_path):
    """The staged step takes its step name by one rename of whatever is at the staging name:
    a directory (or a link) put there by a writer of the root after the download is not
    installed as the pulled step; it goes again, and the pull fails."""
    from verl_ckpt.remote.pull import install_staged, stage_step

    bucket = tmp_path / "bucket"
    committed_step(bucket, 4)
    root = tmp_path / "root"
    root.mkdir()
    staged = stage_step(LocalStore(bucket), 4, root, 2, 20)
    planted = tmp_path / "planted"
    planted.mkdir()
    swap_for_a_link(staged.staging, planted)
    with pytest.raises(CheckpointError, match="was replaced while step 4 was pulled"):
        install_staged(staged)
    assert not os.path.lexists(step_dir(root, 4))
    assert planted.is_dir()


@pytest.mark.timeout(30)
def test_retention_never_deletes_through_a_deleting_directory_swapped_for_a_link(
    tmp_path, monkeypatch
):
    """Found by review: a deletion renames the step to `.deleting_global_step_<N>`, then
    removes its commit record by a path whose directory was followed: swapped for a link to
    another run's step meanwhile, that run lost its record (its step uncommitted). The swap
    happens for real, during the documented hook's pause between the two."""
    root = tmp_path / "ckpt"
    committed_step(root, 1)
    other = tmp_path / "other_run" / "global_step_3"
    other.mkdir(parents=True)
    (other / COMMIT_RECORD_FILENAME).write_bytes(b"the other run's record")
    monkeypatch.setenv(ENV_VAR, "delete=sleep=1")
    doomed = root / ".deleting_global_step_1"
    swapped = threading.Event()

    def attacker() -> None:
        deadline = time.monotonic() + 20
        while not doomed.is_dir() and time.monotonic() < deadline:
            time.sleep(0.005)
        swap_for_a_link(doomed, other)
        swapped.set()

    racer = threading.Thread(target=attacker)
    racer.start()
    try:
        with pytest.raises(OSError, match="not followed"):
            delete_step(LocalStore(root), 1)
    finally:
        racer.join()
    assert swapped.is_set()
    assert (other / COMMIT_RECORD_FILENAME).read_bytes() == b"the other run's record"


@pytest.mark.timeout(30)
def test_a_link_planted_at_a_rank_file_below_its_root_is_refused_naming_its_whole_path(tmp_path):
    """Found by the read-through: a rank's file opened in its directory held by descriptor
    (WriteOptions.beneath) was refused naming only `__0_0.distcp`; opened by path it names
    the whole path, and so it does again."""
    victim = tmp_path / "victim.txt"
    victim.write_bytes(PRECIOUS)
    path = step_dir(tmp_path / "root", 1) / "actor" / "__0_0.distcp"
    path.parent.mkdir(parents=True)
    path.symlink_to(victim)
    below = WriteOptions(beneath=str(tmp_path / "root"))
    with pytest.raises(OSError) as refused:
        write_checksummed(path, lambda stream: stream.write(b"rank bytes"), options=below)
    assert refused.value.filename == str(path), refused.value
    assert victim.read_bytes() == PRECIOUS


@pytest.mark.timeout(30)
def test_created_files_and_directories_get_owner_and_group_modes(tmp_path):
    """FILE_MODE for files, DIR_MODE for directories: never world-writable (nor readable)."""
    assert (FILE_MODE, DIR_MODE) == (0o640, 0o750)
    root = tmp_path / "ckpt"
    make_dir(root)
    committed_step(root, 3)
    written = write_checksummed(root / "rank.bin", lambda stream: stream.write(b"x"))
    assert written.size == 1
    publisher = LocalStore(root).open_publish("global_step_9/actor/f.bin", 1, 1 << 20)
    publisher.write(b"y")
    publisher.publish()
    for path in (
        root / TRACKER_FILENAME,
        step_dir(root, 3) / COMMIT_RECORD_FILENAME,
        root / "rank.bin",
        root / "global_step_9/actor/f.bin",
    ):
        assert stat.S_IMODE(path.stat().st_mode) == FILE_MODE, path
    for path in (root, root / "global_step_9", root / "global_step_9/actor"):
        assert stat.S_IMODE(path.stat().st_mode) == DIR_MODE, path


@pytest.mark.timeout(30)
def test_temporary_names_are_random_and_leftovers_of_both_patterns_are_cleared(tmp_path):
    target = tmp_path / TRACKER_FILENAME
    first, second = temporary_name(target), temporary_name(target)
    assert first != second and first.name.startswith(f".{TRACKER_FILENAME}.tmp.")
    old = tmp_path / f".{TRACKER_FILENAME}.tmp.{os.getpid()}"
    for leftover in (first, old):
        leftover.write_bytes(b"half")
    removed = remove_stale_temporaries(tmp_path, TRACKER_FILENAME)
    assert sorted(removed) == sorted([first, old])
    atomic_write_bytes(target, b"1\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == [TRACKER_FILENAME]


# ---- names read from records ----------------------------------------------------------------


@pytest.mark.parametrize(
    "name",
    ["../x", "/etc/passwd", "/dev/zero", f"actor/{ESCAPE}", "actor//x", "a/./b", "", "x" * 5000],
)
def test_the_one_validator_refuses_names_that_leave_or_print_badly(name):
    assert relative_path_problem(name) is not None


@pytest.mark.parametrize("name", ["actor/__0_0.distcp", "actor/.metadata", "driver_state.pt"])
def test_the_one_validator_admits_the_names_a_step_holds(name):
    assert relative_path_problem(name) is None


@pytest.mark.timeout(60)
@pytest.mark.parametrize("bad", ["../../outside.bin", "OUTSIDE", f"actor/{ESCAPE}"])
def test_verify_refuses_a_record_naming_a_file_outside_the_step_in_one_line(tmp_path, capsys, bad):
    """A planted record whose entry names a file outside the root, with the size and checksum
    of that file: verify must refuse the record, never read (and so pass) the file."""
    root = tmp_path / "ckpt"
    record = committed_step(root, 2)
    victim, entry = outside_file(tmp_path)
    name = str(victim) if bad == "OUTSIDE" else bad
    plant_record(
        step_dir(root, 2), replace(record, files=[*record.files, replace(entry, path=name)])
    )
    code, out, err = cli(capsys, "verify", root, "--step", 2)
    assert code == 1 and "OK" not in out
    one_line_naming(err, f"global_step_2/{COMMIT_RECORD_FILENAME}", escaped(repr(name))[:40])
    with pytest.raises(CommitRecordError):
        read_commit_record(root, 2)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("role", ["../x", f"ev{ESCAPE}il", "/etc"])
def test_a_role_name_read_from_a_record_is_checked(tmp_path, capsys, role):
    """Before: a role `../x` read back from a record was inspected (its `.metadata`
    unpickled) outside the root; a role with terminal escapes was printed raw."""
    root = tmp_path / "ckpt"
    record = committed_step(root, 2)
    plant_record(step_dir(root, 2), replace(record, participants={role: 1, "driver": 1}))
    for command in ("verify", "inspect"):
        code, out, err = cli(capsys, command, root, "--step", 2)
        assert code == 1, (command, out, err)
        one_line_naming(err, f"global_step_2/{COMMIT_RECORD_FILENAME}", "role name")
    code, out, err = cli(capsys, "ls", root)
    assert code == 0 and "\x1b" not in out + err
    assert "corrupt" in out


@pytest.mark.timeout(60)
def test_start_up_never_rolls_forward_to_a_planted_step_with_a_bad_name(tmp_path):
    """A step newer than the tracker with a record naming `../x` is no committed step: the
    tracker stays where it was."""
    root = tmp_path / "ckpt"
    record = committed_step(root, 2)
    planted = step_dir(root, 3)
    planted.mkdir()
    plant_record(planted, replace(record, step=3, participants={"../x": 1, "driver": 1}))
    state = recover_root(root)
    assert read_tracker(root) == 2
    assert state.committed == (2,)


@pytest.mark.timeout(30)
def test_verify_of_a_fifo_or_a_link_to_dev_zero_in_a_step_never_hangs(tmp_path, capsys):
    """Regular files only: the record names files of the step that are a FIFO (which would
    wait for a writer forever) and a link to /dev/zero (which never ends)."""
    root = tmp_path / "ckpt"
    record = committed_step(root, 2)
    path = step_dir(root, 2)
    os.mkfifo(path / "actor/fifo")
    (path / "actor/zero").symlink_to("/dev/zero")
    extra = [FileEntry("actor/fifo", 10, "0" * 16), FileEntry("actor/zero", 10, "0" * 16)]
    plant_record(path, replace(record, files=[*record.files, *extra]))
    for checksums in (True, False):
        result = check_step_files(root, 2, [*record.files, *extra], "xxh3_64", 2, 20, checksums)
        reasons = {Path(p.path).name: p.reason for p in result.problems}
        assert set(reasons) == {"fifo", "zero"}, reasons
        assert all("regular file" in reason or "link" in reason for reason in reasons.values())
    code, out, _ = cli(capsys, "verify", root, "--step", 2)
    assert code == 1 and "FAILED step 2: 2 problem(s)" in out


@pytest.mark.timeout(60)
@pytest.mark.parametrize("bad", ["../../../outside.bin", "OUTSIDE", "fifo", "zero", ESCAPE])
def test_an_export_record_naming_a_bad_file_is_refused_without_reading_it(tmp_path, bad):
    root = tmp_path / "ckpt"
    committed_step(root, 2)
    directory = step_dir(root, 2) / "actor" / "huggingface"
    directory.mkdir(parents=True)
    victim, entry = outside_file(tmp_path)
    os.mkfifo(directory / "fifo")
    (directory / "zero").symlink_to("/dev/zero")
    name = {"OUTSIDE": str(victim)}.get(bad, bad)
    write_export_record(
        directory, ExportRecord(2, "actor", "GPT2LMHeadModel", [replace(entry, path=name)])
    )
    record, problems = verify_export(directory)
    assert len(problems) == 1, problems
    assert "\x1b" not in problems[0] and "\n" not in problems[0]
    if bad in ("fifo", "zero"):
        assert "regular file" in problems[0] or "link" in problems[0]
    else:
        assert record is None and EXPORT_RECORD_FILENAME in problems[0]
    assert victim.read_bytes() == PRECIOUS


@pytest.mark.timeout(30)
@pytest.mark.parametrize("archive", ["../x", "/etc", f"rolled_back_{ESCAPE}"])
def test_a_rolled_back_record_naming_a_bad_archive_is_refused(tmp_path, archive):
    root = tmp_path / "ckpt"
    committed_step(root, 2)
    entry = {"step": 3, "record_sha256": "0" * 64, "to": 2, "archive": archive}
    (root / ROLLED_BACK_FILENAME).write_text(json.dumps({"format_version": 1, "steps": [entry]}))
    with pytest.raises(RollbackError) as caught:
        read_rolled_back(root)
    text = str(caught.value)
    assert ROLLED_BACK_FILENAME in text and "\x1b" not in text and "\n" not in text


@pytest.mark.timeout(30)
def test_names_printed_by_the_cli_are_escaped(tmp_path, capsys):
    """A role directory of an uncommitted step named with terminal escapes: `ls` shows it
    escaped."""
    root = tmp_path / "ckpt"
    committed_step(root, 2)
    (step_dir(root, 3) / f"ev{ESCAPE}il").mkdir(parents=True)
    (step_dir(root, 3) / f"ev{ESCAPE}il" / "f").write_bytes(b"x")
    code, out, err = cli(capsys, "ls", root)
    assert code == 0 and "\x1b" not in out + err
    assert escaped(f"ev{ESCAPE}il") in out
    print_table([("a", f"b{ESCAPE}")])
    assert "\x1b" not in capsys.readouterr().out


# ---- limits ---------------------------------------------------------------------------------


@pytest.mark.timeout(30)
def test_a_huge_tracker_is_refused_quickly(tmp_path):
    """A 1 GiB tracker (sparse: costs no disk) is refused after reading a few bytes."""
    root = tmp_path / "ckpt"
    root.mkdir()
    with open(root / TRACKER_FILENAME, "wb") as f:
        f.write(b"5")
        f.truncate(1 << 30)
    started = time.monotonic()
    with pytest.raises(TrackerError, match="larger than"):
        read_tracker(root)
    assert time.monotonic() - started < 2.0


@pytest.mark.timeout(30)
def test_a_huge_commit_record_is_refused_quickly(tmp_path, capsys):
    root = tmp_path / "ckpt"
    committed_step(root, 2)
    with open(step_dir(root, 2) / COMMIT_RECORD_FILENAME, "r+b") as f:
        f.truncate(COMMIT_RECORD_MAX_BYTES + 1)
    started = time.monotonic()
    with pytest.raises(CommitRecordError, match="larger than"):
        read_commit_record(root, 2)
    assert time.monotonic() - started < 2.0
    code, _, err = cli(capsys, "verify", root, "--step", 2)
    assert code == 1
    one_line_naming(err, "larger than")


@pytest.mark.timeout(30)
def test_a_tracker_or_record_that_is_a_fifo_is_refused_not_waited_on(tmp_path):
    root = tmp_path / "ckpt"
    committed_step(root, 2)
    (root / TRACKER_FILENAME).unlink()
    os.mkfifo(root / TRACKER_FILENAME)
    with pytest.raises(TrackerError, match="regular file"):
        read_tracker(root)
    (step_dir(root, 2) / COMMIT_RECORD_FILENAME).unlink()
    (step_dir(root, 2) / COMMIT_RECORD_FILENAME).symlink_to("/dev/zero")
    with pytest.raises(CommitRecordError):
        read_commit_record(root, 2)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("change", ["longer", "shorter"])
def test_a_download_reads_exactly_the_recorded_size(tmp_path, change):
    """A remote object longer than its record (its first bytes matching the record's size
    and checksum) or shorter is refused, and nothing is installed."""
    tier = FsspecStore(f"file://{tmp_path / 'remote'}")
    source = tmp_path / "source"
    record = committed_step(source, 5)
    remote = tmp_path / "remote" / "global_step_5"
    remote.mkdir(parents=True)
    for entry in record.files:
        data = (step_dir(source, 5) / entry.path).read_bytes()
        if entry.path == "actor/__0_0.distcp":
            data = data + b"more" if change == "longer" else data[:-1]
        (remote / entry.path).parent.mkdir(parents=True, exist_ok=True)
        (remote / entry.path).write_bytes(data)
    (remote / COMMIT_RECORD_FILENAME).write_bytes(
        (step_dir(source, 5) / COMMIT_RECORD_FILENAME).read_bytes()
    )
    dest = tmp_path / "dest"
    with pytest.raises(Exception, match="longer than" if change == "longer" else "size 2999"):
        pull_step(tier, 5, dest, 2, 30)
    assert not step_dir(dest, 5).exists()


@pytest.mark.timeout(30)
def test_a_remote_listing_skips_names_the_validator_refuses(tmp_path):
    tier = FsspecStore(f"file://{tmp_path / 'remote'}")
    step = tmp_path / "remote" / "global_step_1"
    step.mkdir(parents=True)
    (step / "good.bin").write_bytes(b"1")
    (step / f"bad{ESCAPE}.bin").write_bytes(b"2")
    assert tier.list_files("global_step_1") == {"good.bin": 1}
    assert tier.listing().steps == {1: {"good.bin": 1}}


@pytest.mark.timeout(30)
def test_an_export_record_of_the_usual_shape_still_verifies(tmp_path):
    directory = tmp_path / "huggingface"
    directory.mkdir()
    (directory / "model.safetensors").write_bytes(b"weights")
    entry = FileEntry("model.safetensors", *file_checksum(directory / "model.safetensors"))
    write_export_record(directory, ExportRecord(2, "actor", "GPT2LMHeadModel", [entry]))
    record, problems = verify_export(directory)
    assert problems == [] and record is not None and record.format_version == EXPORT_FORMAT_VERSION


@pytest.mark.timeout(30)
def test_a_download_of_a_fifo_in_a_file_tier_is_refused_not_waited_on(tmp_path):
    tier = FsspecStore(f"file://{tmp_path / 'remote'}")
    source = tmp_path / "source"
    record = committed_step(source, 5)
    remote = tmp_path / "remote" / "global_step_5"
    (remote / "actor").mkdir(parents=True)
    os.mkfifo(remote / "actor/__0_0.distcp")
    (remote / "driver_state.pt").write_bytes((step_dir(source, 5) / "driver_state.pt").read_bytes())
    (remote / COMMIT_RECORD_FILENAME).write_bytes(
        (step_dir(source, 5) / COMMIT_RECORD_FILENAME).read_bytes()
    )
    assert {e.path for e in record.files} == {"actor/__0_0.distcp", "driver_state.pt"}
    with pytest.raises(Exception, match="regular file"):
        pull_step(tier, 5, tmp_path / "dest", 2, 20)
    assert not step_dir(tmp_path / "dest", 5).exists()


# ---- files read outside the records' own readers (found by review) --------------------------


@pytest.mark.timeout(30)
def test_a_fifo_planted_as_metadata_state_marker_or_model_spec_is_refused_not_waited_on(tmp_path):
    """DCP metadata, a state file, a step's run marker and a role's model description are
    read as regular files only: a FIFO in their place does not block the reader (it would
    wait for a writer forever: inspect, a resume's loads, a restarted finalizer, export)."""
    from verl_ckpt.commit.admission import steps_lost_in_a_restart
    from verl_ckpt.format.safe_load import load_dcp_metadata, load_state_file
    from verl_ckpt.hf.model_spec import MODEL_SPEC_FILENAME, ModelSpecError, read_model_spec
    from verl_ckpt.store.layout import RUN_MARKER_FILENAME

    role = step_dir(tmp_path, 5) / "actor"
    role.mkdir(parents=True)
    for name in (".metadata", "state_0.pt", MODEL_SPEC_FILENAME):
        os.mkfifo(role / name)
    os.mkfifo(step_dir(tmp_path, 5) / RUN_MARKER_FILENAME)
    with pytest.raises(OSError, match="not a regular file|regular"):
        load_dcp_metadata(role / ".metadata")
    with pytest.raises(OSError, match="not a regular file|regular"):
        load_state_file(role / "state_0.pt")
    with pytest.raises(ModelSpecError):
        read_model_spec(role)
    assert steps_lost_in_a_restart(tmp_path, [5], "run-id") == []


def test_a_record_declaring_more_participant_states_than_files_is_malformed(tmp_path):
    """verify and inspect walk every declared index: a count no file list backs is refused
    when the record is read, not walked."""
    write_tracker(tmp_path, 0)
    path = step_dir(tmp_path, 1)
    path.mkdir()
    record = {
        "format_version": 1,
        "step": 1,
        "participants": {"driver": 1},
        "state_participants": {"replay": 10**12},
        "files": [],
        "checksum_algorithm": "xxh3_64",
        "committed_at": time.time(),
    }
    (path / COMMIT_RECORD_FILENAME).write_text(json.dumps(record))
    with pytest.raises(CommitRecordError, match="count more files than listed"):
        read_commit_record(path)


def test_a_hard_link_planted_at_a_files_name_is_replaced_not_written_through(tmp_path):
    """O_NOFOLLOW stops a symbolic link only: a hard link to a file the job may write
    (planted where a rank's file or a marker will be written) must not be truncated or
    written: a rank file is refused (as a symbolic link is), a marker created new; the
    target is left as it was."""
    from verl_ckpt.store.fsio import write_in_place

    target = tmp_path / "precious"
    target.write_bytes(b"keep me")
    for name in ("rank_file.distcp", "metadata.json"):
        os.link(target, tmp_path / name)
    with pytest.raises(OSError, match="hard link"):
        write_checksummed(tmp_path / "rank_file.distcp", lambda stream: stream.write(b"rank"))
    write_in_place(tmp_path / "metadata.json", b"{}")
    assert target.read_bytes() == b"keep me"
    assert (tmp_path / "metadata.json").read_bytes() == b"{}"


@pytest.mark.timeout(30)
def test_the_resume_reader_refuses_a_fifo_or_a_link_at_metadata_or_a_data_file(tmp_path):
    """Found by review: every rank's load reads the role's `.metadata` and its data files
    through DCP's own opens, which waited forever on a FIFO planted there (the default
    `verify_checksums_on_load=false` checks nothing first) and followed a planted link. The
    resume reader opens them as regular files only, and the refusal names the file."""
    from verl_ckpt.format.direct_reader import DirectFileSystemReader
    from verl_ckpt.format.safe_reader import SafeFileSystemReader

    fifo_role, link_role = tmp_path / "fifo" / "actor", tmp_path / "link" / "actor"
    for role in (fifo_role, link_role):
        role.mkdir(parents=True)
    os.mkfifo(fifo_role / ".metadata")
    os.mkfifo(fifo_role / "__0_0.distcp")
    victim, _ = outside_file(tmp_path)
    (link_role / ".metadata").symlink_to(victim)
    for reader in (SafeFileSystemReader, DirectFileSystemReader):
        for path in (fifo_role / ".metadata", link_role / ".metadata"):
            with pytest.raises(OSError, match="not a regular file|symbolic link") as refused:
                reader(path.parent).read_metadata()
            assert str(path) in str(refused.value)
        with pytest.raises(OSError, match="not a regular file"):
            with reader(fifo_role).fs.create_stream(fifo_role / "__0_0.distcp", "rb"):
                pass


@pytest.mark.timeout(30)
def test_a_planted_step_with_more_digits_than_a_tracker_holds_is_not_rolled_forward_to(tmp_path):
    """Found by review: `global_step_<22 digits>` with a record that matches its files was a
    committed step to recovery, which moved the tracker to it; a tracker holds at most 18
    digits, so every later start refused the root, even once the step was gone."""
    root = tmp_path / "ckpt"
    record = committed_step(root, 2)
    huge = 10**21
    planted = step_dir(root, huge)
    planted.mkdir()
    for entry in record.files:
        (planted / entry.path).parent.mkdir(parents=True, exist_ok=True)
        (planted / entry.path).write_bytes((step_dir(root, 2) / entry.path).read_bytes())
    plant_record(planted, replace(record, step=huge))
    state = recover_root(root)
    assert read_tracker(root) == 2 and state.committed == (2,)
    with pytest.raises(CommitRecordError, match="is not from 0 to"):
        read_commit_record(planted)
    with pytest.raises(ValueError, match="is not from 0 to"):
        write_tracker(root, huge)
    assert read_tracker(root) == 2


@pytest.mark.timeout(60)
@pytest.mark.parametrize("planted", ["fifo", "link to /dev/zero", "deep nesting"])
def test_a_fifo_or_a_link_at_metadata_json_fails_a_load_instead_of_blocking_it(tmp_path, planted):
    """Found by review: every rank's load hands the role's directory to megatron-core, whose
    plain open() of `metadata.json` waited forever on a FIFO planted there (the default
    `verify_checksums_on_load=false` checks nothing first) and read a link to /dev/zero
    until memory ran out (and deep nesting raised RecursionError). The load now fails at
    once, naming the file."""
    from verl_ckpt.format.megatron_compat import load_role_dir

    role = tmp_path / "actor"
    role.mkdir()
    config = role / "metadata.json"
    if planted == "fifo":
        os.mkfifo(config)
    elif planted == "deep nesting":
        config.write_bytes(b"[" * 30_000 + b"]" * 30_000)
    else:
        config.symlink_to("/dev/zero")
    outcome: dict = {}

    def load() -> None:
        try:
            load_role_dir({}, role)
        except Exception as exc:  # noqa: BLE001 - the test asserts on it
            outcome["error"] = exc

    thread = threading.Thread(target=load, daemon=True)
    thread.start()
    thread.join(10)
    if thread.is_alive():
        if planted == "fifo":  # a writer's open and close give the blocked reader its EOF
            os.close(os.open(config, os.O_WRONLY | os.O_NONBLOCK))
        pytest.fail(f"the load still reads the {planted} at metadata.json after 10 s")
    error = outcome.get("error")
    if planted == "deep nesting":
        assert isinstance(error, CheckpointError), error
        assert str(error) == f"{config} is not megatron-core's checkpoint config (a JSON object)"
        return
    assert isinstance(error, OSError), error
    assert str(config) in str(error) and re.search("not a regular file|symbolic link", str(error))
