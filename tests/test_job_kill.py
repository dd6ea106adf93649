"""SIGKILL of the whole job between a step's commit record and its tracker, then resume
(invariant I2). The kill in the middle of a save (I1, I3) is in tests/test_recipe_preemption.py,
where it follows a preemption save past its grace period.

The job is the real recipe (driver, embedded Ray, Megatron ranks, finalizer) in a session of
its own; the kill is a real SIGKILL of every process of that session. The documented fault
hook only holds the finalizer at the moment before the tracker is written.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import psutil
import pytest

from tests.test_recipe import finish, read_metrics, recipe_env, start_recipe
from verl_ckpt import read_tracker, step_dir
from verl_ckpt.protocol.faults import ENV_VAR
from verl_ckpt.store.commit_record import is_committed

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
