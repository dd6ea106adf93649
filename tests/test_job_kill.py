"""SIGKILL of the whole job in the middle of a save, then resume (invariants I1, I3).

The job is the real recipe (driver, embedded Ray, Megatron ranks, finalizer) in a session of
its own; the kill is a real SIGKILL of every process of that session. The documented fault
hook only holds the critic's write open so that the kill lands mid-save.
"""

from __future__ import annotations

import os
import shutil
import signal
import time
from pathlib import Path

import psutil
import pytest

from tests.test_recipe import finish, read_metrics, recipe_env, start_recipe
from verl_ckpt import read_commit_record, read_tracker, step_dir
from verl_ckpt.commit_record import is_committed
from verl_ckpt.faults import ENV_VAR

pytestmark = pytest.mark.slow


def recipe(out_dir: Path, root: Path, *overrides: str, env: dict, new_session: bool = False):
    return start_recipe(
        out_dir,
        f"checkpoint.root_dir={root}",
        "checkpoint.save_freq=2",
        *overrides,
        env=env,
        new_session=new_session,
    )


def kill_session(session_id: int) -> None:
    """SIGKILL every process of that session (the job and the Ray it started), only those."""
    victims = []
    for proc in psutil.process_iter():
        try:
            if os.getsid(proc.pid) == session_id:
                victims.append(proc)
        except (ProcessLookupError, psutil.NoSuchProcess):
            continue
    for proc in victims:
        try:
            proc.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(victims, timeout=30)


def wait_while_running(proc, condition, what: str, timeout_s: float = 240) -> None:
    """Poll `condition` until it holds, failing if the job exits first or `timeout_s` ends."""
    deadline = time.monotonic() + timeout_s
    while not condition() and time.monotonic() < deadline:
        assert proc.poll() is None, proc.stdout.read()[-4000:]
        time.sleep(0.2)
    assert condition(), what


def test_I1_I3_whole_job_killed_mid_save_resumes_from_the_tracker(tmp_path, four_step_run):
    # A copy of a run of 4 steps that committed steps 2 and 4.
    root = Path(shutil.copytree(four_step_run / "ckpt", tmp_path / "ckpt"))
    assert read_tracker(root) == 4

    # Run 2 resumes at step 4; its save of step 6 hangs in the critic's write: kill it all.
    hung = recipe(
        tmp_path / "run2",
        root,
        "trainer.total_steps=8",
        env=recipe_env(**{ENV_VAR: "write:critic=hang"}),
        new_session=True,
    )
    try:
        actor_files = step_dir(root, 6) / "actor"
        wait_while_running(hung, lambda: any(actor_files.glob("*.distcp")), "step 6 never started")
    finally:
        kill_session(hung.pid)
        hung.communicate()
    assert read_tracker(root) == 4
    assert not is_committed(step_dir(root, 6))
    stale = step_dir(root, 6) / "critic" / "__stale_from_the_killed_run.distcp"
    stale.write_bytes(b"stale")

    # Run 3 resumes from the tracker (step 4), ignores and reports the partial step 6, and
    # saves step 6 again with none of the killed run's files mixed in.
    keep_all = "checkpoint.max_ckpt_to_keep=null"
    out = finish(
        recipe(tmp_path / "run3", root, "trainer.total_steps=8", keep_all, env=recipe_env())
    )
    assert "global_step_4 (step 4)" in out
    assert "uncommitted step directories [6]" in out or "uncommitted leftover" in out
    assert read_tracker(root) == 8
    assert sorted(read_metrics(tmp_path / "run3" / "metrics.jsonl")) == [5, 6, 7, 8]
    record = read_commit_record(step_dir(root, 8))
    assert record.step == 8
    step6 = step_dir(root, 6)
    assert not stale.exists()
    on_disk = {str(p.relative_to(step6)) for p in step6.rglob("*") if p.is_file()} - {
        "verl_ckpt_commit.json"
    }
    assert on_disk == {f.path for f in read_commit_record(step6).files}


def test_I2_whole_job_killed_between_the_record_and_the_tracker_resumes_from_that_step(tmp_path):
    """Issue "Trust" #2: the job is killed after step 2's commit record is durable and before
    the tracker moved (the finalizer hangs at that moment). The commit record is the commit
    point: the next run rolls the tracker forward and resumes from step 2. It used to find
    no tracker beside a committed step and refuse to start (or, with an older tracker, to
    resume from the older step and die when it reached step 2 again)."""
    root = tmp_path / "ckpt"
    hung = recipe(
        tmp_path / "run1",
        root,
        "trainer.total_steps=2",
        env=recipe_env(**{ENV_VAR: "tracker=hang"}),
        new_session=True,
    )
    try:
        wait_while_running(
            hung, lambda: is_committed(step_dir(root, 2)), "step 2's record never appeared"
        )
    finally:
        kill_session(hung.pid)
        hung.communicate()
    assert read_tracker(root) is None

    out = finish(recipe(tmp_path / "run2", root, "trainer.total_steps=4", env=recipe_env()))
    assert "moving the tracker forward" in out
    assert f"resumed from {step_dir(root, 2)} (step 2)" in out
    assert read_tracker(root) == 4
    assert sorted(read_metrics(tmp_path / "run2" / "metrics.jsonl")) == [3, 4]
