"""The preemption guard (verl_ckpt/driver/preemption.py) in this process: real signals sent to
ourselves with os.kill, the real environment variable, real commit records on disk. The
recipe tests (test_recipe_preemption.py) run it end to end: `ray job stop`, SIGTERM, SIGKILL.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest
from omegaconf import OmegaConf

from tests.helpers import wait_until
from tests.test_recipe import REPO_ROOT, recipe_env
from verl_ckpt import (
    PREEMPTED_EXIT_STATUS,
    CheckpointConfigError,
    CheckpointError,
    PreemptionConfig,
    PreemptionGuard,
    prepare_start,
    step_dir,
    to_checkpoint_config,
)
from verl_ckpt.driver.preemption import stop_rule
from verl_ckpt.protocol.config import check_deadline_env
from verl_ckpt.store.commit_record import CommitRecord, write_commit_record

DEADLINE_VAR = "VERL_CKPT_TEST_DEADLINE"


# ---- configuration -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("settings", "key"),
    [
        ({"preemption": {"signals": ["SIGNOPE"]}}, "checkpoint.preemption.signals"),
        ({"preemption": {"signals": ["SIGKILL"]}}, "checkpoint.preemption.signals"),
        # From helper-58's review: a child's exit (embedded Ray's processes) or a terminal
        # resize would save and exit 75; a handler of SIGSEGV returns to the fault.
        ({"preemption": {"signals": ["SIGCHLD"]}}, "checkpoint.preemption.signals"),
        ({"preemption": {"signals": ["SIGWINCH"]}}, "checkpoint.preemption.signals"),
        ({"preemption": {"signals": ["SIGTERM", "SIGSEGV"]}}, "checkpoint.preemption.signals"),
        ({"preemption": {"signals": ["SIGIOT"]}}, "checkpoint.preemption.signals"),  # SIGABRT
        ({"preemption": {"grace_s": 0}}, "checkpoint.preemption.grace_s"),
        ({"preemption": {"margin_s": -1}}, "checkpoint.preemption.margin_s"),
        ({"preemption": {"deadline_env": "A=B"}}, "checkpoint.preemption.deadline_env"),
        ({"resume_verify": "sha"}, "checkpoint.resume_verify"),
        ({"resume_fallback": "newest"}, "checkpoint.resume_fallback"),
    ],
)
def test_bad_preemption_and_resume_settings_fail_naming_the_key(settings, key):
    with pytest.raises(CheckpointConfigError, match=key.replace(".", r"\.")):
        to_checkpoint_config(OmegaConf.create(settings))


def test_preemption_defaults_and_signals_off():
    config = to_checkpoint_config({})
    assert config.preemption.signals == ["SIGTERM", "SIGUSR1"]
    assert (config.resume_verify, config.resume_fallback) == ("record", "error")
    off = to_checkpoint_config(OmegaConf.create({"preemption": {"signals": []}}))
    before = signal.getsignal(signal.SIGTERM)
    with PreemptionGuard(off.preemption):
        assert signal.getsignal(signal.SIGTERM) is before
    assert PREEMPTED_EXIT_STATUS == 75


# ---- signals -------------------------------------------------------------------------------


def test_I5_a_signal_only_sets_a_flag_and_a_second_one_never_aborts(tmp_path):
    """The handler records; the loop learns of it at its step boundary, with the deadline
    `grace_s` after the first signal. A second signal is remembered, the request unchanged."""
    guard = PreemptionGuard(PreemptionConfig(signals=["SIGUSR1", "SIGUSR2"], grace_s=30.0))
    with guard:
        assert guard.stop_requested() is None
        sent = time.monotonic()
        os.kill(os.getpid(), signal.SIGUSR1)
        wait_until(lambda: guard.signals_received, 5, "SIGUSR1 not recorded")
        request = guard.stop_requested()
        assert request.reason == "SIGUSR1 received"
        assert sent <= request.since <= time.monotonic()
        assert request.deadline == pytest.approx(request.since + 30.0)
        assert 0 < request.remaining_s() <= 30.0
        os.kill(os.getpid(), signal.SIGUSR2)
        wait_until(lambda: len(guard.signals_received) == 2, 5, "SIGUSR2 not recorded")
        assert guard.signals_received == ["SIGUSR1", "SIGUSR2"]
        assert guard.stop_requested() is request


def test_close_puts_back_the_handlers_found_at_install():
    seen = []
    previous = signal.signal(signal.SIGUSR1, lambda signum, frame: seen.append(signum))
    try:
        with PreemptionGuard(PreemptionConfig(signals=["SIGUSR1"])) as guard:
            os.kill(os.getpid(), signal.SIGUSR1)
            wait_until(lambda: guard.signals_received, 5, "SIGUSR1 not recorded")
            assert seen == []
        os.kill(os.getpid(), signal.SIGUSR1)
        wait_until(lambda: seen, 5, "the previous handler was not restored")
    finally:
        signal.signal(signal.SIGUSR1, previous)


def test_handlers_outside_the_main_thread_are_refused_naming_the_key():
    errors = []

    def install():
        try:
            PreemptionGuard(PreemptionConfig()).install()
        except CheckpointError as exc:
            errors.append(str(exc))

    thread = threading.Thread(target=install)
    thread.start()
    thread.join(10)
    assert len(errors) == 1 and "checkpoint.preemption.signals" in errors[0], errors


# ---- deadline ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("left", "step", "save", "margin", "stop"),
    [
        (89.0, 10.0, 20.0, 60.0, True),
        (91.0, 10.0, 20.0, 60.0, False),
        (-5.0, 0.0, 0.0, 0.0, True),  # already past: saving costs nothing more than dying
        (1.0, 0.0, 0.0, 0.0, False),
    ],
)
def test_deadline_rule_one_more_step_and_its_save_must_fit(left, step, save, margin, stop):
    assert stop_rule(left, step, save, margin) is stop


def test_deadline_env_is_read_once_and_a_bad_value_names_the_variable(monkeypatch, tmp_path):
    config = PreemptionConfig(deadline_env=DEADLINE_VAR)
    monkeypatch.delenv(DEADLINE_VAR, raising=False)
    assert check_deadline_env(config) is None
    monkeypatch.setenv(DEADLINE_VAR, "1790000000.5")
    assert check_deadline_env(config) == 1790000000.5
    monkeypatch.setenv(DEADLINE_VAR, "tomorrow")
    with pytest.raises(CheckpointConfigError) as failure:
        check_deadline_env(config)
    assert DEADLINE_VAR in str(failure.value) and "checkpoint.preemption.deadline_env" in str(
        failure.value
    )
    # Start-up refuses it before anything is locked or written.
    with pytest.raises(CheckpointConfigError, match=DEADLINE_VAR):
        prepare_start(
            {"root_dir": str(tmp_path / "ckpt"), "preemption": {"deadline_env": DEADLINE_VAR}}
        )
    assert not (tmp_path / "ckpt").exists()


def test_deadline_counts_the_measured_save_until_its_commit_record(monkeypatch, tmp_path):
    """A save is timed from save_started() to the commit record's `committed_at`. The record
    here is written by the test with a commit 150 s after the start: a long save that a unit
    test cannot wait for (the only stand-in in this file)."""
    root = tmp_path / "ckpt"
    monkeypatch.setenv(DEADLINE_VAR, str(time.time() + 100))
    config = PreemptionConfig(signals=[], deadline_env=DEADLINE_VAR, margin_s=0.0)
    guard = PreemptionGuard(config, root)
    assert guard.stop_requested() is None  # 100 s left, nothing measured yet
    guard.save_started(7)
    assert guard.stop_requested() is None  # not committed yet: not counted
    step_dir(root, 7).mkdir(parents=True)
    write_commit_record(
        step_dir(root, 7), CommitRecord(7, {"driver": 1}, [], committed_at=time.time() + 150)
    )
    request = guard.stop_requested()
    assert request is not None and DEADLINE_VAR in request.reason
    assert "its save (150" in request.reason
    assert request.deadline == pytest.approx(request.since + config.grace_s)


def test_a_deadline_stop_waits_no_longer_than_the_deadline_itself(monkeypatch):
    """A stop decided by the deadline rule gave its save checkpoint.preemption.grace_s (60 s)
    from the decision, even with the job's deadline 20 s away: the wait ran into the
    scheduler's SIGKILL instead of ending with a clean error. Now it ends at the deadline."""
    monkeypatch.setenv(DEADLINE_VAR, str(time.time() + 20))
    config = PreemptionConfig(signals=[], deadline_env=DEADLINE_VAR, margin_s=30.0, grace_s=60)
    request = PreemptionGuard(config).stop_requested()
    assert request is not None
    assert request.deadline - request.since == pytest.approx(20, abs=2)
    assert "waiting at most" in request.reason and "until that deadline" in request.reason


def test_deadline_already_past_stops_at_the_first_boundary(monkeypatch):
    monkeypatch.setenv(DEADLINE_VAR, str(time.time() - 5))
    guard = PreemptionGuard(PreemptionConfig(signals=[], deadline_env=DEADLINE_VAR))
    assert guard.stop_requested() is not None


def test_recipe_refuses_a_malformed_deadline_before_ray(tmp_path):
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "recipes.ppo_toy",
            f"hydra.run.dir={tmp_path / 'out'}",
            f"checkpoint.root_dir={tmp_path / 'ckpt'}",
            f"checkpoint.preemption.deadline_env={DEADLINE_VAR}",
        ],
        cwd=REPO_ROOT,
        env=recipe_env(**{DEADLINE_VAR: "soon"}),
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode == 2, done.stderr[-2000:]
    (line,) = [x for x in done.stderr.splitlines() if x.startswith("ppo_toy:")]
    assert f"${DEADLINE_VAR}='soon'" in line and "embedded Ray" not in done.stdout + done.stderr


# ---- bounded by the grace period -----------------------------------------------------------


def test_I5_a_participant_still_busy_at_the_deadline_is_named(ray_local, tmp_path):
    """The out-of-schedule save waits for every participant's snapshot only until the stop's
    deadline: one real Ray task answers, one is held until the test releases it."""
    import ray

    from verl_ckpt import PreemptionError, StopRequest, wait_before_deadline

    @ray.remote(num_cpus=0)
    def snapshot(release: str | None) -> str:
        deadline = time.monotonic() + 120
        while release and not os.path.exists(release) and time.monotonic() < deadline:
            time.sleep(0.01)
        return "taken"

    release = tmp_path / "release"
    refs = [snapshot.remote(None), snapshot.remote(str(release))]
    ray.get(refs[0])
    now = time.monotonic()
    request = StopRequest("SIGTERM received", now, now + 0.5, 0.5)
    try:
        with pytest.raises(PreemptionError) as failure:
            wait_before_deadline(refs, ["actor rank 0", "critic rank 0"], 7, request)
    finally:
        release.touch()
    message = str(failure.value)
    assert "step 7" in message and "checkpoint.preemption.grace_s=0.5" in message
    assert "no snapshot yet from critic rank 0;" in message and "actor rank 0" not in message
    assert ray.get(refs[1]) == "taken"
