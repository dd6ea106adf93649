"""Start-up of the recipe as a user runs it (`python -m recipes.ppo_toy`): every mistake the
config reveals about the checkpoint root is one line naming the key or path, exit status 2,
before Ray starts, with nothing written or deleted (protocol step 0; I1, I3). No Ray runs
in these tests: each is refused before it would start.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.lock_holder import HolderProcesses
from tests.test_recipe import REPO_ROOT, recipe_env
from verl_ckpt import prepare_start
from verl_ckpt.store.commit_record import CommitRecord, write_commit_record
from verl_ckpt.store.layout import step_dir
from verl_ckpt.store.tracker import write_tracker


def committed(root: Path, step: int) -> Path:
    path = step_dir(root, step)
    path.mkdir(parents=True)
    write_commit_record(path, CommitRecord(step, {"actor": 2, "critic": 1, "driver": 1}, []))
    return path


def snapshot(root: Path) -> list:
    if not root.exists():
        return []
    return sorted(
        (str(p.relative_to(root)), p.stat().st_size if p.is_file() else -1) for p in root.rglob("*")
    )


def run_recipe(tmp_path: Path, *overrides: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "recipes.ppo_toy", f"hydra.run.dir={tmp_path / 'out'}", *overrides],
        cwd=REPO_ROOT,
        env=recipe_env(),
        capture_output=True,
        text=True,
        timeout=180,
    )


def assert_refused_in_one_line(done: subprocess.CompletedProcess, *names: str) -> str:
    assert done.returncode == 2, done.stdout[-2000:] + done.stderr[-2000:]
    output = done.stdout + done.stderr
    assert "Traceback" not in output and "embedded Ray" not in output, output[-3000:]
    lines = [line for line in done.stderr.splitlines() if line.startswith("ppo_toy:")]
    assert len(lines) == 1, done.stderr[-3000:]
    for name in names:
        assert name in lines[0], lines[0]
    return lines[0]


def test_I3_an_older_resume_step_is_refused_before_ray_and_nothing_is_deleted(tmp_path):
    """Issue "Trust" #1 and #3, as reported: resume_path at step 30 of a root that committed
    step 40, with max_ckpt_to_keep=1, used to start, delete step 30 at start-up, then die."""
    root = tmp_path / "ckpt"
    old = committed(root, 30)
    committed(root, 40)
    write_tracker(root, 40)
    before = snapshot(root)
    done = run_recipe(
        tmp_path,
        f"checkpoint.root_dir={root}",
        "checkpoint.resume_mode=resume_path",
        f"checkpoint.resume_from_path={old}",
        "checkpoint.max_ckpt_to_keep=1",
    )
    line = assert_refused_in_one_line(done, "newer committed steps [40]", str(root))
    assert f"verl-ckpt rollback {root} --to 30" in line and "new checkpoint.root_dir" in line
    assert snapshot(root) == before


def _root_is_a_file(tmp_path: Path) -> list[str]:
    (tmp_path / "file").write_text("x")
    return [f"checkpoint.root_dir={tmp_path / 'file'}"]


def _tracker_is_garbage(tmp_path: Path) -> list[str]:
    committed(tmp_path / "ckpt", 2)
    (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").write_text("two\n")
    return [f"checkpoint.root_dir={tmp_path / 'ckpt'}"]


def _tracker_is_a_directory(tmp_path: Path) -> list[str]:
    (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").mkdir(parents=True)
    return [f"checkpoint.root_dir={tmp_path / 'ckpt'}"]


def _resume_path_missing(tmp_path: Path) -> list[str]:
    return [
        f"checkpoint.root_dir={tmp_path / 'ckpt'}",
        "checkpoint.resume_mode=resume_path",
        f"checkpoint.resume_from_path={tmp_path / 'ckpt' / 'global_step_9'}",
    ]


def _resume_path_uncommitted(tmp_path: Path) -> list[str]:
    step_dir(tmp_path / "ckpt", 9).mkdir(parents=True)
    return [
        f"checkpoint.root_dir={tmp_path / 'ckpt'}",
        "checkpoint.resume_mode=resume_path",
        f"checkpoint.resume_from_path={step_dir(tmp_path / 'ckpt', 9)}",
    ]


def _path_component_too_long(tmp_path: Path) -> list[str]:
    return [f"checkpoint.root_dir={tmp_path / ('x' * 300) / 'ckpt'}"]


def _disable_over_committed_steps(tmp_path: Path) -> list[str]:
    committed(tmp_path / "ckpt", 10)
    return [f"checkpoint.root_dir={tmp_path / 'ckpt'}", "checkpoint.resume_mode=disable"]


@pytest.mark.parametrize(
    ("make", "names"),
    [
        (_root_is_a_file, ["checkpoint.root_dir=", "is not a directory"]),
        (_tracker_is_garbage, ["latest_checkpointed_iteration.txt", "'two\\n'"]),
        (_tracker_is_a_directory, ["latest_checkpointed_iteration.txt", "is a directory"]),
        (_resume_path_missing, ["checkpoint.resume_from_path=", "does not exist"]),
        (_resume_path_uncommitted, ["checkpoint.resume_from_path", "not a committed step"]),
        (_path_component_too_long, ["checkpoint.root_dir=", "300 bytes"]),
        (_disable_over_committed_steps, ["resume_mode=disable", "[10]"]),
    ],
    ids=lambda value: getattr(value, "__name__", "").strip("_") or None,
)
def test_a_mistake_about_the_root_is_one_line_before_ray_with_nothing_written(
    tmp_path, make, names
):
    overrides = make(tmp_path)
    before = snapshot(tmp_path)
    done = run_recipe(tmp_path, *overrides)
    assert_refused_in_one_line(done, *names)
    assert [e for e in snapshot(tmp_path) if not e[0].startswith("out")] == [
        e for e in before if not e[0].startswith("out")
    ]


def test_one_root_one_job_a_second_job_is_refused_naming_the_first(tmp_path):
    """A scheduler's double launch: the second job on the same root is refused before Ray
    starts, naming the holder (host, pid, since when); once the holder dies (a real
    SIGKILL), nothing stale blocks the restart."""
    root = tmp_path / "ckpt"
    holders = HolderProcesses()
    try:
        holder = holders.start(root)
        done = run_recipe(tmp_path, f"checkpoint.root_dir={root}")
        line = assert_refused_in_one_line(done, f"checkpoint root {root} is in use by")
        assert f"pid {holder.pid}" in line and "since" in line and "host" in line
        holders.kill(holder)
        plan = prepare_start({"root_dir": str(root)})
        plan.release()
    finally:
        holders.close()
