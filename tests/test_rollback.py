"""`verl-ckpt rollback` (verl_ckpt/store/rollback.py) over hand-made roots, and `ls`'s leftovers.

Committed steps are made by hand (a real commit record, no Ray): steps 10, 20, 30 committed
with the tracker at 30, and step 40 an uncommitted leftover. The interrupted rollback is a
real crash: a process killed by the documented fault hook right after its first rename.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.lock_holder import REPO_ROOT, HolderProcesses
from verl_ckpt.cli.main import main
from verl_ckpt.protocol.errors import CommitRecordError, TrackerError
from verl_ckpt.protocol.faults import ENV_VAR
from verl_ckpt.startup.root_lock import LOCK_FILENAME, is_locked
from verl_ckpt.store.commit_record import CommitRecord, is_committed, write_commit_record
from verl_ckpt.store.layout import list_step_dirs, step_dir
from verl_ckpt.store.rollback import (
    ARCHIVE_PREFIX,
    INTENT_FILENAME,
    RollbackError,
    RollbackIntent,
    complete_interrupted_rollback,
    execute_rollback,
    plan_rollback,
    read_rollback_intent,
)
from verl_ckpt.store.tracker import read_tracker, tracker_path, write_tracker

COMMITTED = (10, 20, 30)
LEFTOVER = 40


def committed(root, step):
    path = step_dir(root, step)
    (path / "actor").mkdir(parents=True)
    (path / "actor" / "__0_0.distcp").write_bytes(b"x" * 64)
    write_commit_record(path, CommitRecord(step, {"actor": 1}, []))
    return path


@pytest.fixture
def root(tmp_path):
    root = tmp_path / "ckpt"
    for step in COMMITTED:
        committed(root, step)
    (step_dir(root, LEFTOVER) / "actor").mkdir(parents=True)  # a save that never committed
    write_tracker(root, 30)
    return root


@pytest.fixture
def holders():
    started = HolderProcesses()
    yield started
    started.close()


def run_cli(capsys, *argv) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def archives(root) -> dict[str, list[int]]:
    """Each rolled_back_* directory under `root` with the steps inside."""
    return {
        p.name: sorted(list_step_dirs(p))
        for p in root.iterdir()
        if p.name.startswith(ARCHIVE_PREFIX)
    }


def tree(root) -> list[tuple[str, bytes | None]]:
    """Every path under `root` with its content, but the lock file that any command creates."""
    return sorted(
        (str(p.relative_to(root)), p.read_bytes() if p.is_file() else None)
        for p in root.rglob("*")
        if p.name != LOCK_FILENAME
    )


def crash_during_rollback(root, to_step: int, delete: bool = False) -> None:
    """Run a rollback in a real process that dies (os._exit) right after its first rename."""
    code = (
        "import sys\n"
        "from verl_ckpt.store.rollback import execute_rollback, plan_rollback\n"
        "execute_rollback(sys.argv[1], plan_rollback(sys.argv[1], int(sys.argv[2]), "
        "delete=sys.argv[3] == 'delete'))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, str(root), str(to_step), "delete" if delete else "keep"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT), ENV_VAR: "rollback=exit"},
    )
    assert done.returncode == 17, f"the fault did not fire: {done.returncode} {done.stderr}"


def test_rollback_moves_newer_steps_committed_or_not_to_an_archive_then_tracker(root, capsys):
    """Every global_step_M with M > N, committed or not, leaves the step namespace into one
    dated archive, intact; then the tracker names N (I1: a committed step)."""
    code, out, err = run_cli(capsys, "rollback", root, "--to", 10)
    assert (code, err) == (0, "")
    ((archive, moved),) = archives(root).items()
    assert moved == [20, 30, LEFTOVER]
    assert out.splitlines() == [
        *(f"moved step {s} to {root / archive / f'global_step_{s}'}" for s in moved),
        "tracker: 30 -> 10",
    ]
    assert sorted(list_step_dirs(root)) == [10] and read_tracker(root) == 10
    assert is_committed(root / archive / "global_step_30")  # kept as it was
    assert not (root / INTENT_FILENAME).exists() and not is_locked(root)


def test_rollback_delete_removes_the_newer_steps(root, capsys):
    """With --delete the moved steps are removed at the end: no archive is left."""
    code, out, err = run_cli(capsys, "rollback", root, "--to", 20, "--delete")
    assert (code, err) == (0, "")
    assert out.splitlines() == [
        f"deleted step 30: {step_dir(root, 30)}",
        f"deleted step {LEFTOVER}: {step_dir(root, LEFTOVER)}",
        "tracker: 30 -> 20",
    ]
    assert sorted(list_step_dirs(root)) == [10, 20] and read_tracker(root) == 20
    assert archives(root) == {} and not (root / INTENT_FILENAME).exists()


@pytest.mark.parametrize("delete", [False, True], ids=["archive", "delete"])
def test_rollback_dry_run_changes_nothing(root, capsys, delete):
    """--dry-run lists what it would do and leaves every file as it was."""
    before = tree(root)
    argv = ["rollback", root, "--to", 10, "--dry-run", *(["--delete"] if delete else [])]
    code, out, err = run_cli(capsys, *argv)
    assert (code, err) == (0, "")
    verb = "would delete" if delete else "would move"
    assert [line.split(" to ")[0].split(":")[0] for line in out.splitlines()[:-1]] == [
        f"{verb} step {s}" for s in (20, 30, LEFTOVER)
    ]
    assert out.splitlines()[-1] == "tracker: 30 -> 10 (dry run: nothing changed)"
    assert tree(root) == before


def test_rollback_refuses_a_target_that_is_not_committed(root, capsys):
    """The tracker only ever names a committed step (I1): an uncommitted target is refused
    naming its directory (exit 1), a missing one is a usage error (exit 2)."""
    before = tree(root)
    code, out, err = run_cli(capsys, "rollback", root, "--to", LEFTOVER)
    assert (code, out) == (1, "") and err.count("\n") == 1
    assert f"cannot roll back to step {LEFTOVER}: {step_dir(root, LEFTOVER)} is not a " in err
    code, out, err = run_cli(capsys, "rollback", root, "--to", 25)
    assert (code, out) == (2, "") and f"{step_dir(root, 25)} does not exist" in err
    with pytest.raises(CommitRecordError, match="not a committed step"):
        plan_rollback(root, LEFTOVER)
    assert tree(root) == before


def test_rollback_refuses_an_unreadable_tracker(root, capsys):
    """A tracker that cannot be read is never overwritten blindly: we could not tell what a
    resume loads now."""
    tracker_path(root).write_text("thirty\n")
    before = tree(root)
    code, out, err = run_cli(capsys, "rollback", root, "--to", 10)
    assert (code, out) == (1, "") and err.count("\n") == 1
    assert f"tracker {tracker_path(root)}" in err and "refusing to roll back" in err
    with pytest.raises(TrackerError):
        plan_rollback(root, 10)
    assert tree(root) == before


@pytest.mark.parametrize(
    ("to_step", "delete"),
    [(10, False), (20, False), (10, True)],
    ids=["mid-renames", "after-all-renames-before-tracker", "delete"],
)
def test_interrupted_rollback_is_completed_and_the_tracker_ends_at_the_target(
    root, to_step, delete
):
    """A crash right after the first rename leaves the intent; completing it (what start-up
    recovery does first, before any roll-forward) finishes the moves and the tracker ends at
    N, never at a moved step. Rolling back to 20 moves 40 and 30: the crash then leaves the
    tracker naming the moved step 30, which only the intent explains."""
    crash_during_rollback(root, to_step, delete)
    intent = read_rollback_intent(root)
    newer = tuple(s for s in (20, 30, LEFTOVER) if s > to_step)
    assert (intent.to, intent.steps, intent.delete) == (to_step, newer, delete)
    assert read_tracker(root) == 30  # the crash came before the tracker
    assert LEFTOVER not in list_step_dirs(root)  # newest first: the first rename took 40
    assert archives(root) == {intent.archive: [LEFTOVER]}

    assert complete_interrupted_rollback(root) == intent
    assert read_tracker(root) == to_step
    assert sorted(list_step_dirs(root)) == [s for s in COMMITTED if s <= to_step]
    assert archives(root) == ({} if delete else {intent.archive: list(newer)})
    assert read_rollback_intent(root) is None
    assert complete_interrupted_rollback(root) is None  # nothing left to do


@pytest.mark.parametrize("planted", ["a link to a directory", "a broken link", "a file"])
def test_a_planted_intent_whose_archive_is_a_link_moves_nothing_out_of_the_root(
    root, tmp_path, capsys, planted
):
    """From helper-57's review: the archive's name was checked, but an archive that already
    existed was taken as it was. A planted intent with its archive a link to another
    directory moved the root's newer steps there, and (delete) unlinked files through it.
    The intent is a file of the root, which others may write; start-up recovery and a rerun
    of the command (which prune's refusal recommends) both complete it."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "theirs.txt").write_text("not the root's")
    archive = root / f"{ARCHIVE_PREFIX}planted"
    if planted == "a file":
        archive.write_text("")
    else:  # helper-59: a broken link failed in make_dir with a bare "File exists"
        target = elsewhere if planted == "a link to a directory" else tmp_path / "gone"
        archive.symlink_to(target, target_is_directory=True)
    intent = {"format_version": 1, "to": 20, "archive": f"{ARCHIVE_PREFIX}planted"}
    intent |= {"steps": [30, LEFTOVER], "delete": True}
    (root / INTENT_FILENAME).write_text(json.dumps(intent))
    before = tree(root)
    with pytest.raises(RollbackError, match=r"rolled_back_planted is not a directory of .*"):
        complete_interrupted_rollback(root)
    code, out, err = run_cli(capsys, "rollback", root, "--to", 20)
    assert code == 1 and out == "" and "Traceback" not in err, err
    assert err.strip().splitlines()[-1].startswith("verl-ckpt: error: the rollback archive "), err
    assert tree(root) == before and read_tracker(root) == 30
    assert sorted(p.name for p in elsewhere.iterdir()) == ["theirs.txt"]


def test_rerunning_the_command_completes_an_interrupted_rollback(root, capsys):
    """The same `verl-ckpt rollback` again completes the journaled rollback (a warning says
    so); one to another step is refused while it is pending, naming the intent file."""
    crash_during_rollback(root, 10)
    code, out, err = run_cli(capsys, "rollback", root, "--to", 20)
    assert (code, out) == (1, "")
    assert f"a rollback of {root} to step 10 was interrupted ({root / INTENT_FILENAME})" in err
    code, out, err = run_cli(capsys, "rollback", root, "--to", 10)
    assert code == 0
    assert err.startswith("verl-ckpt: warning: completing the interrupted rollback to step 10")
    assert out.splitlines()[-1] == "tracker: 30 -> 10"
    assert sorted(list_step_dirs(root)) == [10] and read_tracker(root) == 10


def test_I3_prune_refuses_while_a_rollback_is_pending_and_keeps_its_target(root, capsys):
    """An interrupted rollback to 10 leaves the tracker at 30 and the intent; a prune then
    would keep 30 (the tracker's target) and delete 10, the step the rollback goes to, and
    no command could finish the rollback afterwards. Refused, one line naming the intent and
    the way out; nothing changes. Once the rollback is completed, prune works."""
    crash_during_rollback(root, 10)
    before = tree(root)
    code, out, err = run_cli(capsys, "prune", root, "--keep", 1)
    assert (code, out) == (1, "") and err.count("\n") == 1
    assert f"a rollback of {root} to step 10 was interrupted ({root / INTENT_FILENAME})" in err
    assert f"verl-ckpt rollback {root} --to 10" in err
    assert tree(root) == before
    assert run_cli(capsys, "rollback", root, "--to", 10)[0] == 0
    assert run_cli(capsys, "prune", root, "--keep", 1)[0] == 0
    assert sorted(list_step_dirs(root)) == [10] and read_tracker(root) == 10


def test_rollback_and_prune_refused_while_another_process_holds_the_root(root, holders, capsys):
    """One root, one job: while a running job (a real process) holds the root, rollback and
    prune are refused with one line naming it (exit 2) and change nothing."""
    proc = holders.start(root)
    before = tree(root)
    for argv in (["rollback", root, "--to", 10], ["prune", root, "--keep", 1]):
        code, out, err = run_cli(capsys, *argv)
        assert (code, out) == (2, "") and err.count("\n") == 1
        assert err.startswith(f"verl-ckpt: error: checkpoint root {root} is in use by job ")
        assert f"(pid {proc.pid}, since " in err
    assert tree(root) == before
    holders.kill(proc)
    assert run_cli(capsys, "rollback", root, "--to", 10)[0] == 0


def test_a_local_root_named_by_a_file_url_is_refused_for_changes(root, holders, capsys):
    """From helper-57's review: a file:// URL is opened as a remote tier, which has no lock
    and no rollback journal. Naming a running job's root so, rollback --delete and prune
    bypassed its lock; naming a root with a rollback pending, prune deleted the rollback's
    target. Refused in one line (exit 2) naming the path to pass instead; nothing changes."""
    proc = holders.start(root)
    before = tree(root)
    for argv in (
        ["rollback", f"file://{root}", "--to", 10, "--delete"],
        ["prune", f"file://{root}", "--keep", 1],
    ):
        code, out, err = run_cli(capsys, *argv)
        assert (code, out) == (2, "") and err.count("\n") == 1, err
        assert "is a local root in use (a job or command holds it as its checkpoint root " in err
        assert f"pass its path, {root}, so that" in err
    assert tree(root) == before
    holders.kill(proc)
    # Held by nobody, it is a directory like any tier (a copy of a root may serve as one).
    assert run_cli(capsys, "prune", f"file://{root}", "--keep", 1, "--dry-run")[0] == 0
    crash_during_rollback(root, 10)
    before = tree(root)
    code, out, err = run_cli(capsys, "prune", f"file://{root}", "--keep", 1)
    assert (code, out) == (2, "") and f"(a rollback of it is pending ({INTENT_FILENAME}))" in err
    assert tree(root) == before


def test_ls_lists_leftovers_pending_rollback_archives_deletions_and_holder(root, holders, capsys):
    """`ls` shows what its table does not: the lock holder, a pending rollback, rollback
    archives with their steps, and `.deleting_*` directories of an interrupted retention."""
    crash_during_rollback(root, 20)
    intent = read_rollback_intent(root)
    (root / ".deleting_global_step_5" / "actor").mkdir(parents=True)
    proc = holders.start(root)
    code, out, err = run_cli(capsys, "ls", root)
    assert (code, err) == (0, "")
    lines = out.splitlines()
    assert "in use by: job `python -m recipes.ppo_toy` on host " in out
    assert any(line.startswith("in use by: ") and f"(pid {proc.pid}, " in line for line in lines)
    assert (
        f"pending rollback: to step 20, moving steps [30, {LEFTOVER}] ({root / INTENT_FILENAME}): "
        f"interrupted; the next job start or `verl-ckpt rollback {root} --to 20` completes it"
    ) in lines
    assert (
        f"archive {root / intent.archive}: steps [{LEFTOVER}] (moved out by verl-ckpt rollback; "
        "delete it when no longer needed)"
    ) in lines
    assert (
        f"leftover {root / '.deleting_global_step_5'}: a deletion by retention was interrupted "
        "or failed; removed after the next commit"
    ) in lines

    holders.kill(proc)
    complete_interrupted_rollback(root)
    code, out, _ = run_cli(capsys, "ls", root)
    assert "in use by" not in out and "pending rollback" not in out
    assert f"archive {root / intent.archive}: steps [30, {LEFTOVER}]" in out


def test_ls_of_a_root_without_steps_still_lists_leftovers(tmp_path, capsys):
    """An archive is listed even when no global_step_<N> directory is left."""
    (tmp_path / "rolled_back_20261123T192518" / "global_step_7").mkdir(parents=True)
    code, out, _ = run_cli(capsys, "ls", tmp_path)
    assert code == 0 and "no global_step_<N> directories" in out
    assert f"archive {tmp_path / 'rolled_back_20261123T192518'}: steps [7]" in out


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"format_version": 2}, "has format_version 2; this verl_ckpt reads version 1 only"),
        ({"archive": "../../elsewhere"}, "is malformed"),
        ({"steps": [5]}, "is malformed"),
    ],
    ids=["unknown-version", "archive-outside-root", "step-not-newer"],
)
def test_a_damaged_or_unknown_intent_is_refused_naming_its_path(root, change, message):
    """A persisted intent carries a version; one this code cannot trust is an error naming
    the file, never acted on (the archive is removed recursively with delete)."""
    intent = {"format_version": 1, "to": 10, "archive": "rolled_back_x", "steps": [20]}
    (root / INTENT_FILENAME).write_text(json.dumps({**intent, "delete": True, **change}))
    with pytest.raises(RollbackError, match=message) as refused:
        complete_interrupted_rollback(root)
    assert str(root / INTENT_FILENAME) in str(refused.value)
    assert sorted(list_step_dirs(root)) == [*COMMITTED, LEFTOVER]


def test_execute_refuses_an_intent_other_than_the_pending_one(root):
    """Two rollbacks never interleave: executing a plan while another is journaled fails."""
    crash_during_rollback(root, 10)
    other = RollbackIntent(20, "rolled_back_other", (30,), False)
    with pytest.raises(RollbackError, match="another rollback .* is pending"):
        execute_rollback(root, other)
    assert not (root / "rolled_back_other").exists()


def test_rollback_records_each_moved_committed_step_with_its_record_hash(root, capsys):
    """Regression: a rollback left no trace of what it moved out once its intent was gone,
    so a remote tier holding the moved steps brought them back at the next start. Now the
    root keeps a durable, versioned record: every committed step a rollback moved out, with
    the sha256 of its commit record's bytes (uncommitted leftovers are not in it); later
    rollbacks add to it, a completed interrupted one too."""
    import hashlib

    from verl_ckpt.store.rollback import ROLLED_BACK_FILENAME, read_rolled_back

    def digest(path):
        return hashlib.sha256((path / "verl_ckpt_commit.json").read_bytes()).hexdigest()

    hashes = {step: digest(step_dir(root, step)) for step in (20, 30)}
    assert run_cli(capsys, "rollback", root, "--to", 20, "--delete")[0] == 0
    assert (root / ROLLED_BACK_FILENAME).is_file()
    assert [(e.step, e.record_sha256, e.to) for e in read_rolled_back(root)] == [
        (30, hashes[30], 20)
    ]
    # A new step 30 (another record), then an interrupted rollback to 10, completed.
    committed(root, 30)
    write_tracker(root, 30)
    new30 = digest(step_dir(root, 30))
    assert new30 != hashes[30]
    crash_during_rollback(root, 10)
    complete_interrupted_rollback(root)
    got = sorted((e.step, e.record_sha256, e.to) for e in read_rolled_back(root))
    assert got == sorted([(30, hashes[30], 20), (20, hashes[20], 10), (30, new30, 10)])
    assert json.loads((root / ROLLED_BACK_FILENAME).read_text())["format_version"] == 1


def test_pull_never_brings_back_a_step_a_rollback_moved_out_nor_runs_beside_one(
    root, tmp_path, capsys
):
    """Found by review: `verl-ckpt pull` read neither the record of rolled-back steps nor a
    pending rollback's intent. A pull from a remote tier holding the very save of step 30
    that `rollback --to 20` moved out put it back (exit 0, no word), and the next start
    moved the tracker forward to it: the rollback undone. A pull during an interrupted
    rollback put back a step it had already moved, and the rollback could not finish."""
    import shutil

    remote = tmp_path / "remote"
    shutil.copytree(root, remote)  # the remote tier holds the same saves (file:// URL)
    url = f"file://{remote}"
    assert run_cli(capsys, "rollback", root, "--to", 20)[0] == 0
    code, _, err = run_cli(capsys, "pull", url, root)
    assert code == 1 and "would undo that rollback" in err and "rollback" in err, err
    assert not is_committed(step_dir(root, 30)) and read_tracker(root) == 20
    # Into another directory it is pulled as usual.
    assert run_cli(capsys, "pull", url, tmp_path / "elsewhere")[0] == 0
    assert is_committed(step_dir(tmp_path / "elsewhere", 30))

    crash_during_rollback(root, 10)
    code, _, err = run_cli(capsys, "pull", url, root, "--step", 20)
    assert code == 1 and "was interrupted" in err, err
    assert run_cli(capsys, "rollback", root, "--to", 10)[0] == 0  # and it can finish


@pytest.mark.parametrize("below", ["global_step_20", "global_step_20/actor"])
def test_pull_refuses_a_destination_in_a_step_directory(root, tmp_path, capsys, below):
    """Found by review: `verl-ckpt pull URL ROOT/global_step_20` pulled into the committed
    step 20, writing a lock file and a nested global_step_10 into it; ROOT was not checked
    as every other command's is."""
    import shutil

    remote = tmp_path / "remote"
    shutil.copytree(root, remote)
    before = tree(step_dir(root, 20))
    code, out, err = run_cli(capsys, "pull", f"file://{remote}", root / below, "--step", 10)
    assert (code, out) == (2, "") and err.count("\n") == 1, err
    assert f"ROOT {root / below} is" in err and "step directory" in err, err
    assert tree(step_dir(root, 20)) == before


def test_export_into_the_root_holds_its_lock_and_stays_out_of_its_step_namespace(
    root, holders, capsys
):
    """Found by review: `export ROOT --role actor OUT` took the root's lock only without OUT:
    with OUT in the root (a new global_step_99, or a directory inside a committed step) it
    ran beside the job holding the root, and wrote a step of its own. Now OUT in the step
    namespace is refused, and OUT elsewhere in the root takes the lock."""
    before = tree(root)
    link = root.parent / "link"  # the same root through a link (found by review too)
    link.symlink_to(root.parent)
    for given, out in (
        (root, root / "global_step_99"),
        (root, root / "global_step_20" / "weights"),
        (link / root.name, link / root.name / "global_step_99"),
    ):
        code, out_text, err = run_cli(capsys, "export", given, "--step", 20, "--role", "actor", out)
        assert (code, out_text) == (2, "") and err.count("\n") == 1, err
        assert "is in the step directory" in err, err
    proc = holders.start(root)
    code, out_text, err = run_cli(
        capsys, "export", root, "--step", 20, "--role", "actor", root / "hf"
    )
    assert (code, out_text) == (2, "") and "is in use by job" in err, err
    holders.kill(proc)
    assert tree(root) == before
