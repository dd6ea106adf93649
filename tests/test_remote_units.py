"""The remote tier's pieces without Ray: the upload ledger (pure), and the commit, tracker,
retention, recovery and pull functions on a real `file://` tier and a real local root with
a committed step (files, checksums and commit record written as the finalizer writes them).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from verl_ckpt import prepare_start
from verl_ckpt.protocol.config import to_checkpoint_config
from verl_ckpt.protocol.errors import CheckpointConfigError, CheckpointError
from verl_ckpt.remote.ledger import UploadLedger, UploadReport, UploadStatus
from verl_ckpt.remote.pull import pull_step
from verl_ckpt.remote.tier import commit_remote_step
from verl_ckpt.remote.transfer import copy_file
from verl_ckpt.store.commit_record import (
    CommitRecord,
    FileEntry,
    find_commit_record,
    is_committed,
    read_commit_record,
    write_commit_record,
)
from verl_ckpt.store.fsio import file_checksum
from verl_ckpt.store.fsspec_store import FsspecStore
from verl_ckpt.store.layout import COMMIT_RECORD_FILENAME, TRACKER_FILENAME, step_dir
from verl_ckpt.store.recovery import roll_tracker_forward
from verl_ckpt.store.retention import apply_retention
from verl_ckpt.store.tracker import advance_tracker, read_tracker

RANKS = {("actor", 0), ("actor", 1)}


def committed_step(root: Path, step: int) -> CommitRecord:
    """A local committed step: three files of some bytes and their commit record."""
    path = step_dir(root, step)
    files = []
    for rel, size in (("actor/__0_0.distcp", 3000), ("actor/__1_0.distcp", 2000), ("d.pt", 10)):
        (path / rel).parent.mkdir(parents=True, exist_ok=True)
        (path / rel).write_bytes(bytes((step + i) % 251 for i in range(size)))
        files.append(FileEntry(rel, *file_checksum(path / rel)))
    record = CommitRecord(step=step, participants={"actor": 2, "driver": 1}, files=files)
    write_commit_record(path, record)
    return record


@pytest.fixture
def tier(tmp_path) -> FsspecStore:
    return FsspecStore(f"file://{tmp_path / 'remote'}")


# ---- the upload ledger ---------------------------------------------------------------------


def test_ledger_uploads_every_nth_commit_and_counts_expected_reports_once():
    ledger = UploadLedger(every=2)
    assert ledger.decide(1, RANKS) is UploadStatus.UPLOADING
    assert ledger.decide(2, RANKS) is UploadStatus.SKIPPED
    assert ledger.decide(3, RANKS) is UploadStatus.UPLOADING
    assert ledger.in_flight() == [1, 3]
    assert not ledger.record(UploadReport(2, "actor", 0))  # skipped step: not counted
    assert ledger.record(UploadReport(1, "actor", 0, paths=["actor/a"]))
    assert not ledger.record(UploadReport(1, "actor", 0, paths=["actor/b"]))  # a duplicate
    assert not ledger.record(UploadReport(1, "critic", 0))  # not a participant
    assert not ledger.all_reported(1) and ledger.missing(1) == [("actor", 1)]
    assert ledger.record(UploadReport(1, "actor", 1, errors=["actor/c: failed"]))
    assert ledger.all_reported(1) and ledger.confirmed_paths(1) == {"actor/a"}
    ledger.begin_commit(1)
    assert not ledger.record(UploadReport(1, "actor", 1))  # committing: too late
    ledger.finish_commit(1, "store down")
    assert ledger.status(1) is UploadStatus.FAILED and ledger.entry(1).error == "store down"
    assert ledger.in_flight() == [3]
    ledger.upload_whole(2)  # the last step of a run, uploaded by the finalizer alone
    assert ledger.all_reported(2) and ledger.in_flight() == [2, 3]


def test_ledger_forgets_old_decided_steps_but_never_one_in_flight():
    ledger = UploadLedger(every=1, remembered=3)
    ledger.decide(1, RANKS)  # stays uploading
    for step in range(2, 8):
        ledger.decide(step, set())
        ledger.begin_commit(step)
        ledger.finish_commit(step)
    assert ledger.status(1) is UploadStatus.UPLOADING
    assert [s for s in range(1, 8) if ledger.status(s) is not None] == [1, 6, 7]


# ---- commit, tracker, retention, recovery on a file:// tier --------------------------------


def test_I1_remote_commit_uploads_what_no_rank_confirmed_then_record_then_tracker(tmp_path, tier):
    root = tmp_path / "ckpt"
    record = committed_step(root, 1)
    summary = commit_remote_step(tier, root, 1, {"actor/__0_0.distcp"}, 2, 60)
    # The confirmed file was not there: a confirmation without the object is not trusted.
    assert summary.uploaded_here == 3 and summary.tracker == 1
    assert find_commit_record(tier, 1).files == record.files
    assert read_tracker(tier) == 1
    assert tier.listing().committed() == [1]
    # Confirmed by a rank and present with its size: not sent again.
    committed_step(root, 2)
    for rel in ("actor/__0_0.distcp", "actor/__1_0.distcp"):
        tier.fs.put_file(str(step_dir(root, 2) / rel), tier.key("global_step_2", rel))
    summary = commit_remote_step(tier, root, 2, {"actor/__0_0.distcp", "actor/__1_0.distcp"}, 2, 60)
    assert summary.uploaded_here == 1 and read_tracker(tier) == 2


def test_I3_a_remote_tracker_move_not_made_durable_is_told_so_retention_waits(
    tmp_path, tier, monkeypatch
):
    """As the local tier's: a `file://` tier's tracker renamed to step 2 whose directory
    fsync failed was reported like any other commit, and remote retention then deleted the
    step a power loss could bring that tracker back to. The summary now says it is not
    durable (the finalizer tier then skips its retention). The EIO is injected: a failing
    directory fsync needs a failing device."""
    import errno

    from verl_ckpt.store import fsio

    root = tmp_path / "ckpt"
    committed_step(root, 1)
    assert commit_remote_step(tier, root, 1, (), 2, 60).durable
    real_fsync_dir = fsio.fsync_dir
    remote = tmp_path / "remote"

    def fsync_failing_under_tracker_2(path):
        if Path(path) == remote and (remote / TRACKER_FILENAME).read_bytes().strip() == b"2":
            raise OSError(errno.EIO, "Input/output error")
        real_fsync_dir(path)

    monkeypatch.setattr(fsio, "fsync_dir", fsync_failing_under_tracker_2)
    committed_step(root, 2)
    summary = commit_remote_step(tier, root, 2, (), 2, 60)
    assert summary.tracker == 2 and not summary.durable


def test_I2_remote_tracker_never_moves_backwards_and_is_rolled_forward(tmp_path, tier):
    root = tmp_path / "ckpt"
    for step in (1, 2):
        committed_step(root, step)
        commit_remote_step(tier, root, step, (), 2, 60)
    assert advance_tracker(tier, 1) == 2 and read_tracker(tier) == 2
    # A remote commit interrupted between its record and the tracker: rolled forward.
    committed_step(root, 3)
    commit_remote_step(tier, root, 3, (), 2, 60)
    tier.put_bytes(TRACKER_FILENAME, b"2\n")
    assert roll_tracker_forward(tier) == 3 and read_tracker(tier) == 3


def test_I1_a_file_changed_on_disk_after_its_commit_is_never_uploaded(tmp_path, tier):
    root = tmp_path / "ckpt"
    record = committed_step(root, 1)
    entry = record.files[0]
    local = step_dir(root, 1) / entry.path
    local.write_bytes(b"\0" * entry.size)  # same size, other bytes
    with pytest.raises(CheckpointError, match="checksum"):
        copy_file(tier, local, f"global_step_1/{entry.path}", entry, record.checksum_algorithm)
    assert not tier.fs.exists(tier.key("global_step_1", entry.path))
    with pytest.raises(CheckpointError, match="upload of step 1"):
        commit_remote_step(tier, root, 1, (), 2, 60)
    assert find_commit_record(tier, 1) is None and read_tracker(tier) is None


def test_I3_remote_retention_keeps_n_the_tracker_and_steps_in_flight(tmp_path, tier):
    root = tmp_path / "ckpt"
    for step in (1, 2, 3, 4):
        committed_step(root, step)
        commit_remote_step(tier, root, step, (), 2, 60)
    # What an interrupted upload of an older step leaves: objects without a record.
    tier.put_bytes("global_step_0/actor/__0_0.distcp", b"partial")
    outcome = apply_retention(tier, keep=2, protected=[1], dry_run=True)
    assert outcome.deleted == [2] and outcome.purged == [0]
    assert tier.listing().committed() == [1, 2, 3, 4]  # a dry run deletes nothing
    outcome = apply_retention(tier, keep=2, protected=[1])
    assert outcome.deleted == [2] and outcome.purged == [0] and outcome.errors == []
    assert sorted(tier.listing().steps) == [1, 3, 4]
    tier.put_bytes(TRACKER_FILENAME, b"1\n")  # the tracker's target is never deleted
    assert apply_retention(tier, keep=1).deleted == [3]


def test_pull_verifies_every_file_and_writes_the_record_last(tmp_path, tier):
    source, dest = tmp_path / "ckpt", tmp_path / "fresh"
    record = committed_step(source, 5)
    commit_remote_step(tier, source, 5, (), 2, 60)
    summary = pull_step(tier, 5, dest, 2, 60)
    assert summary.files == 3 and read_commit_record(step_dir(dest, 5)).files == record.files
    assert pull_step(tier, 5, dest, 2, 60).downloaded is False
    # A damaged object: the pull fails naming it, and leaves no step (nor staging) behind.
    tier.put_bytes("global_step_5/d.pt", b"X" * 10)
    other = tmp_path / "other"
    with pytest.raises(CheckpointError, match=r"global_step_5/d\.pt: checksum"):
        pull_step(tier, 5, other, 2, 60)
    assert list(other.iterdir()) == []
    assert not (step_dir(other, 5) / COMMIT_RECORD_FILENAME).exists()


def test_I1_a_record_whose_file_path_leaves_the_step_is_refused_and_nothing_outside_is_touched(
    tmp_path, tier
):
    """A commit record is data from the tier (or a disk): an entry whose path leaves the step
    directory must never become a file operation. Before the fix, a pull (as start-up's
    fetch of a newer remote step runs it) created and truncated `../../victim.txt` outside
    the root before checking anything."""
    source, dest = tmp_path / "ckpt", tmp_path / "fresh"
    record = committed_step(source, 5)
    commit_remote_step(tier, source, 5, (), 2, 60)
    victim = tmp_path / "victim.txt"
    victim.write_bytes(b"precious\n")
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    for escaping in ("../../victim.txt", str(victim), "actor/../../../victim.txt"):
        entry = FileEntry(escaping, *file_checksum(victim))
        write_commit_record(scratch, replace(record, files=[*record.files, entry]))
        tier.put_bytes(
            f"global_step_5/{COMMIT_RECORD_FILENAME}",
            (scratch / COMMIT_RECORD_FILENAME).read_bytes(),
        )
        with pytest.raises(
            CheckpointError, match=rf"global_step_5/{COMMIT_RECORD_FILENAME}.*leaves the step"
        ):
            pull_step(tier, 5, dest, 2, 60)
        assert victim.read_bytes() == b"precious\n", escaping
        assert not dest.exists() or list(dest.iterdir()) == []
        # The same record on the local disk is no committed step either.
        assert not is_committed(scratch)


# ---- config --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("remote", "key"),
    [
        ({"url": "bucket/prefix"}, "checkpoint.remote.url"),
        ({"url": "s3://b/p", "every": 0}, "checkpoint.remote.every"),
        ({"url": "s3://b/p", "keep": 0}, "checkpoint.remote.keep"),
        ({"url": "s3://b/p", "max_in_flight": 0}, "checkpoint.remote.max_in_flight"),
    ],
)
def test_remote_config_errors_name_the_key(remote, key):
    with pytest.raises(CheckpointConfigError, match=key.replace(".", r"\.")):
        to_checkpoint_config({"remote": remote})


@pytest.mark.parametrize("where", ["the root", "inside the root", "above the root"])
def test_I3_a_file_tier_overlapping_the_root_is_refused_before_anything_is_written(tmp_path, where):
    """remote.url=file://<root> (or inside or above it) would let remote retention (keep=1)
    delete local steps that max_ckpt_to_keep keeps, and local retention the remote copies:
    refused at start-up, one line naming both keys; the root is left as it was."""
    root = tmp_path / "ckpt"
    committed_step(root, 10)
    url = {
        "the root": root,
        "inside the root": root / "remote",
        "above the root": tmp_path,
    }[where]
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    config = {"root_dir": str(root), "remote": {"url": f"file://{url}", "keep": 1}}
    with pytest.raises(CheckpointConfigError, match=r"remote\.url=.* overlaps .*root_dir"):
        prepare_start(config)
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before


def test_I3_a_file_tier_that_is_another_jobs_root_in_use_is_refused(tmp_path):
    """helper-59's review: remote.url=file://<a root another job holds> was accepted, and
    this job's remote retention and uploads would change that root under its lock."""
    from tests.lock_holder import HolderProcesses

    other = tmp_path / "other"
    committed_step(other, 10)
    holders = HolderProcesses()
    try:
        holders.start(other)
        before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
        config = {"root_dir": str(tmp_path / "ckpt"), "remote": {"url": f"file://{other}"}}
        with pytest.raises(CheckpointConfigError, match=r"is a local checkpoint root in use"):
            prepare_start(config)
        assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before
    finally:
        holders.close()


def test_without_a_remote_url_nothing_of_fsspec_is_imported():
    import subprocess
    import sys

    code = (
        "import sys, verl_ckpt.startup.prepare, verl_ckpt.commit.finalizer, verl_ckpt.cli.main;"
        "from verl_ckpt import prepare_start;"
        "print('fsspec' in sys.modules, 's3fs' in sys.modules)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.stdout.split() == ["False", "False"], done.stderr[-2000:]


def test_I1_large_files_go_up_in_parallel_parts_and_a_mismatch_publishes_nothing(
    s3_server, tmp_path, monkeypatch
):
    """Against the real S3 endpoint on loopback: a file larger than a part is sent as a
    multipart upload whose parts go in parallel, and arrives byte for byte; when the bytes
    read differ from the commit record, the multipart upload is aborted: no object, and no
    incomplete upload left in the bucket. (PART_SIZE lowered to S3's minimum, 5 MiB, so that
    a 12 MiB file has 3 parts.)"""
    from verl_ckpt.remote import transfer

    monkeypatch.setattr(transfer, "PART_SIZE", 5 << 20)
    bucket = s3_server.new_bucket()
    store = FsspecStore(f"s3://{bucket}/run", s3_server.storage_options())
    good = step_dir(tmp_path, 1)
    good.mkdir(parents=True)
    (good / "big.bin").write_bytes(bytes(range(256)) * (12 << 12))
    entry = FileEntry("big.bin", *file_checksum(good / "big.bin"))
    outcome = transfer.copy_files(store, good, 1, [entry], "xxh3_64", 4, 60)
    assert outcome.errors == [] and outcome.nbytes == 12 << 20
    assert store.fs.cat_file(store.key("global_step_1/big.bin")) == (good / "big.bin").read_bytes()

    wrong = FileEntry("big.bin", entry.size, "0" * 16)
    bad = step_dir(tmp_path, 2)
    bad.mkdir()
    (bad / "big.bin").write_bytes((good / "big.bin").read_bytes())
    outcome = transfer.copy_files(store, bad, 2, [wrong], "xxh3_64", 4, 60)
    assert len(outcome.errors) == 1 and "checksum" in outcome.errors[0], outcome.errors
    assert not store.fs.exists(store.key("global_step_2/big.bin"))
    uploads = store.fs.call_s3("list_multipart_uploads", Bucket=bucket).get("Uploads", [])
    assert uploads == [], uploads


def _unknown_version(tier: FsspecStore, step: int) -> str:
    """Give remote step `step` a record of a format version this verl_ckpt cannot read (one
    written by a newer verl_ckpt); its object's URL."""
    import json

    rel = f"global_step_{step}/{COMMIT_RECORD_FILENAME}"
    tier.put_bytes(
        rel, json.dumps({**json.loads(tier.read_bytes(rel)), "format_version": 2}).encode()
    )
    return tier.uri(rel)


def test_I3_remote_retention_counts_only_readable_records_toward_keep(tmp_path, tier, capsys):
    """Regression: remote retention counted a step whose record it cannot read (here a newer
    format_version) toward remote.keep, so `prune URL --keep 1` deleted steps 10 and 20, the
    ones a resume can use. As in the local tier, only readable records count; a step with an
    unreadable record is neither counted nor deleted."""
    from verl_ckpt.cli.main import main

    root = tmp_path / "ckpt"
    for step in (10, 20, 30):
        committed_step(root, step)
        commit_remote_step(tier, root, step, (), 2, 60)
    _unknown_version(tier, 30)
    assert apply_retention(tier, keep=1, dry_run=True).deleted == [10]
    assert main(["prune", tier.url, "--keep", "1"]) == 0
    out = capsys.readouterr().out
    assert "deleted step 10" in out and "deleted step 20" not in out, out
    assert tier.listing().committed() == [20, 30]
    assert find_commit_record(tier, 20).step == 20


def test_I1_a_remote_tracker_naming_an_unreadable_record_fails_start_up_naming_it(tmp_path, tier):
    """Regression: when the remote tracker names a step whose record cannot be read, start-up
    skipped it with a warning and resumed from an older remote step (or, once retention had
    deleted those, silently from scratch). Now one line naming the record object, before the
    lock, with nothing downloaded."""
    source, fresh = tmp_path / "ckpt", tmp_path / "fresh"
    for step in (10, 20, 30):
        committed_step(source, step)
        commit_remote_step(tier, source, step, (), 2, 60)
    where = _unknown_version(tier, 30)
    assert read_tracker(tier) == 30
    with pytest.raises(CheckpointError) as refused:
        prepare_start({"root_dir": str(fresh), "remote": {"url": tier.url}})
    message = str(refused.value)
    assert "\n" not in message and where in message and "format_version 2" in message, message
    assert not fresh.exists() or list(fresh.glob("global_step_*")) == []


def _resaved(root: Path, step: int) -> None:
    """The local step `step` saved again by a later run: other bytes, another record."""
    import shutil

    shutil.rmtree(step_dir(root, step))
    path = step_dir(root, step)
    files = []
    for rel, size in (("actor/__0_0.distcp", 3000), ("actor/__1_0.distcp", 2000), ("d.pt", 10)):
        (path / rel).parent.mkdir(parents=True, exist_ok=True)
        (path / rel).write_bytes(bytes((7 * step + i) % 253 for i in range(size)))
        files.append(FileEntry(rel, *file_checksum(path / rel)))
    write_commit_record(
        path, CommitRecord(step=step, participants={"actor": 2, "driver": 1}, files=files)
    )


def test_I1_a_failed_upload_never_leaves_a_committed_remote_step_with_mixed_objects(
    tmp_path, tier, caplog
):
    """Regression: the upload of a new save of step 2 wrote its objects under the remote
    tier's committed step 2 (an older save of it), under that step's old record; a failure
    half-way left a committed remote step whose objects no longer match its record. Now the
    old record is removed first (with a warning naming it): a failure leaves the step
    uncommitted remotely, never committed-but-mixed."""
    import logging

    root = tmp_path / "ckpt"
    committed_step(root, 2)
    commit_remote_step(tier, root, 2, (), 2, 60)
    _resaved(root, 2)
    (step_dir(root, 2) / "d.pt").write_bytes(b"\0" * 10)  # changed after its commit: refused
    caplog.set_level(logging.WARNING, logger="verl_ckpt.remote.tier")
    with pytest.raises(CheckpointError, match="upload of step 2"):
        commit_remote_step(tier, root, 2, (), 2, 60)
    assert find_commit_record(tier, 2) is None, "a committed remote step with mixed objects"
    assert any(
        tier.uri("global_step_2", COMMIT_RECORD_FILENAME) in r.getMessage() for r in caplog.records
    )


def test_I1_the_finalizer_removes_another_remote_record_before_any_rank_uploads(tmp_path, tier):
    """Regression: a rank was told to upload its files of step 2 (`upload_turn`) while the
    remote tier still held another save's commit record for step 2: its objects landed under
    that record. Now the finalizer's remote tier removes the other record before it answers
    any rank; the step then commits remotely with the local record."""
    import asyncio

    from verl_ckpt.remote.finalizer_tier import RemoteTier

    root = tmp_path / "ckpt"
    committed_step(root, 2)
    commit_remote_step(tier, root, 2, (), 2, 60)
    _resaved(root, 2)
    local = (step_dir(root, 2) / COMMIT_RECORD_FILENAME).read_bytes()

    async def run() -> None:
        remote = RemoteTier(
            {"url": tier.url, "timeout_s": 20.0}, root, {"actor": 2, "driver": 1}, lambda _: None
        )
        remote.after_local_commit(2)
        assert await remote.upload_turn(2, 20.0) is True
        assert find_commit_record(tier, 2) is None, "a rank was told to upload under it"
        for rank in (0, 1):
            await remote.report(UploadReport(2, "actor", rank))
        status = await remote.drain(20.0)
        assert status["status"] == "committed", status

    asyncio.run(run())
    assert tier.read_bytes(f"global_step_2/{COMMIT_RECORD_FILENAME}") == local


# ---- what the local tier's rules mean on a second store (found by review) -------------------


class _PutAppliedThenFailed(FsspecStore):
    """A fake for a fault that cannot be produced for real here: an object store's tracker
    PUT that lands and is then reported as failed (a connection reset after the write, or a
    call past its deadline whose thread goes on)."""

    def put_bytes(self, rel, data, before_replace=None):
        super().put_bytes(rel, data, before_replace)
        if rel == TRACKER_FILENAME:
            raise OSError(104, "Connection reset by peer")


def test_I1_a_remote_tracker_put_that_failed_never_withdraws_the_record(tmp_path, caplog):
    """Step 10: a failed remote tracker PUT may have landed, so the remote record stays (the
    step is committed, and the tracker rolled forward at the next start). Before, the local
    tier's rule withdrew it: the tracker named step 1 and step 1 had no record (I1)."""
    root = tmp_path / "ckpt"
    committed_step(root, 1)
    store = _PutAppliedThenFailed(f"file://{tmp_path / 'remote'}")
    summary = commit_remote_step(store, root, 1, (), 2, 60)
    assert find_commit_record(store, 1) is not None
    assert read_tracker(store) == 1 and summary.step == 1
    assert "stays committed" in caplog.text


def test_the_local_fault_phases_do_not_fire_on_the_remote_tier(tier, tmp_path, monkeypatch):
    """`tracker` and `delete` are the local tier's phases (steps 6 and 7; the page gives the
    remote steps 10 and 11 none): a drill of the local tier leaves the remote tier alone.
    Before, both fired on the remote tier too (remote commits and retention failed)."""
    root = tmp_path / "ckpt"
    for step in (1, 2):
        committed_step(root, step)
    monkeypatch.setenv("VERL_CKPT_FAULT", "tracker=raise,delete=raise")
    for step in (1, 2):
        assert commit_remote_step(tier, root, step, (), 2, 60).tracker == step
    assert apply_retention(tier, keep=1).deleted == [1]
    with pytest.raises(CheckpointError):  # the root's own tracker: the phase fires there
        advance_tracker(root, 2)


def test_the_finalizer_replaces_an_unreadable_remote_tracker_at_its_start(tier, tmp_path):
    """The remote tier's recovery at a finalizer start replaces a damaged remote tracker
    with the newest committed remote step (as before the store seam); a start-up of the
    root never takes an unreadable tracker as none."""
    from verl_ckpt.remote.finalizer_tier import RemoteTier

    root = tmp_path / "ckpt"
    committed_step(root, 3)
    commit_remote_step(tier, root, 3, (), 2, 60)
    tier.put_bytes(TRACKER_FILENAME, b"garbage")
    with pytest.raises(CheckpointError):
        roll_tracker_forward(tier)
    RemoteTier({"url": tier.url, "timeout_s": 60}, root, {"actor": 2}, lambda step: None)
    assert read_tracker(tier) == 3


def test_a_discarded_streamed_upload_never_publishes_its_bytes():
    """Found by review: a file too large for one PUT on a store that is neither S3 nor
    file:// is streamed through an fsspec file (StreamedObject). Discarded (its bytes did not
    match, or its deadline passed), fsspec's AbstractBufferedFile.discard() does nothing, and
    the file's __del__ closes it, which uploads what it buffered: the partial, unverified
    object was published at garbage collection. The backend here is the least fsspec
    AbstractBufferedFile that uploads (gcsfs, adlfs and the like are not installed)."""
    import gc

    from fsspec.spec import AbstractBufferedFile, AbstractFileSystem

    from verl_ckpt.store.fsspec_publish import StreamedObject

    published: dict[str, bytes] = {}

    class UploadingFile(AbstractBufferedFile):
        def _initiate_upload(self) -> None:
            self.parts: list[bytes] = []

        def _upload_chunk(self, final: bool = False) -> bool:
            self.parts.append(self.buffer.getvalue())
            if final:
                published[self.path] = b"".join(self.parts)
            return True

    fs = AbstractFileSystem()
    whole = StreamedObject(UploadingFile(fs, "bucket/whole", mode="wb", block_size=1 << 20))
    whole.write(b"all of the bytes")
    whole.publish()
    assert published == {"bucket/whole": b"all of the bytes"}  # the backend uploads

    cut = StreamedObject(UploadingFile(fs, "bucket/cut", mode="wb", block_size=1 << 20))
    cut.write(b"half of the bytes")
    cut.discard()
    del cut
    gc.collect()
    assert "bucket/cut" not in published


def test_a_remote_tracker_read_past_its_deadline_after_the_record_leaves_the_step_committed(
    tmp_path,
):
    """Found by review: the remote commit read the tracker (never to move it backwards) after
    the commit record's PUT. A read past its deadline raised out of the commit, and the
    finalizer reported the step "not committed in the remote tier", failed, and skipped remote
    retention, although its record was up. Now the tracker is left (rolled forward at the
    next start) and the step is committed. A read past its deadline cannot be produced at
    that exact call for real: this store's tracker read raises what the deadline raises."""
    from verl_ckpt.protocol.errors import CommitTimeoutError

    class TrackerReadPastItsDeadline(FsspecStore):
        def read_bytes(self, rel: str, max_bytes: int) -> bytes | None:
            if rel == TRACKER_FILENAME:
                raise CommitTimeoutError(f"{self.uri(rel)}: no answer within 2s")
            return super().read_bytes(rel, max_bytes)

    root = tmp_path / "ckpt"
    committed_step(root, 1)
    store = TrackerReadPastItsDeadline(f"file://{tmp_path / 'remote'}")
    summary = commit_remote_step(store, root, 1, set(), 2, 60)
    assert summary.tracker is None
    assert find_commit_record(store, 1) is not None


def test_I2_a_tracker_put_past_its_deadline_never_lands_after_a_newer_one(tmp_path):
    """Found in the remote tier's review: a store call past its deadline keeps running in
    its thread (a hung socket cannot be interrupted). A tracker PUT of step 5 that timed out
    and landed later, after the next commit's PUT of step 6, moved the remote tracker back
    (I2). Now a store sends no call on an object while an earlier one on it may still land:
    the next call waits for it, within its own deadline, or fails naming it. A PUT held up
    past its deadline and then landing cannot be produced for one request alone: this
    store's first tracker PUT waits 2.5 s before it replaces the object."""
    import time

    from verl_ckpt.protocol.errors import CommitTimeoutError
    from verl_ckpt.store.tracker import write_tracker

    class FirstTrackerPutHeldUp(FsspecStore):
        held = False

        def put_bytes(self, rel: str, data: bytes, before_replace=None) -> None:
            if rel == TRACKER_FILENAME and not self.held:
                self.held = True
                before_replace = lambda: time.sleep(2.5)  # noqa: E731
            super().put_bytes(rel, data, before_replace)

    store = FirstTrackerPutHeldUp(f"file://{tmp_path / 'remote'}", call_timeout_s=1.0)
    started = time.monotonic()
    with pytest.raises(CommitTimeoutError):
        write_tracker(store, 5)
    # The next commit moves the tracker on, retried as the next commit would be.
    for _ in range(3):
        try:
            write_tracker(store, 6)
            break
        except CommitTimeoutError as exc:
            # Held back behind the first PUT, or (sent as it ended) past its own deadline.
            assert TRACKER_FILENAME in str(exc), exc
    else:
        raise AssertionError("the tracker never moved to step 6")
    time.sleep(max(0.0, started + 3.5 - time.monotonic()))  # the held PUT has ended by now
    assert read_tracker(store) == 6


def test_I2_a_remote_recovery_left_running_past_its_deadline_never_moves_the_tracker_back(
    tmp_path, monkeypatch
):
    """Found by review: the remote tier's recovery at a finalizer start (roll the remote
    tracker forward) runs under a deadline of its own; past it, it went on in its thread,
    and its tracker PUT could land after a later commit's, moving the tracker back (I2).
    Now the store sends no tracker call before that thread ended. A store that stalls
    during recovery and then answers cannot be produced for that one sequence: the
    recovery here waits 2.5 s, then writes the tracker of step 1."""
    import time

    from verl_ckpt.protocol.errors import CommitTimeoutError
    from verl_ckpt.remote import finalizer_tier
    from verl_ckpt.store.tracker import write_tracker

    def slow_recovery(store, **_):
        time.sleep(2.5)
        write_tracker(store, 1)
        return 1

    monkeypatch.setattr(finalizer_tier, "roll_tracker_forward", slow_recovery)
    tier = finalizer_tier.RemoteTier(
        {"url": f"file://{tmp_path / 'remote'}", "timeout_s": 1.0},
        tmp_path / "ckpt",
        {"actor": 1},
        lambda step: None,
    )
    started = time.monotonic()  # the recovery was given up 1 s after it began
    for _ in range(4):  # a commit's tracker PUT, tried again as the next commit would
        try:
            write_tracker(tier._store, 5)
            break
        except CommitTimeoutError as exc:
            assert TRACKER_FILENAME in str(exc), exc
    else:
        raise AssertionError("the tracker never moved to step 5")
    time.sleep(max(0.0, started + 2.5 - time.monotonic()))  # the recovery has ended
    assert read_tracker(tier._store) == 5
