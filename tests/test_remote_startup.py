"""Start-up (protocol step 0') against a remote tier that disagrees with the local root, and
`verl-ckpt rollback URL`: real local roots with committed steps (real files, checksums and
commit records), real `file://` remote tiers filled by the finalizer's own functions, the
real CLI. No Ray: all of this happens before Ray starts.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from tests.test_remote_units import committed_step
from verl_ckpt import CheckpointError, prepare_start, read_tracker, step_dir
from verl_ckpt.cli.main import main
from verl_ckpt.protocol.errors import CommitRecordError, ResumeConflictError
from verl_ckpt.remote.tier import commit_remote_step
from verl_ckpt.store.fsspec_store import FsspecStore
from verl_ckpt.store.layout import COMMIT_RECORD_FILENAME, list_step_dirs
from verl_ckpt.store.tracker import write_tracker

STEPS = (10, 20, 30)


@pytest.fixture
def both(tmp_path) -> tuple[Path, FsspecStore]:
    """A local root with steps 10, 20, 30 committed, each uploaded to a file:// tier."""
    root = tmp_path / "ckpt"
    tier = FsspecStore(f"file://{tmp_path / 'remote'}")
    for step in STEPS:
        committed_step(root, step)
        write_tracker(root, step)
        commit_remote_step(tier, root, step, (), 2, 60)
    return root, tier


def cli(capsys, *argv) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def start(cfg: dict) -> Path | None:
    plan = prepare_start(cfg)
    plan.release()
    return plan.resume_dir


def tree(path: Path) -> list[str]:
    """Every path under `path`, but the root lock's files (start-up takes the lock)."""
    return sorted(
        str(p.relative_to(path)) for p in path.rglob("*") if ".verl_ckpt.lock" not in p.name
    )


# ---- a local rollback and the remote tier ---------------------------------------------------


def test_I2_a_local_rollback_is_not_undone_by_the_remote_tier(both, capsys):
    """Regression: after `verl-ckpt rollback ROOT --to 20`, a start with the remote tier
    (resume_mode=auto) downloaded step 30 again and rolled the tracker forward to it: the
    rollback silently undone. Now refused, one line naming the URL, the step, the rollback
    and the way out (`verl-ckpt rollback URL --to 20 --delete`), the root left as it was;
    after that command the start resumes from step 20."""
    root, tier = both
    assert cli(capsys, "rollback", root, "--to", 20)[0] == 0
    before = tree(root)
    config = {"root_dir": str(root), "remote": {"url": tier.url}}
    with pytest.raises(ResumeConflictError) as refused:
        start(config)
    message = str(refused.value)
    assert "\n" not in message and tier.url in message and "step 30" in message, message
    assert "rollback" in message and f"verl-ckpt rollback {tier.url} --to 20 --delete" in message
    assert tree(root) == before and read_tracker(root) == 20
    assert sorted(list_step_dirs(root)) == [10, 20]

    code, out, err = cli(capsys, "rollback", tier.url, "--to", 20, "--delete")
    assert (code, err) == (0, ""), err
    assert start(config) == step_dir(root, 20) and read_tracker(root) == 20
    assert sorted(list_step_dirs(root)) == [10, 20]


def test_resume_path_after_a_local_rollback_names_the_remote_rollback_not_prune(both, capsys):
    """Regression: the refusal of a resume_path older than the remote tier's newest step
    advised `verl-ckpt prune URL ...`, which deletes OLDER steps and so cannot help. It now
    names `verl-ckpt rollback URL --to N --delete`, which does, as the test shows."""
    root, tier = both
    assert cli(capsys, "rollback", root, "--to", 20)[0] == 0
    config = {
        "root_dir": str(root),
        "remote": {"url": tier.url},
        "resume_mode": "resume_path",
        "resume_from_path": str(step_dir(root, 20)),
    }
    with pytest.raises(ResumeConflictError) as refused:
        start(config)
    message = str(refused.value)
    assert "prune" not in message, message
    assert f"verl-ckpt rollback {tier.url} --to 20 --delete" in message, message
    assert cli(capsys, "rollback", tier.url, "--to", 20, "--delete")[0] == 0
    assert start(config) == step_dir(root, 20)


@pytest.mark.parametrize("how", ["a link to it", "a path through it"])
def test_a_resume_path_that_reaches_an_older_step_indirectly_is_still_refused(
    both, tmp_path, capsys, how
):
    """Found by review: the local check resolves checkpoint.resume_from_path (a link `best`
    to global_step_20, or `.../global_step_20/actor/..`) and accepts it, while the remote
    tier's check read the step from the path as written, found none, and let the start go
    on: this run's uploads then replaced the remote tier's committed step 30 of another
    lineage, with a warning only. Both checks now read the resolved path."""
    root, tier = both
    assert cli(capsys, "rollback", root, "--to", 20)[0] == 0  # the local root: 10 and 20
    if how == "a link to it":
        path = tmp_path / "best"
        path.symlink_to(step_dir(root, 20))
    else:
        path = step_dir(root, 20) / "actor" / ".."
        (step_dir(root, 20) / "actor").mkdir(exist_ok=True)
    config = {
        "root_dir": str(root),
        "remote": {"url": tier.url},
        "resume_mode": "resume_path",
        "resume_from_path": str(path),
    }
    with pytest.raises(ResumeConflictError, match=f"step 20, but .*{tier.url} holds .* 30"):
        start(config)


def test_a_resume_path_that_is_no_step_directory_is_named_as_such_with_a_remote_tier(both):
    """A resume_from_path that names no global_step_<N> directory was refused by the remote
    tier's check as "resumes from step None, but ... holds committed step 30": now the local
    check names the path."""
    root, tier = both
    config = {
        "root_dir": str(root),
        "remote": {"url": tier.url},
        "resume_mode": "resume_path",
        "resume_from_path": str(root / "no_such_step"),
    }
    with pytest.raises(CheckpointError) as refused:
        start(config)
    message = str(refused.value)
    assert "step None" not in message and str(root / "no_such_step") in message, message


def test_a_remote_step_that_no_rollback_moved_out_is_still_downloaded(both, tmp_path):
    """The remote tier's step 30 is not the step 30 the rollback moved out (another record,
    e.g. another machine's run): a newer remote step is downloaded as on a fresh machine."""
    root, tier = both
    assert main(["rollback", str(root), "--to", "20", "--delete"]) == 0
    other = tmp_path / "other"
    committed_step(other, 30)
    record_bytes = (step_dir(other, 30) / COMMIT_RECORD_FILENAME).read_bytes()
    tier.remove_tree("global_step_30")
    commit_remote_step(tier, other, 30, (), 2, 60)
    assert start({"root_dir": str(root), "remote": {"url": tier.url}}) == step_dir(root, 30)
    assert (step_dir(root, 30) / COMMIT_RECORD_FILENAME).read_bytes() == record_bytes
    assert read_tracker(root) == 30


def test_rollback_record_hash_is_that_of_the_bytes_the_remote_tier_holds(both):
    """The record's hash is that of the commit record's bytes: the same bytes the remote
    tier holds for the uploaded step, which is what start-up compares."""
    from verl_ckpt.store.rollback import read_rolled_back

    root, tier = both
    remote = tier.read_bytes(f"global_step_30/{COMMIT_RECORD_FILENAME}")
    assert main(["rollback", str(root), "--to", "20"]) == 0
    (entry,) = read_rolled_back(root)
    assert entry.step == 30 and entry.record_sha256 == hashlib.sha256(remote).hexdigest()


# ---- verl-ckpt rollback URL --to N --delete -------------------------------------------------


def test_rollback_url_deletes_newer_steps_record_first_then_moves_the_tracker(both, capsys):
    """`rollback URL --to N` needs --delete (object storage has no cheap archive); --dry-run
    lists and changes nothing; the real run deletes every newer step (committed or an
    unfinished upload) and moves the remote tracker back to N. Older leftovers stay (remote
    retention's business). A step that is not in the remote tier is a usage error."""
    _, tier = both
    tier.put_bytes("global_step_40/actor/__0_0.distcp", b"partial")  # an unfinished upload
    tier.put_bytes("global_step_5/actor/__0_0.distcp", b"partial")
    code, out, err = cli(capsys, "rollback", tier.url, "--to", 20)
    assert (code, out) == (2, "") and err.count("\n") == 1 and "--delete" in err, err
    before = tree(Path(tier.path))
    code, out, err = cli(capsys, "rollback", tier.url, "--to", 20, "--delete", "--dry-run")
    assert (code, err) == (0, ""), err
    assert tree(Path(tier.path)) == before
    assert "would delete step 30" in out and "would delete leftover" in out, out
    assert out.splitlines()[-1] == "tracker: 30 -> 20 (dry run: nothing changed)", out
    code, out, err = cli(capsys, "rollback", tier.url, "--to", 20, "--delete")
    assert (code, err) == (0, ""), err
    assert out.splitlines()[-1] == "tracker: 30 -> 20", out
    assert sorted(tier.listing().steps) == [5, 10, 20] and tier.listing().committed() == [10, 20]
    assert read_tracker(tier) == 20
    code, _, err = cli(capsys, "rollback", tier.url, "--to", 30, "--delete")
    assert code == 2 and "global_step_30 does not exist" in err, err


# ---- resume_fallback=previous and the remote tier -------------------------------------------


def flip_bit(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x04  # same size: only a checksum sees it
    path.write_bytes(data)


def fallback_config(root: Path, tier: FsspecStore) -> dict:
    return {
        "root_dir": str(root),
        "remote": {"url": tier.url},
        "resume_verify": "checksums",
        "resume_fallback": "previous",
    }


def test_I1_a_failing_resume_step_is_replaced_by_its_verified_remote_copy(both, caplog):
    """Regression: local step 30 has a flipped bit, the remote tier's copy of step 30
    verifies; start-up quarantined local 30 and resumed from 20 (10 steps lost). Now the
    local copy is quarantined as before, the remote copy downloaded (every file verified
    against its record) in its place, and the run resumes from step 30 with one warning."""
    import logging

    root, tier = both
    bad = step_dir(root, 30) / "actor/__1_0.distcp"
    flip_bit(bad)
    caplog.set_level(logging.WARNING)
    assert start(fallback_config(root, tier)) == step_dir(root, 30)
    assert read_tracker(root) == 30 and sorted(list_step_dirs(root)) == [10, 20, 30]
    assert main(["verify", str(root), "--step", "30"]) == 0
    record = (step_dir(root, 30) / COMMIT_RECORD_FILENAME).read_bytes()
    assert record == tier.read_bytes(f"global_step_30/{COMMIT_RECORD_FILENAME}")
    (moved,) = (root / "quarantine").iterdir()
    assert moved.name.startswith("global_step_30.") and (moved / "actor/__1_0.distcp").is_file()
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    (warning,) = [w for w in warnings if "resume_fallback" in w]
    assert str(bad) in warning and tier.url in warning and "resuming from step 30" in warning


def test_I1_a_fallback_below_the_remote_tiers_newest_step_is_refused(both, capsys):
    """Regression: with both copies of step 30 damaged, the fallback resumed from step 20
    while the remote tier held committed step 30, so the run's step 30 would go over it. Now
    refused before anything moves, one line naming the remote step and the way out; after
    that command, the fallback to 20 goes ahead."""
    root, tier = both
    flip_bit(step_dir(root, 30) / "actor/__1_0.distcp")
    flip_bit(Path(tier.key("global_step_30", "actor/__1_0.distcp")))
    before = tree(root)
    with pytest.raises(ResumeConflictError) as refused:
        start(fallback_config(root, tier))
    message = str(refused.value)
    assert "\n" not in message and "step 30" in message and tier.url in message, message
    assert f"verl-ckpt rollback {tier.url} --to 20 --delete" in message, message
    assert tree(root) == before and read_tracker(root) == 30
    assert cli(capsys, "rollback", tier.url, "--to", 20, "--delete")[0] == 0
    assert start(fallback_config(root, tier)) == step_dir(root, 20)
    assert read_tracker(root) == 20 and sorted(list_step_dirs(root)) == [10, 20]


def test_a_remote_tracker_step_without_a_record_is_refused_only_when_the_start_needs_it(
    both, tmp_path
):
    """The remote tracker names step 30, whose record is gone (an upload of another save of
    30 that withdrew it and was interrupted, or an interrupted remote rollback). The root
    holding step 30 itself takes nothing from the remote tier: its start goes on. A fresh
    machine would silently start from step 20: refused, naming the missing record."""
    root, tier = both
    tier.remove(f"global_step_30/{COMMIT_RECORD_FILENAME}")
    assert start({"root_dir": str(root), "remote": {"url": tier.url}}) == step_dir(root, 30)
    fresh = tmp_path / "fresh"
    with pytest.raises(CommitRecordError) as refused:
        start({"root_dir": str(fresh), "remote": {"url": tier.url}})
    message = str(refused.value)
    assert "\n" not in message and "is missing" in message, message
    assert tier.uri("global_step_30", COMMIT_RECORD_FILENAME) in message, message
    assert list(fresh.glob("global_step_*")) == []


# ---- a store that stops answering (a real SIGSTOP of the S3 server) ------------------------


def stalled_s3_tier(server, tmp_path) -> tuple[str, dict]:
    """A remote tier on the test's own S3 server holding committed step 30, and storage
    options with a 2 s read timeout and one attempt (s3fs's own retries still multiply it:
    about 25 s per call once the server stops)."""
    url = f"s3://{server.new_bucket()}/run"
    options = server.storage_options(read_timeout_s=2.0)
    source = tmp_path / "source"
    committed_step(source, 30)
    commit_remote_step(FsspecStore(url, options), source, 30, (), 2, 60)
    return url, options


def test_I5_start_up_store_calls_end_at_the_config_deadline_when_the_store_stalls(
    own_s3_server, tmp_path, monkeypatch
):
    """Regression: start-up's download of a newer remote step read its commit record with no
    deadline of ours, so a store that stopped answering after the start-up check held the
    start for s3fs's retries (about 25 s here for a 2 s read timeout; about 18 min with the
    defaults). Now every start-up store call ends within checkpoint.timeout_s (3 s here) with
    one line naming the object; nothing is left in the root."""
    import time

    import verl_ckpt.startup.prepare as remote_startup
    from verl_ckpt.protocol.errors import CheckpointError

    url, options = stalled_s3_tier(own_s3_server, tmp_path)
    fetch = remote_startup.fetch_newer_remote_step

    def stall_then_fetch(*args):
        own_s3_server.pause()  # right after the check: the probe and the listing answered
        return fetch(*args)

    monkeypatch.setattr(remote_startup, "fetch_newer_remote_step", stall_then_fetch)
    fresh = tmp_path / "fresh"
    config = {"root_dir": str(fresh), "timeout_s": 3.0}
    config["remote"] = {"url": url, "storage_options": options}
    started = time.monotonic()
    try:
        with pytest.raises(CheckpointError) as failed:
            start(config)
        elapsed = time.monotonic() - started
    finally:
        own_s3_server.resume()
    message = str(failed.value)
    assert elapsed < 12, f"start-up waited {elapsed:.1f}s for a stalled store: {message}"
    assert "\n" not in message and f"{url}/global_step_30" in message, message
    assert "did not answer within 3s" in message, message
    assert list(fresh.glob("*global_step_*")) == []


def test_I5_cli_store_calls_on_a_url_end_at_the_timeout_option(own_s3_server, tmp_path, capsys):
    """`verl-ckpt ls URL` against a store that stopped answering: each store call ends within
    --timeout (a documented default otherwise), exit 1, one line naming the URL, instead of
    s3fs's retries multiplying its read timeout."""
    import json
    import time

    url, options = stalled_s3_tier(own_s3_server, tmp_path)
    own_s3_server.pause()
    started = time.monotonic()
    try:
        argv = ("ls", url, "--timeout", "2", "--storage-options", json.dumps(options))
        code, out, err = cli(capsys, *argv)
        elapsed = time.monotonic() - started
    finally:
        own_s3_server.resume()
    assert (code, out) == (1, "") and err.count("\n") == 1, err
    assert url in err and "did not answer within 2s" in err, err
    assert elapsed < 10, elapsed


def test_a_restore_from_the_remote_tier_says_restored_not_an_interrupted_commit(
    both, tmp_path, caplog
):
    """A fresh machine restores the remote tier's newest step: its log says so in one line,
    naming the step and the URL. Before, it said "newer than the newest committed step of
    <root> (None)" and then "its commit was interrupted before the tracker moved", for a
    normal restore (issue 47)."""
    _, tier = both
    fresh = tmp_path / "fresh"
    with caplog.at_level("INFO", logger="verl_ckpt"):
        assert start({"root_dir": str(fresh), "remote": {"url": tier.url}}) == step_dir(fresh, 30)
    assert read_tracker(fresh) == 30
    text = caplog.text
    assert "interrupted" not in text and "(None)" not in text, text
    assert f"restored step 30 from the remote tier {tier.url}" in text, text
