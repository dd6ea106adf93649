"""The `verl-ckpt` tool on a real checkpoint root: a real megatron-core GPTModel rank (gloo,
in a Ray actor) saving through CheckpointManager, the real finalizer committing, real files.

Most tests call `main()` in-process (each fresh interpreter pays seconds of torch and
megatron imports); one test runs `python -m verl_ckpt.cli.main` as a user does.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from importlib.metadata import entry_points
from pathlib import Path

import pytest
import ray

from recipes.megatron_cpu import TinyGPTConfig
from tests.conftest import REPO_ROOT
from tests.rank_worker import start_world
from verl_ckpt import CheckpointCoordinator, read_commit_record, step_dir
from verl_ckpt.cli.main import main
from verl_ckpt.store.layout import COMMIT_RECORD_FILENAME, DRIVER_STATE_FILENAME
from verl_ckpt.store.tracker import tracker_path, write_tracker
from verl_ckpt.store.verification import available_cores

COMMITTED = (1, 2, 3)
LEFTOVER = 4  # written by the rank, never committed: the driver's state is never reported


@pytest.fixture(scope="module")
def produced_root(ray_local, tmp_path_factory) -> Path:
    """Steps 1-3 committed (tracker at 3) and step 4 an uncommitted leftover, as a job that
    stopped in the middle of a save leaves them. Tests must not modify it: see `root_copy`."""
    root = tmp_path_factory.mktemp("cli") / "ckpt"
    cfg = {"root_dir": str(root), "timeout_s": 60}
    (worker,) = start_world("actor", 1, tp=1)
    coordinator = CheckpointCoordinator(cfg, {"actor": 1})
    try:
        ray.get(worker.train.remote(1))
        ray.get(worker.open_manager.remote(cfg))
        for step in COMMITTED:
            ray.get(worker.save.remote(step))
            coordinator.save_driver_state(step, {"step": step})
            coordinator.wait_for_commit(step)
        ray.get(worker.save.remote(LEFTOVER))
        ray.get(worker.wait.remote(60))  # the rank's files are written and reported
        ray.get(worker.close.remote())
    finally:
        coordinator.close()
        ray.kill(worker)
    return root


@pytest.fixture
def root_copy(produced_root, tmp_path) -> Path:
    """A private copy of the produced root, for tests that damage or prune it."""
    return Path(shutil.copytree(produced_root, tmp_path / "ckpt"))


def run_cli(capsys, *argv) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def table_rows(out: str) -> dict[int, tuple[bool, list[str]]]:
    """`ls` rows by step: (marked as the tracker's target, the remaining cells)."""
    rows = {}
    for line in out.splitlines():
        cells = line.split()
        marked = bool(cells) and cells[0] == "*"
        cells = cells[1:] if marked else cells
        if cells and cells[0].isdigit():
            rows[int(cells[0])] = (marked, cells[1:])
    return rows


def steps_on_disk(root: Path) -> list[int]:
    return sorted(int(p.name.removeprefix("global_step_")) for p in root.glob("global_step_*"))


def test_I1_ls_shows_committed_steps_tracker_target_roles_and_leftover(produced_root, capsys):
    code, out, err = run_cli(capsys, "ls", produced_root)
    assert code == 0 and err == ""
    assert "tracker: step 3" in out
    rows = table_rows(out)
    assert sorted(rows) == [*COMMITTED, LEFTOVER]
    for step in COMMITTED:
        marked, cells = rows[step]
        assert marked == (step == 3)
        assert cells[-2:] == ["actor:1,driver:1", "committed"]
    marked, cells = rows[LEFTOVER]
    assert not marked
    assert cells[-3:] == ["actor", "not", "committed"]


def test_I1_I2_ls_shows_corrupt_records_and_unreadable_tracker(root_copy, capsys):
    (step_dir(root_copy, 1) / COMMIT_RECORD_FILENAME).write_text("{not json")
    record_2 = step_dir(root_copy, 2) / COMMIT_RECORD_FILENAME
    record_2.write_text(record_2.read_text().replace('"format_version": 1', '"format_version": 99'))
    tracker_path(root_copy).write_text("three\n")
    code, out, err = run_cli(capsys, "ls", root_copy)
    assert code == 0 and err == ""
    assert f"tracker: unreadable: tracker {tracker_path(root_copy)}" in out
    lines = {step: line for line in out.splitlines() for step in table_rows(line)}
    assert "corrupt: commit record" in lines[1] and "is corrupt" in lines[1]
    assert "corrupt: " in lines[2] and "format_version 99" in lines[2]
    assert lines[3].endswith("committed") and "*" not in lines[3]


def test_I1_verify_rereads_every_committed_file(produced_root, capsys):
    record = read_commit_record(step_dir(produced_root, 3))
    total = sum(f.size for f in record.files)
    code, out, err = run_cli(capsys, "verify", produced_root)
    assert (code, err) == (0, "")
    # Throughput, and every available core used (one file per thread at a time).
    threads = min(available_cores(), len(record.files))
    pattern = (
        rf"OK step 3: {len(record.files)} files, {total} bytes verified in \d+\.\d{{3}} s "
        rf"\(\d+\.\d{{2}} GB/s, {threads} threads\)\n"
    )
    assert re.fullmatch(pattern, out), out
    code, out, _ = run_cli(capsys, "verify", produced_root, "--step", 1)
    assert code == 0 and out.startswith("OK step 1: ")


def test_I1_verify_names_each_truncated_bit_flipped_or_missing_file(root_copy, capsys):
    path = step_dir(root_copy, 3)
    expected = {f.path: f for f in read_commit_record(path).files}
    truncated, flipped, missing = "actor/__0_0.distcp", "actor/__0_1.distcp", DRIVER_STATE_FILENAME
    os.truncate(path / truncated, expected[truncated].size // 2)
    data = bytearray((path / flipped).read_bytes())
    data[len(data) // 2] ^= 0x10  # one bit, same size: only the checksum can tell
    (path / flipped).write_bytes(data)
    (path / missing).unlink()
    code, out, err = run_cli(capsys, "verify", root_copy)
    assert code == 1 and err == ""
    lines = out.splitlines()
    assert lines[0] == f"FAILED step 3: 3 problem(s) in {len(expected)} files"
    assert sorted(lines[1:]) == sorted(
        [
            f"{path / truncated}: size {expected[truncated].size // 2}, "
            f"expected {expected[truncated].size}",
            next(line for line in lines if line.startswith(f"{path / flipped}: checksum ")),
            f"{path / missing}: missing",
        ]
    )
    assert f"expected {expected[flipped].checksum}" in out
    # The untouched step still verifies: damage is reported per step, not per root.
    assert run_cli(capsys, "verify", root_copy, "--step", 2)[0] == 0


def test_I1_verify_and_inspect_refuse_an_uncommitted_step(produced_root, capsys):
    for command in ("verify", "inspect"):
        code, out, err = run_cli(capsys, command, produced_root, "--step", LEFTOVER)
        assert code == 1 and out == ""
        assert err.count("\n") == 1
        assert f"{step_dir(produced_root, LEFTOVER)} is not a committed step" in err


def test_I7_inspect_lists_the_torch_dist_tensors_of_each_role(produced_root, capsys):
    cfg = TinyGPTConfig()
    code, out, err = run_cli(capsys, "inspect", produced_root, "--step", 2)
    assert code == 0 and err == ""
    assert "participants: actor x1, driver x1" in out
    assert f"role actor ({step_dir(produced_root, 2) / 'actor'})" in out
    embedding = next(line for line in out.splitlines() if "word_embeddings.weight" in line)
    assert embedding.split()[1:] == [
        "float32",
        f"[{cfg.vocab_size},",
        f"{cfg.hidden_size}]",
        str(cfg.vocab_size * cfg.hidden_size * 4),
    ]
    assert "optimizer.state.exp_avg.output_layer.weight" in out

    code, out, _ = run_cli(capsys, "inspect", produced_root, "--step", 2, "--json")
    assert code == 0
    report = json.loads(out)
    assert report["step"] == 2 and report["participants"] == {"actor": 1, "driver": 1}
    actor = report["roles"]["actor"]
    by_key = {e["key"]: e for e in actor["entries"]}
    assert by_key["embedding.position_embeddings.weight"] == {
        "key": "embedding.position_embeddings.weight",
        "kind": "tensor",
        "nbytes": cfg.seq_length * cfg.hidden_size * 4,
        "dtype": "float32",
        "shape": [cfg.seq_length, cfg.hidden_size],
    }
    assert actor["total_bytes"] == sum(e["nbytes"] for e in actor["entries"])
    assert any(e["kind"] == "bytes" and e["nbytes"] > 0 for e in actor["entries"])


def test_I3_prune_dry_run_deletes_nothing(root_copy, capsys):
    code, out, err = run_cli(capsys, "prune", root_copy, "--keep", 1, "--dry-run")
    assert code == 0 and err == ""
    assert f"would delete step 1: {step_dir(root_copy, 1)}" in out
    assert f"would delete step 2: {step_dir(root_copy, 2)}" in out
    assert steps_on_disk(root_copy) == [*COMMITTED, LEFTOVER]
    assert all((step_dir(root_copy, s) / COMMIT_RECORD_FILENAME).is_file() for s in COMMITTED)


def test_I3_prune_keeps_newest_committed_and_leaves_uncommitted_alone(root_copy, capsys):
    code, out, _ = run_cli(capsys, "prune", root_copy, "--keep", 1)
    assert code == 0
    assert "deleted step 1:" in out and "deleted step 2:" in out
    assert f"left alone step {LEFTOVER}: not committed" in out
    # The leftover does not count toward "keep 1" and is not deleted (I3).
    assert steps_on_disk(root_copy) == [3, LEFTOVER]
    assert run_cli(capsys, "verify", root_copy)[0] == 0


def test_I3_prune_never_deletes_the_tracker_target(root_copy, capsys):
    write_tracker(root_copy, 1)  # a user rolled the tracker back to step 1 by hand
    code, out, _ = run_cli(capsys, "prune", root_copy, "--keep", 1)
    assert code == 0
    assert "deleted step 2:" in out and "deleted step 1" not in out
    assert "kept committed steps: [1, 3]; tracker's target: 1" in out
    assert steps_on_disk(root_copy) == [1, 3, LEFTOVER]
    assert run_cli(capsys, "verify", root_copy)[1].startswith("OK step 1: ")


def test_I3_prune_refuses_when_the_tracker_names_a_step_without_a_record(root_copy, capsys):
    """From helper-57's review: a rollback of a tier that cannot rename deletes the newer
    steps and moves the tracker last; interrupted in between, the tracker names a step
    without its record. Retention spares only the tracker's step, so prune --keep 1 deleted
    every older committed step, the rollback's target among them."""
    (step_dir(root_copy, 3) / COMMIT_RECORD_FILENAME).unlink()  # as the rollback left it
    code, out, err = run_cli(capsys, "prune", root_copy, "--keep", 1)
    assert (code, out) == (1, "") and err.count("\n") == 1, err
    assert f"{tracker_path(root_copy)} names step 3, which has no commit record" in err
    assert steps_on_disk(root_copy) == [*COMMITTED, LEFTOVER]


def test_I3_prune_refuses_when_the_tracker_is_unreadable(root_copy, capsys):
    tracker_path(root_copy).write_bytes(b"\xef\xbb\xbf3\n")
    code, out, err = run_cli(capsys, "prune", root_copy, "--keep", 1)
    assert code == 1 and out == ""
    assert str(tracker_path(root_copy)) in err and "refusing to prune" in err
    assert steps_on_disk(root_copy) == [*COMMITTED, LEFTOVER]


def _corrupt_record(root: Path) -> None:
    (step_dir(root, 3) / COMMIT_RECORD_FILENAME).write_text("")


def _unknown_version(root: Path) -> None:
    record = step_dir(root, 3) / COMMIT_RECORD_FILENAME
    record.write_text(json.dumps({**json.loads(record.read_text()), "format_version": 2}))


def _tracker_names_missing_step(root: Path) -> None:
    write_tracker(root, 9)


@pytest.mark.parametrize(
    ("argv", "damage", "code", "names"),
    [
        pytest.param(["ls", "{root}/nope"], None, 2, "{root}/nope does not exist", id="no-root"),
        # From review: listed as a root holding nothing yet (exit 0), and a bad protocol was
        # named as checkpoint.remote.url, a key the command line never mentions.
        pytest.param(
            ["ls", "file://{root}/nope"],
            None,
            2,
            "ROOT file://{root}/nope does not exist or is not a directory",
            id="no-file-url-root",
        ),
        # From helper-57's review: a URL as the local directory became ./s3:/c/q, created
        # and pulled into (exit 0); a storage option of the wrong type was a traceback.
        pytest.param(
            ["pull", "file://{root}", "s3://c/q"],
            None,
            2,
            "argument ROOT: must be a local directory, not the URL 's3://c/q'",
            id="pull-into-a-url",
        ),
        pytest.param(
            ["export", "{root}", "s3://c/q", "--role", "actor"],
            None,
            2,
            "argument OUT: must be a local directory, not the URL 's3://c/q'",
            id="export-into-a-url",
        ),
        # helper-59: OUT after the options, as docs/huggingface.md writes it.
        pytest.param(
            ["export", "{root}", "--role", "actor", "s3://c/q"],
            None,
            2,
            "argument OUT: must be a local directory, not the URL 's3://c/q'",
            id="export-into-a-url-given-last",
        ),
        pytest.param(
            ["prune", "s3://b/p", "--keep", "1", "--storage-options", '{{"config_kwargs": 5}}'],
            None,
            2,
            "storage option config_kwargs must be a mapping of botocore Config settings",
            id="storage-option-of-a-wrong-type",
        ),
        pytest.param(
            ["ls", "nosuch://{root}"],
            None,
            2,
            "ROOT='nosuch://{root}' is invalid: Protocol not known: nosuch",
            id="bad-protocol",
        ),
        pytest.param(
            ["verify", "{root}/latest_checkpointed_iteration.txt"],
            None,
            2,
            "{root}/latest_checkpointed_iteration.txt is not a directory",
            id="root-is-file",
        ),
        pytest.param(
            ["inspect", "{root}/global_step_3"], None, 2, "is a step directory", id="root-is-step"
        ),
        pytest.param(
            ["verify", "{root}", "--step", "three"],
            None,
            2,
            "--step: must be a step number",
            id="bad-step",
        ),
        pytest.param(
            ["verify", "{root}", "--step", "9"],
            None,
            2,
            "{root}/global_step_9 does not exist",
            id="no-step-dir",
        ),
        pytest.param(
            ["prune", "{root}", "--keep", "0"],
            None,
            2,
            "--keep: must be an integer >= 1",
            id="keep-0",
        ),
        pytest.param(
            ["verify", "{root}"],
            _corrupt_record,
            1,
            "{root}/global_step_3/verl_ckpt_commit.json is corrupt",
            id="corrupt-record",
        ),
        pytest.param(
            ["inspect", "{root}"],
            _unknown_version,
            1,
            "verl_ckpt_commit.json has format_version 2",
            id="unknown-version",
        ),
        pytest.param(
            ["verify", "{root}"],
            _tracker_names_missing_step,
            1,
            "{root}/global_step_9 (named by the tracker",
            id="tracker-names-missing-step",
        ),
    ],
)
def test_user_errors_are_one_line_naming_the_path(root_copy, capsys, argv, damage, code, names):
    """Exit 2 for a usage error, 1 for a bad checkpoint; one line on stderr naming the path.
    No traceback: an exception escaping `main` would fail this call."""
    if damage:
        damage(root_copy)
    got, out, err = run_cli(capsys, *[a.format(root=root_copy) for a in argv])
    assert got == code and out == ""
    assert err.count("\n") == 1 and err.startswith("verl-ckpt"), err
    assert ": error: " in err and names.format(root=root_copy) in err


def test_entry_points_run_without_traceback(tmp_path):
    """`python -m verl_ckpt.cli.main` in a fresh interpreter, and the declared console script."""
    missing = tmp_path / "missing"
    done = subprocess.run(
        [sys.executable, "-m", "verl_ckpt.cli.main", "verify", str(missing)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
    )
    assert done.returncode == 2 and done.stdout == ""
    assert "Traceback" not in done.stderr
    # Only the last line is ours: importing megatron-core may warn before it.
    assert done.stderr.splitlines()[-1] == f"verl-ckpt: error: ROOT {missing} does not exist"
    (script,) = entry_points(group="console_scripts", name="verl-ckpt")
    assert script.load() is main


def test_I3_prune_of_a_step_linked_in_from_elsewhere_removes_only_the_link(
    root_copy, tmp_path, capsys
):
    """A `global_step_<N>` that is a symbolic link to a checkpoint outside the root (another
    run's committed step) counts as a step of the root, but only the link is the root's:
    deleting it must never touch what it points to. Before, the deletion renamed the link,
    then unlinked `verl_ckpt_commit.json` through it (uncommitting the other checkpoint) and
    failed with "Cannot call rmtree on a symbolic link", naming no path."""
    elsewhere = tmp_path / "shared" / "global_step_1"
    elsewhere.parent.mkdir()
    shutil.move(step_dir(root_copy, 1), elsewhere)
    step_dir(root_copy, 1).symlink_to(elsewhere, target_is_directory=True)
    code, out, err = run_cli(capsys, "prune", root_copy, "--keep", 1)
    assert (code, err) == (0, ""), err
    assert "deleted step 1:" in out and "deleted step 2:" in out
    assert steps_on_disk(root_copy) == [3, LEFTOVER]
    assert not list(root_copy.glob(".deleting_*"))
    assert (elsewhere / COMMIT_RECORD_FILENAME).is_file()
    assert read_commit_record(elsewhere).step == 1


def test_I1_a_step_directory_named_otherwise_than_step_dir_makes_is_no_step(root_copy, capsys):
    """Only the names step_dir() makes are steps: `global_step_03` (or Unicode digits) read as
    step 3 while step_dir(3) names `global_step_3`, so start-up's recovery moved the tracker
    to a step whose directory does not exist. Here step 3 is renamed `global_step_03` and
    the tracker set back to 2: `ls` lists steps 1 and 2, and recovery leaves the tracker."""
    from verl_ckpt.store.recovery import recover_root

    step_dir(root_copy, 3).rename(root_copy / "global_step_03")
    (root_copy / "global_step_\u0663").mkdir()  # an Arabic-Indic digit three
    write_tracker(root_copy, 2)
    assert recover_root(root_copy).tracker == 2
    assert tracker_path(root_copy).read_text().strip() == "2"
    code, out, _ = run_cli(capsys, "ls", root_copy)
    assert code == 0 and sorted(table_rows(out)) == [1, 2, LEFTOVER]
