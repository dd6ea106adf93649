"""Signed commit records (issue 45 item 2; store/signing.py, docs/signing.md).

Steps are planted as an attacker who can write the root or the bucket would plant them: a
copy of a committed step whose commit record names the new step with sizes and checksums
that match (anyone can compute them), unsigned or signed with a key of their own. With
`checkpoint.signing` such a step is never rolled forward to, resumed, pulled, verified or
rolled back to; each refusal is one line naming the step and "unsigned" / "signed with
another key", made before any other file of the step is read. Real roots and files, the
real CLI, a real S3 endpoint (moto) and, for a signed run, real Megatron ranks in Ray.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import ray

from tests.conftest import ROLES
from tests.helpers import close_all, open_all, save_everyone
from tests.test_front_door import BEFORE_RAY_DEADLINE_S
from tests.test_recipe import start_recipe
from tests.test_remote_units import committed_step
from verl_ckpt import CheckpointCoordinator, prepare_start, read_tracker, step_dir
from verl_ckpt.cli.main import main
from verl_ckpt.commit.steps import commit_step
from verl_ckpt.protocol.config import SigningConfig, to_checkpoint_config
from verl_ckpt.protocol.errors import (
    CheckpointConfigError,
    CheckpointError,
    CommitRecordError,
    SignatureError,
    TrackerError,
)
from verl_ckpt.remote.tier import commit_remote_step
from verl_ckpt.store.commit_record import read_commit_record, sign_record, write_commit_record
from verl_ckpt.store.fsspec_store import FsspecStore
from verl_ckpt.store.layout import COMMIT_RECORD_FILENAME
from verl_ckpt.store.recovery import recover_root
from verl_ckpt.store.signing import Keyring, key_id, load_keyring
from verl_ckpt.store.tracker import write_tracker

KEY = b"k3y-0f-the-team-" + b"s3cr3t-bytes-42"
OTHER = b"an-attacker-of-their-own-key"


@pytest.fixture
def key_file(tmp_path) -> Path:
    path = tmp_path / "keys" / "signing.key"
    path.parent.mkdir()
    path.write_bytes(KEY + b"\n")
    return path


def signed_step(root: Path, step: int, keyring: Keyring | None) -> None:
    """A committed step (tests/test_remote_units.committed_step), its record re-signed."""
    record = committed_step(root, step)
    write_commit_record(step_dir(root, step), sign_record(record, keyring))


def plant(root: Path, source: int, step: int, keyring: Keyring | None = None) -> Path:
    """A copy of committed step `source` as step `step`, its record naming `step` with the
    same sizes and checksums: unsigned, or signed with `keyring` (an attacker's key). Its
    files are left as they are (lock_files makes them unreadable)."""
    target = step_dir(root, step)
    shutil.copytree(step_dir(root, source), target)
    record = read_commit_record(step_dir(root, source))
    record.step, record.signature = step, None
    write_commit_record(target, sign_record(record, keyring))
    return target


def lock_files(step_path: Path) -> None:
    """Every file of the step but its record becomes a directory of the same name: a read
    of any of them fails (as root too) with another error than the record's refusal."""
    for path in [p for p in step_path.rglob("*") if p.is_file()]:
        if path.name != COMMIT_RECORD_FILENAME:
            path.unlink()
            path.mkdir()


def cli(capsys, *argv) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def start(cfg: dict) -> Path | None:
    plan = prepare_start(cfg)
    plan.release()
    return plan.resume_dir


# ---- the record ---------------------------------------------------------------------------


def test_the_finalizers_record_is_signed_and_read_back_with_an_accepted_key_only(tmp_path):
    keyring = Keyring([KEY])
    from tests.test_commit import driver_report

    commit_step(tmp_path, 3, {"driver": 1}, [driver_report(tmp_path, 3)], keyring=keyring)
    raw = json.loads((step_dir(tmp_path, 3) / COMMIT_RECORD_FILENAME).read_bytes())
    assert raw["signature"]["alg"] == "hmac-sha256"
    assert raw["signature"]["key_id"] == key_id(KEY) == keyring.key_ids[0]
    assert read_commit_record(tmp_path, 3, keyring).step == 3
    assert read_commit_record(tmp_path, 3).signature == raw["signature"]  # no key: as today
    with pytest.raises(SignatureError, match=r"global_step_3.* signed with another key"):
        read_commit_record(tmp_path, 3, Keyring([OTHER]))


def test_a_signed_record_changed_after_signing_is_refused(tmp_path):
    keyring = Keyring([KEY])
    signed_step(tmp_path, 2, keyring)
    path = step_dir(tmp_path, 2) / COMMIT_RECORD_FILENAME
    raw = json.loads(path.read_bytes())
    raw["files"][0]["size"] += 1
    path.write_text(json.dumps(raw))
    with pytest.raises(SignatureError, match="signed with another key") as caught:
        read_commit_record(tmp_path, 2, keyring)
    assert "\n" not in str(caught.value)
    assert raw["signature"]["mac"] not in str(caught.value)


def test_an_unsigned_record_is_refused_with_a_key_and_read_as_today_without(tmp_path):
    committed_step(tmp_path, 2)
    with pytest.raises(SignatureError, match=r"step .*global_step_2 is refused: .* unsigned"):
        read_commit_record(tmp_path, 2, Keyring([KEY]))
    assert read_commit_record(tmp_path, 2).step == 2


def test_keyring_repr_and_key_errors_never_show_a_key(tmp_path, monkeypatch):
    keyring = Keyring([KEY, OTHER])
    assert KEY.decode() not in repr(keyring) and key_id(KEY) in repr(keyring)
    missing = tmp_path / "nowhere.key"
    with pytest.raises(CheckpointConfigError, match=r"signing.key_file=.*nowhere.key"):
        load_keyring(SigningConfig(key_file=str(missing)))
    empty = tmp_path / "empty.key"
    empty.write_bytes(b" \n")
    with pytest.raises(CheckpointConfigError, match="the key file is empty"):
        load_keyring(SigningConfig(key_file=str(empty)))
    monkeypatch.delenv("VERL_TEST_SIGNING_KEY", raising=False)
    with pytest.raises(CheckpointConfigError, match=r"\$VERL_TEST_SIGNING_KEY is not set"):
        load_keyring(SigningConfig(key_env="VERL_TEST_SIGNING_KEY"))
    monkeypatch.setenv("VERL_TEST_SIGNING_KEY", KEY.decode())
    assert load_keyring(SigningConfig(key_env="VERL_TEST_SIGNING_KEY")) == Keyring([KEY])


def test_signing_config_is_checked_by_the_front_door():
    cfg = to_checkpoint_config({"signing": {"key_env": "TEAM_KEY"}})
    assert cfg.signing.key_env == "TEAM_KEY" and cfg.signing.enabled
    with pytest.raises(CheckpointConfigError, match=r"checkpoint.signing.kye_file"):
        to_checkpoint_config({"signing": {"kye_file": "x"}})
    with pytest.raises(CheckpointConfigError, match="not both"):
        to_checkpoint_config({"signing": {"key_file": "a", "key_env": "B"}})
    with pytest.raises(CheckpointConfigError, match="the key that signs"):
        to_checkpoint_config({"signing": {"accepted_key_files": ["old.key"]}})
    with pytest.raises(CheckpointConfigError, match="must name an environment variable"):
        to_checkpoint_config({"signing": {"key_env": "not a name"}})


# ---- a planted step at start-up -----------------------------------------------------------


@pytest.fixture
def signed_root(tmp_path, key_file) -> Path:
    """Steps 1 and 2 committed and signed with KEY; the tracker names step 2."""
    root = tmp_path / "ckpt"
    for step in (1, 2):
        signed_step(root, step, Keyring([KEY]))
    write_tracker(root, 2)
    return root


@pytest.mark.parametrize("attacker", [None, Keyring([OTHER])], ids=["unsigned", "other_key"])
def test_I1_a_planted_newer_step_is_not_rolled_forward_to_nor_resumed(
    signed_root, key_file, attacker, caplog
):
    planted = plant(signed_root, 2, 99, attacker)
    lock_files(planted)
    cfg = {"root_dir": str(signed_root), "signing": {"key_file": str(key_file)}}
    assert start(cfg) == step_dir(signed_root, 2)
    assert read_tracker(signed_root) == 2
    why = "unsigned" if attacker is None else "signed with another key"
    assert any("global_step_99" in r.getMessage() and why in r.getMessage() for r in caplog.records)
    # The planted step was not rolled forward to by recovery either (the finalizer's).
    state = recover_root(signed_root, Keyring([KEY]))
    assert state.tracker == 2 and 99 in state.uncommitted
    # Without a key (the behaviour of today), the same root rolls forward: what signing adds.
    assert recover_root(signed_root).tracker == 99


def test_I1_a_validly_signed_record_copied_to_another_step_number_is_not_that_step(
    signed_root, key_file, caplog
):
    """A signature binds the record's bytes, whose step is 2: the same step copied whole
    (record untouched, signed with the job's own key) as global_step_99 is neither rolled
    forward to nor counted or deleted by retention (before: start-up moved the tracker to
    99 for good, and retention with keep=1 deleted the genuine step 1)."""
    from verl_ckpt.store.retention import apply_retention

    shutil.copytree(step_dir(signed_root, 2), step_dir(signed_root, 99))
    cfg = {"root_dir": str(signed_root), "signing": {"key_file": str(key_file)}}
    assert start(cfg) == step_dir(signed_root, 2)
    assert read_tracker(signed_root) == 2
    assert any("names step 2, not 99" in r.getMessage() for r in caplog.records)
    with pytest.raises(CommitRecordError, match="names step 2, not 99"):
        read_commit_record(signed_root, 99, Keyring([KEY]))
    outcome = apply_retention(signed_root, 2, keyring=Keyring([KEY]))
    assert outcome.deleted == [] and outcome.unreadable == [99]
    assert step_dir(signed_root, 1).is_dir() and step_dir(signed_root, 99).is_dir()


def test_a_tracker_naming_a_planted_step_is_refused_in_one_line(signed_root, key_file):
    plant(signed_root, 2, 99)
    write_tracker(signed_root, 99)
    cfg = {"root_dir": str(signed_root), "signing": {"key_file": str(key_file)}}
    with pytest.raises(TrackerError, match=r"names step 99.*global_step_99 is refused.*unsigned"):
        start(cfg)


def test_a_planted_resume_path_is_refused_before_its_files_are_read(signed_root, key_file):
    planted = plant(signed_root, 2, 99)
    lock_files(planted)
    cfg = {
        "root_dir": str(signed_root.parent / "other"),
        "signing": {"key_file": str(key_file)},
        "resume_mode": "resume_path",
        "resume_from_path": str(planted),
        "resume_verify": "checksums",
    }
    with pytest.raises(SignatureError, match=r"resume_from_path: step .*global_step_99.*unsigned"):
        start(cfg)


def test_rotation_the_old_key_is_accepted_and_the_new_key_signs(signed_root, key_file, tmp_path):
    new_key = tmp_path / "keys" / "new.key"
    new_key.write_bytes(b"the-new-key-of-the-next-quarter")
    cfg = {
        "root_dir": str(signed_root),
        "signing": {"key_file": str(new_key), "accepted_key_files": [str(key_file)]},
    }
    keyring = load_keyring(to_checkpoint_config(cfg).signing)
    assert keyring.key_ids == (key_id(b"the-new-key-of-the-next-quarter"), key_id(KEY))
    assert start(cfg) == step_dir(signed_root, 2)  # signed with the old key: accepted
    from tests.test_commit import driver_report

    commit_step(signed_root, 3, {"driver": 1}, [driver_report(signed_root, 3)], keyring=keyring)
    raw = json.loads((step_dir(signed_root, 3) / COMMIT_RECORD_FILENAME).read_bytes())
    assert raw["signature"]["key_id"] == keyring.key_ids[0]
    # Once the old key is dropped, its steps are no longer trusted.
    only_new = {"root_dir": str(signed_root), "signing": {"key_file": str(new_key)}}
    assert start(only_new) == step_dir(signed_root, 3)
    with pytest.raises(SignatureError, match="signed with another key"):
        read_commit_record(signed_root, 2, load_keyring(to_checkpoint_config(only_new).signing))


def test_recipe_with_a_missing_key_file_exits_2_in_one_line_before_ray(tmp_path):
    root = tmp_path / "ckpt"
    missing = tmp_path / "no.key"
    proc = start_recipe(
        tmp_path / "run", f"checkpoint.root_dir={root}", f"+checkpoint.signing.key_file={missing}"
    )
    output, _ = proc.communicate(timeout=BEFORE_RAY_DEADLINE_S)
    assert proc.returncode == 2, output
    assert output.strip().splitlines() == [
        f"ppo_toy: error: checkpoint.signing.key_file={str(missing)!r}: the key file cannot be "
        "read: No such file or directory"
    ], output


# ---- the CLI --------------------------------------------------------------------------------


def test_cli_verify_ls_rollback_refuse_a_planted_step(signed_root, key_file, capsys):
    planted = plant(signed_root, 2, 99)
    lock_files(planted)
    flag = ("--signing-key-file", key_file)
    code, out, err = cli(capsys, "verify", signed_root, "--step", 99, *flag)
    assert code == 1 and len(err.strip().splitlines()) == 1, err
    assert "global_step_99 is refused" in err and "unsigned" in err
    code, out, err = cli(capsys, "verify", signed_root, "--step", 2, *flag)
    assert code == 0, err
    code, out, err = cli(capsys, "ls", signed_root, *flag)
    assert code == 0
    line = next(line for line in out.splitlines() if " 99 " in line)
    assert "refused: unsigned" in line, out
    code, out, err = cli(capsys, "rollback", signed_root, "--to", 99, *flag)
    assert code == 1 and "cannot roll back to step 99" in err and "unsigned" in err, err
    code, out, err = cli(capsys, "verify", signed_root, "--step", 2, "--signing-key-file", "/nope")
    assert code == 2 and "--signing-key-file='/nope'" in err, err


# ---- the remote tier ------------------------------------------------------------------------


def s3_tier(s3_server) -> FsspecStore:
    return FsspecStore(f"s3://{s3_server.new_bucket()}/ckpt", s3_server.storage_options())


def test_a_planted_remote_step_is_not_pulled_nor_downloaded_at_start_up(
    s3_server, signed_root, key_file, tmp_path, capsys
):
    tier = s3_tier(s3_server)
    for step in (1, 2):
        commit_remote_step(tier, signed_root, step, (), 2, 60)
    # The attacker's step 99 in the bucket: a copy of step 2 under a record naming 99.
    source = tmp_path / "attacker"
    shutil.copytree(step_dir(signed_root, 2), step_dir(source, 2))
    plant(source, 2, 99)
    commit_remote_step(tier, source, 99, (), 2, 60)
    fresh = tmp_path / "fresh"
    cfg = {
        "root_dir": str(fresh),
        "remote": {"url": tier.url, "storage_options": s3_server.storage_options()},
        "signing": {"key_file": str(key_file)},
    }
    # The attacker moved the remote tracker too: the start is refused in one line naming
    # the step, nothing downloaded (resuming from step 2 instead would go unnoticed).
    with pytest.raises(CommitRecordError, match=r"step 99.*global_step_99 is refused.*unsign"):
        start(cfg)
    assert not step_dir(fresh, 99).exists() and not step_dir(fresh, 2).exists()
    # With the remote tracker left at step 2: the newest signed step is downloaded, not 99.
    write_tracker(tier, 2)
    assert start(cfg) == step_dir(fresh, 2)
    assert not step_dir(fresh, 99).exists()
    options = json.dumps(s3_server.storage_options())
    code, out, err = cli(
        capsys,
        "pull",
        tier.url,
        "--step",
        99,
        tmp_path / "pulled",
        "--storage-options",
        options,
        "--signing-key-file",
        key_file,
    )
    assert code == 1 and "global_step_99 is refused" in err and "unsigned" in err, err
    assert not step_dir(tmp_path / "pulled", 99).exists()
    code, out, err = cli(capsys, "verify", tier.url, "--step", 99, "--storage-options", options)
    assert code == 0, err  # without a key: as today (the record and files match)
    code, out, err = cli(
        capsys,
        "verify",
        tier.url,
        "--step",
        99,
        "--storage-options",
        options,
        "--signing-key-file",
        key_file,
    )
    assert code == 1 and "unsigned" in err, err


# ---- a signed run on real ranks ---------------------------------------------------------------


def test_a_signed_run_commits_and_resumes_and_the_key_is_nowhere(
    ranks, s3_server, tmp_path, capfd, monkeypatch
):
    """Real ranks, the finalizer actor and an S3 remote tier: every record (local and
    remote) is signed; a planted newer step is neither rolled forward to by the finalizer
    nor resumed; the key's bytes are in no file under the root or the bucket, in no output,
    and not in the finalizer's describe()."""
    monkeypatch.setenv("VERL_TEST_SIGNING_KEY", KEY.decode())
    url = f"s3://{s3_server.new_bucket()}/ckpt"
    cfg = {
        "root_dir": str(tmp_path / "ckpt"),
        "timeout_s": 60.0,
        "signing": {"key_env": "VERL_TEST_SIGNING_KEY"},
        "remote": {"url": url, "storage_options": s3_server.storage_options()},
    }
    root = Path(cfg["root_dir"])
    coordinator = CheckpointCoordinator(cfg, ROLES)
    open_all(ranks, cfg)
    for step in (1, 2):
        save_everyone(ranks, coordinator, step)
        coordinator.wait_for_commit(step)
    described = ray.get(coordinator.finalizer.describe.remote())
    assert described["signing"] == [key_id(KEY)]
    assert KEY.decode() not in repr(described)
    coordinator.wait_for_uploads()
    close_all(ranks, coordinator)
    keyring = Keyring([KEY])
    tier = FsspecStore(url, s3_server.storage_options())
    for store in (root, tier):
        for step in (1, 2):
            assert read_commit_record(store, step, keyring).step == step
    # A planted step 99; the next start (driver and finalizer) resumes from step 2.
    plant(root, 2, 99)
    coordinator = CheckpointCoordinator(cfg, ROLES)
    assert coordinator.resume_dir() == step_dir(root, 2)
    assert read_tracker(root) == 2
    open_all(ranks, cfg)
    ray.get([w.load.remote(str(step_dir(root, 2))) for group in ranks.values() for w in group])
    close_all(ranks, coordinator)
    assert read_tracker(root) == 2
    shutil.rmtree(step_dir(root, 99))
    # The key is in no file of either tier, nor in anything printed.
    for path in root.rglob("*"):
        if path.is_file():
            assert KEY not in path.read_bytes(), path
    for name in tier.fs.find(url):
        assert KEY not in tier.fs.cat_file(name), name
    out, err = capfd.readouterr()
    assert KEY.decode() not in out + err


def test_I3_retention_neither_counts_nor_deletes_a_planted_step(signed_root):
    """keep=1: a planted step 99 takes no place of the job's own (step 2 is kept, step 1
    goes), and it is not the job's to delete either."""
    from verl_ckpt.store.retention import apply_retention

    plant(signed_root, 2, 99)
    outcome = apply_retention(signed_root, 1, keyring=Keyring([KEY]))
    assert outcome.deleted == [1] and outcome.unreadable == [99]
    assert step_dir(signed_root, 2).is_dir() and step_dir(signed_root, 99).is_dir()


def test_I3_retention_parses_a_record_again_only_when_its_bytes_changed_and_then_checks_it(
    tmp_path, monkeypatch
):
    """The finalizer's retention remembers the records it found valid (VerifiedRecords):
    an unchanged record is not parsed again (a spy counts the real parse), and a record
    replaced after it was found valid (signed with another key) is checked again and
    refused: neither counted toward keep nor deleted."""
    from verl_ckpt.store import commit_record
    from verl_ckpt.store.record_cache import VerifiedRecords
    from verl_ckpt.store.retention import apply_retention

    keyring = Keyring([KEY])
    verified = VerifiedRecords(keyring)
    for step in (1, 2, 3):
        signed_step(tmp_path, step, keyring)
    first = (step_dir(tmp_path, 1) / COMMIT_RECORD_FILENAME).read_bytes()
    parsed: list[str] = []
    parse = commit_record.parse_commit_record
    monkeypatch.setattr(
        commit_record,
        "parse_commit_record",
        lambda data, path: parsed.append(str(path)) or parse(data, path),
    )
    assert apply_retention(tmp_path, 5, keyring=keyring, verified=verified).unreadable == []
    assert len(parsed) == 3
    parsed.clear()
    assert apply_retention(tmp_path, 5, keyring=keyring, verified=verified).unreadable == []
    assert parsed == []
    record = read_commit_record(step_dir(tmp_path, 2))
    record.signature = None
    write_commit_record(step_dir(tmp_path, 2), sign_record(record, Keyring([OTHER])))
    parsed.clear()
    outcome = apply_retention(tmp_path, 1, keyring=keyring, verified=verified)
    assert outcome.unreadable == [2] and outcome.deleted == [1]
    assert step_dir(tmp_path, 2).is_dir() and step_dir(tmp_path, 3).is_dir()
    assert len(parsed) == 0  # refused by its signature, before any parse
    # The same bytes as a verified record, in another step's directory: parsed, and refused
    # there (it names step 3); and what was deleted is forgotten.
    step_dir(tmp_path, 7).mkdir()
    copied = (step_dir(tmp_path, 3) / COMMIT_RECORD_FILENAME).read_bytes()
    (step_dir(tmp_path, 7) / COMMIT_RECORD_FILENAME).write_bytes(copied)
    outcome = apply_retention(tmp_path, 1, keyring=keyring, verified=verified)
    assert outcome.unreadable == [2, 7] and outcome.deleted == [] and len(parsed) == 1
    assert not verified.knows("global_step_1", first)  # deleted at the retention before
    assert verified.knows("global_step_3", copied)
    assert not verified.knows("global_step_7", copied)


def test_verified_records_serve_only_the_keyring_they_were_made_with(tmp_path):
    """A memory of records valid without a key (unsigned ones among them) must not vouch
    for them under a key, nor the other way round."""
    from verl_ckpt.store.record_cache import VerifiedRecords
    from verl_ckpt.store.retention import apply_retention

    signed_step(tmp_path, 1, None)
    unsigned = VerifiedRecords()
    assert apply_retention(tmp_path, 5, verified=unsigned).unreadable == []
    with pytest.raises(ValueError, match="other signing keys"):
        apply_retention(tmp_path, 5, keyring=Keyring([KEY]), verified=unsigned)
    with pytest.raises(ValueError, match="other signing keys"):
        apply_retention(tmp_path, 5, verified=VerifiedRecords(Keyring([KEY])))
    assert apply_retention(tmp_path, 5, keyring=Keyring([KEY])).unreadable == [1]


def test_cli_rollback_completing_an_interrupted_one_still_refuses_an_unsigned_target(
    signed_root, key_file, capsys
):
    """Found by review: rollback --to N with a signing key returned the journaled rollback
    to N before the target's record was read, so completing an interrupted rollback moved the
    tracker to an unsigned step (here planted, and a keyless rollback to it interrupted)."""
    from tests.test_rollback import crash_during_rollback
    from verl_ckpt.store.tracker import read_tracker as tracker_of

    plant(signed_root, 2, 99)
    signed_step(signed_root, 100, Keyring([KEY]))
    write_tracker(signed_root, 100)
    crash_during_rollback(signed_root, 99)  # keyless: step 100 moved, then the process died
    code, _, err = cli(capsys, "rollback", signed_root, "--to", 99, "--signing-key-file", key_file)
    assert code == 1 and "cannot roll back to step 99" in err and "unsigned" in err, err
    assert tracker_of(signed_root) == 100
    # Nor does start-up recovery (found by review too: the finalizer's recover_root
    # completed the interrupted rollback with no key), which now verifies its target.
    with pytest.raises(CheckpointError, match=r"cannot be completed: .*unsigned"):
        recover_root(signed_root, Keyring([KEY]))
    assert tracker_of(signed_root) == 100


def test_a_record_nested_too_deeply_is_one_unreadable_step_with_a_key_too(signed_root, key_file):
    """A planted record of 100,000 nested lists: without a key it was already one step that
    is not committed ("nested too deeply"); with one, its signature check raised
    RecursionError, which no caller catches, out of start-up, recovery and retention."""
    planted = step_dir(signed_root, 99)
    planted.mkdir()
    (planted / COMMIT_RECORD_FILENAME).write_bytes(b"[" * 100_000 + b"]" * 100_000)
    with pytest.raises(CommitRecordError, match="nested too deeply"):
        read_commit_record(signed_root, 99, Keyring([KEY]))
    state = recover_root(signed_root, Keyring([KEY]))
    assert state.tracker == 2 and 99 in state.uncommitted
    cfg = {"root_dir": str(signed_root), "signing": {"key_file": str(key_file)}}
    assert start(cfg) == step_dir(signed_root, 2)
